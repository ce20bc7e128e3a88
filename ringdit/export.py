"""Export a training checkpoint's weights to safetensors, for sampling and fine-tuning without Lightning.

    python -m ringdit.export ckpt_path=outputs/train/runs/<run>/checkpoints/last.ckpt out=weights.safetensors
    python -m ringdit.export ckpt_path=... weights=model      # the raw trained weights instead of the EMA

The file holds the EMA weights (or ``weights=model``) and, as metadata, the model, data, objective and sampling
configs: ``python infer.py ckpt_path=weights.safetensors`` and ``python train.py init_from=weights.safetensors``
use it directly. ``ckpt_path`` may be a sharded (FSDP) checkpoint folder: it is consolidated on this process.

    python -m ringdit.export ckpt_path=.../last.ckpt out=adapter/ lora=true   # a LoRA run's adapter, diffusers format

writes ``adapter/pytorch_lora_weights.safetensors``, which diffusers' ``load_lora_adapter`` /
``pipeline.load_lora_weights("adapter/")`` read (a two-expert model's low-noise expert's adapter in
``adapter/transformer_2/``, for ``load_lora_weights(..., load_into_transformer_2=True)``).

    python -m ringdit.export ckpt_path=.../last.ckpt out=adapter/ format=comfyui    # a LoRA run's adapter, ComfyUI's

writes ``adapter/adapter.safetensors`` in ComfyUI's LoRA format (the model's original layer names under
``diffusion_model.``, ``lora_down`` / ``lora_up`` / ``alpha``) for Wan, SkyReels-V2, HunyuanVideo 1.5, LTX-Video,
Flux and QwenImage; a two-expert Wan 2.2 model's as ``adapter_high_noise.safetensors`` and
``adapter_low_noise.safetensors``, as the Wan 2.2 LoRAs are published (``ringdit.checkpoints.lora_formats``).

    python -m ringdit.export ckpt_path=.../last.ckpt out=finetuned/ format=diffusers [base=<pipeline folder>]

writes a whole diffusers pipeline that ``DiffusionPipeline.from_pretrained("finetuned/")`` loads: the base
pipeline's components (VAE, text encoders, tokenizers, scheduler, ``model_index.json``; the base is the folder the run
recorded as ``model.pretrained``, or ``base=``) and the trained ``transformer/`` (and ``transformer_2/``, a two-expert
model's low-noise expert), saved by diffusers' ``save_pretrained`` in shards of at most ``max_shard_size``. A run
without a pipeline folder gets its transformer folders only, and the command says so.

    python -m ringdit.export ckpt_path=.../last.ckpt lora=true merge=true [merge_strength=0.8] [format=diffusers]

writes a LoRA run's base with its adapter fused in -- each adapted weight ``W + strength x alpha / r x B A``, fused by
peft's own merge -- as a whole model: ``format=ringdit`` (the default: ``<ckpt>_merged.safetensors`` with the run's
configs, which ``infer.py`` and ``init_from`` read) or ``format=diffusers`` (``<ckpt>_merged_diffusers/``, a pipeline
folder as above). The base is found as ``infer.py`` finds it: ``base=``, else the run's ``init_from``, else its
``model.pretrained``; it is checked against the adapter before anything is written, built on this process at its own
precision (not the run's bf16 / fp8 copy of it) and written at that precision.

An existing ``out`` is never replaced unless ``overwrite=true`` (then it is replaced whole, by renames: a kill leaves
the old one). A LoRA run's checkpoint holds only the adapters, so its plain export
(``lora=false``) is refused: it would be a model file without its model; ``lora=true merge=true`` writes the model
with the adapter fused in, and ``infer.py ckpt_path=<the .ckpt>`` samples it on its base.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from ringdit.commands.cli import hydra_main, user_errors
from ringdit.common.errors import ConfigError, require_number

FORMATS = ("ringdit", "diffusers", "comfyui")
LORA_FORMATS = ("diffusers", "comfyui")  # a LoRA adapter's: diffusers' pytorch_lora_weights, or ComfyUI's


@hydra_main("export")  # conf/export.yaml
def export(cfg: DictConfig) -> None:
    with user_errors():  # a wrong setting or checkpoint (CheckpointError): one line, exit code 2
        if cfg.weights not in ("ema", "model"):
            raise ConfigError(f"weights must be ema or model, got {cfg.weights!r}")
        for name in ("lora", "merge", "overwrite"):
            if not isinstance(cfg[name], bool):
                raise ConfigError(f"{name} must be true or false, got {cfg[name]!r}")
        if cfg.format is not None and cfg.format not in FORMATS:
            raise ConfigError(f"format={cfg.format!r} is not one of {', '.join(FORMATS)}: ringdit writes one "
                              f".safetensors file with the run's configs, diffusers a pipeline folder (or, with "
                              f"lora=true, diffusers' LoRA file), comfyui a LoRA file with ComfyUI's layer names")
        merge = cfg.merge  # a LoRA run's adapter fused into its base: a whole model, in a model format
        if merge:
            require_number("merge_strength", cfg.merge_strength)
            if cfg.format == "comfyui":
                raise ConfigError("merge=true format=comfyui: a merged LoRA is a whole model, written as "
                                  "format=ringdit (one .safetensors) or format=diffusers (a pipeline folder); "
                                  "ComfyUI's format is the adapter's alone: drop merge=true")
        lora = cfg.lora or cfg.format == "comfyui" or merge  # comfyui is a LoRA format only
        fmt = cfg.format or ("diffusers" if lora and not merge else "ringdit")
        if lora and not merge and fmt not in LORA_FORMATS:
            raise ConfigError(f"lora=true format={fmt}: a LoRA adapter exports as format=diffusers (diffusers' "
                              f"pytorch_lora_weights.safetensors) or format=comfyui, not as a {fmt} model file; "
                              f"add merge=true for the base with the adapter fused in")
        if cfg.base is not None and not merge and (lora or fmt != "diffusers"):
            raise ConfigError(f"base={cfg.base} names the pipeline a format=diffusers model export copies; "
                              f"{'a LoRA export' if lora else f'format={fmt}'} takes none: drop base=")
        ckpt = Path(str(cfg.ckpt_path))
        suffix = "_merged" if merge else ""
        out = cfg.out if cfg.out is not None else str(
            ckpt.with_name(f"{ckpt.stem}_lora") if lora and not merge else
            ckpt.with_name(f"{ckpt.stem}{suffix}_diffusers") if fmt == "diffusers" else
            ckpt.with_name(f"{ckpt.stem}{suffix}.safetensors"))
        from ringdit.checkpoints.location import checked_output
        from ringdit.checkpoints.safetensors_export import export_safetensors
        from ringdit.models.lora import lora_enabled
        from ringdit.spec.checkpoint import recorded_hparams

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
                from ringdit.checkpoints.diffusers_export import export_diffusers

                written, note = export_diffusers(str(ckpt), str(out), prefer=cfg.weights, base=pipeline_base(cfg.base),
                                                 max_shard_size=cfg.max_shard_size, weights=weights)
            else:
                from ringdit.checkpoints.safetensors_export import write_safetensors

                written = write_safetensors(*weights, out, what=what)
        elif lora:
            written = export_adapter(str(ckpt), Path(out).expanduser(), fmt, cfg.weights)
        elif fmt == "diffusers":
            from ringdit.checkpoints.diffusers_export import export_diffusers

            written, note = export_diffusers(str(ckpt), str(out), prefer=cfg.weights, base=cfg.base,
                                             max_shard_size=cfg.max_shard_size)
        else:
            written = export_safetensors(str(ckpt), str(out), prefer=cfg.weights)
    what = f"model with its LoRA adapter fused at strength {cfg.merge_strength:g}" if merge else \
        "LoRA adapter" if lora else "model and configs"
    print(f"wrote the {cfg.weights} weights' {what} to {written}")
    if note:
        print(f"note: {note}")


def export_adapter(ckpt: str, out: Path, fmt: str, prefer: str) -> Path:
    """A LoRA run's adapter in ``fmt`` (diffusers or comfyui), written into a new folder that then replaces ``out``
    whole: an overwrite leaves no file of the previous export behind, and a kill leaves the previous one."""
    import shutil

    from ringdit.checkpoints.location import replace_folder, temporary_folder
    from ringdit.checkpoints.weights import read_weights

    state, info = read_weights(ckpt, prefer=prefer)
    tmp = Path(temporary_folder(out))
    try:
        if fmt == "comfyui":
            written = export_comfyui(state, info, tmp, name=out.name)
        else:
            from ringdit.models.lora import export_lora

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
    from ringdit.models.build import build_model
    from ringdit.checkpoints.weights import FILE_CONFIGS, read_weights
    from ringdit.models.lora import adapter_state, load_adapter, load_null_condition, merged_state
    from ringdit.spec.checkpoint import LoraBase

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
    import torch
    from safetensors.torch import save_file

    from ringdit.common.atomic import atomic_write
    from ringdit.checkpoints.lora_formats import comfyui_lora
    from ringdit.models.lora import ADAPTER_NAME, adapter_state
    from ringdit.spec.model import ModelSpec, model_class

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


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (default ``sys.argv[1:]``); its exit code: 0, or 2 for a settings mistake."""
    try:
        export(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
