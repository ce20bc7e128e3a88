"""``python -m ringdit.export``'s work once its settings are checked (``ringdit.export``): read the checkpoint, check
it against what was asked (a LoRA run's adapter, a merge, a format), and write the model, the adapter or the merged
model into ``out``. Apart from the command so that ``--help`` and a wrong setting answer before torch loads."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig
from safetensors.torch import save_file

from ringdit.checkpoints.diffusers_export import export_diffusers
from ringdit.checkpoints.location import checked_output, replace_folder, temporary_folder
from ringdit.checkpoints.lora_formats import comfyui_lora
from ringdit.checkpoints.safetensors_export import export_safetensors, write_safetensors
from ringdit.checkpoints.weights import FILE_CONFIGS, read_weights
from ringdit.common.atomic import atomic_write
from ringdit.common.errors import ConfigError
from ringdit.models.build import build_model
from ringdit.models.lora import (
    ADAPTER_NAME,
    adapter_state,
    export_lora,
    load_adapter,
    load_null_condition,
    lora_enabled,
    merged_state,
)
from ringdit.spec.checkpoint import LoraBase, recorded_hparams
from ringdit.spec.model import ModelSpec, model_class


def write_export(cfg: DictConfig, ckpt: Path, out: str, *, fmt: str, lora: bool,
                 merge: bool) -> tuple[Path, str | None]:
    """Export ``ckpt`` as the checked settings ``cfg`` ask (``fmt``, ``lora``, ``merge`` resolved by the command);
    returns what was written and a note for the user (or None). A checkpoint that does not fit the request raises
    ``ConfigError`` before anything is written."""
    recorded = recorded_hparams(str(ckpt)).get("lora")
    trained_lora = lora_enabled(recorded)
    trained_type = (recorded or {}).get("type") or "lora"
    if lora and not merge and fmt == "diffusers" and trained_type in ("loha", "lokr"):
        raise ConfigError(f"ckpt_path={ckpt} trained lora.type={trained_type}, which diffusers' LoRA format does "
                          f"not hold (it holds LoRA and DoRA adapters); fuse it into its base with lora=true "
                          f"merge=true")
    if not lora and trained_lora:
        raise ConfigError(f"ckpt_path={ckpt} is a LoRA run's checkpoint: it holds only the adapters, not a model; "
                          f"export the model with its adapter fused in with lora=true merge=true, the adapter "
                          f"with lora=true (diffusers' LoRA format) or format=comfyui, or sample it with infer.py "
                          f"ckpt_path={ckpt}")
    if merge and not trained_lora:
        raise ConfigError(f"merge=true fuses a LoRA run's adapter into its base, but ckpt_path={ckpt} is no LoRA "
                          f"run's checkpoint (it recorded no lora.rank > 0); drop lora=true merge=true")
    what = (f"lora=true merge=true format={fmt}" if merge else "format=comfyui" if fmt == "comfyui" else
            "lora=true" if cfg.format is None else f"lora=true format={fmt}") if lora else f"format={fmt}"
    # before reading any weights: the one guard for every destination (file or folder, existing, the checkpoint)
    folder = (lora and not merge) or fmt == "diffusers"
    if folder and Path(str(out)).suffix == ".safetensors":  # a file name where a folder is written
        raise ConfigError(f"out={out}: {what} writes a folder (the adapter file inside, one per expert of a "
                          f"two-expert model); give a folder, e.g. out={Path(str(out)).with_suffix('')}")
    checked_output(out, folder=folder, what=what, overwrite=cfg.overwrite, source=ckpt)
    note = None
    if merge:
        weights = merged_weights(str(ckpt), cfg.weights, cfg.merge_strength, cfg.base)
        if fmt == "diffusers":
            written, note = export_diffusers(str(ckpt), str(out), prefer=cfg.weights, base=pipeline_base(cfg.base),
                                             max_shard_size=cfg.max_shard_size, weights=weights)
        else:
            written = write_safetensors(*weights, out, what=what)
    elif lora:
        written = export_adapter(str(ckpt), Path(out).expanduser(), fmt, cfg.weights)
    elif fmt == "diffusers":
        written, note = export_diffusers(str(ckpt), str(out), prefer=cfg.weights, base=cfg.base,
                                         max_shard_size=cfg.max_shard_size)
    else:
        written = export_safetensors(str(ckpt), str(out), prefer=cfg.weights)
    return written, note


def export_adapter(ckpt: str, out: Path, fmt: str, prefer: str) -> Path:
    """A LoRA run's adapter in ``fmt`` (diffusers or comfyui), written into a new folder that then replaces ``out``
    whole: an overwrite leaves no file of the previous export behind, and a kill leaves the previous one."""
    state, info = read_weights(ckpt, prefer=prefer)
    tmp = Path(temporary_folder(out))
    try:
        if fmt == "comfyui":
            written = export_comfyui(state, info, tmp, name=out.name)
        else:
            written = export_lora(state, info.get("lora") or {}, tmp)
        replace_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out / written.relative_to(tmp)


def merged_weights(ckpt: str, prefer: str, strength: float, base: str | None) -> tuple[dict, dict]:
    """A LoRA run's base with its adapter (``prefer``: EMA or raw) fused at ``strength``, and the configs of the whole
    model it is: ``(state, info)`` as ``read_weights`` gives a model's. The base is found and checked as infer.py
    finds it (``LoraBase``: ``base``, else the run's init_from, else its model.pretrained), built on this process at
    its own precision (not the run's bf16 / fp8 copy of it), the adapter and the run's empty-prompt embedding loaded,
    and every adapted layer fused by peft (``ringdit.models.lora.merged_state``)."""
    state, info = read_weights(ckpt, prefer=prefer)
    lora_base = LoraBase.from_checkpoint(ckpt, state, info, base=base)
    spec, meta_model = lora_base.model_spec(1)
    lora_base.check(meta_model, state)  # the base fits the adapter: one line naming the first key that does not
    del meta_model
    model, _ = build_model(spec.config, init_from=lora_base.init_from, init_weights=lora_base.init_weights,
                           lora={**lora_base.settings, "base_dtype": None})
    load_adapter(model, adapter_state(state))
    load_null_condition(model, state)
    configs = {key: info[key] for key in FILE_CONFIGS if key in info}
    return merged_state(model, strength), {**configs, "model": lora_base.model, "weights": info.get("weights")}


def pipeline_base(base: str | None) -> str | None:
    """merge=true format=diffusers: ``base`` is the weights under the adapter; a pipeline folder also gives the
    export's other components, anything else none (the run's recorded pipeline does, when there is one)."""
    return base if base is not None and (Path(base).expanduser() / "model_index.json").is_file() else None


EXPERT_FILES = {"transformer.": "high_noise", "transformer_2.": "low_noise"}  # as Wan 2.2's LoRAs are published


def export_comfyui(state: dict, info: dict, out_dir: Path, name: str) -> Path:
    """Write a LoRA checkpoint's adapter (``state``, ``info`` as ``read_weights`` gives them) in ComfyUI's format to
    ``out_dir/<name>.safetensors``; a two-expert model's as ``<name>_high_noise`` and ``<name>_low_noise``. Returns
    the first file written."""
    model_cfg, lora = info.get("model") or {}, info.get("lora") or {}
    if not model_cfg or not model_class(model_cfg).diffusers_folders:
        raise ConfigError("format=comfyui names a diffusers family's layers; this checkpoint is ringdit's DiT: export "
                          "its adapter with lora=true format=diffusers")
    adapters = adapter_state(state)
    if not adapters or not lora.get("rank"):
        raise ConfigError("the checkpoint holds no LoRA adapter weights (trained without lora.rank > 0?)")
    if (lora.get("type") or "lora") != "lora":
        raise ConfigError(f"format=comfyui writes a plain LoRA (lora_down / lora_up / alpha), but this run trained "
                          f"lora.type={lora['type']}; export it with lora=true (diffusers' format carries DoRA's "
                          f"magnitudes) or fuse it into its base with lora=true merge=true")
    scale = (lora.get("alpha") or lora["rank"]) / lora["rank"]  # peft's alpha / rank
    _, model = ModelSpec.from_config(model_cfg, 1)  # on meta: the layers' sizes
    parts = [prefix for prefix, _ in model.subfolders()]
    written = []
    for prefix in parts:
        ours = {key[len(prefix):].replace(f".{ADAPTER_NAME}.", "."): value for key, value in adapters.items()
                if key.startswith(prefix)}
        if not ours:
            continue
        transformer = model.get_submodule(prefix.rstrip("."))
        out_features = {module: layer.out_features for module, layer in transformer.named_modules()
                        if isinstance(layer, torch.nn.Linear)}
        tensors = comfyui_lora(ours, scale, model.family.name, out_features)
        path = out_dir / (f"{name}.safetensors" if len(parts) == 1 else f"{name}_{EXPERT_FILES[prefix]}.safetensors")
        with atomic_write(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        written.append(path)
    return written[0]
