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

An existing ``out`` is never replaced unless ``overwrite=true`` (then it is replaced whole, by renames: a kill leaves
the old one). A LoRA run's checkpoint holds only the adapters, so its plain export
(``lora=false``) is refused: it would be a model file without its model; ``infer.py ckpt_path=<the .ckpt>`` samples
it on its base.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from ringdit.cli import hydra_main, user_errors
from ringdit.errors import ConfigError

FORMATS = ("ringdit", "diffusers", "comfyui")
LORA_FORMATS = ("diffusers", "comfyui")  # a LoRA adapter's: diffusers' pytorch_lora_weights, or ComfyUI's


@hydra_main("export")  # conf/export.yaml
def export(cfg: DictConfig) -> None:
    with user_errors():  # a wrong setting or checkpoint (CheckpointError): one line, exit code 2
        if cfg.weights not in ("ema", "model"):
            raise ConfigError(f"weights must be ema or model, got {cfg.weights!r}")
        for name in ("lora", "overwrite"):
            if not isinstance(cfg[name], bool):
                raise ConfigError(f"{name} must be true or false, got {cfg[name]!r}")
        if cfg.format is not None and cfg.format not in FORMATS:
            raise ConfigError(f"format={cfg.format!r} is not one of {', '.join(FORMATS)}: ringdit writes one "
                              f".safetensors file with the run's configs, diffusers a pipeline folder (or, with "
                              f"lora=true, diffusers' LoRA file), comfyui a LoRA file with ComfyUI's layer names")
        lora = cfg.lora or cfg.format == "comfyui"  # comfyui is a LoRA format only
        fmt = cfg.format or ("diffusers" if lora else "ringdit")
        if lora and fmt not in LORA_FORMATS:
            raise ConfigError(f"lora=true format={fmt}: a LoRA adapter exports as format=diffusers (diffusers' "
                              f"pytorch_lora_weights.safetensors) or format=comfyui, not as a {fmt} model file")
        if cfg.base is not None and (lora or fmt != "diffusers"):
            raise ConfigError(f"base={cfg.base} names the pipeline a format=diffusers model export copies; "
                              f"{'a LoRA export' if lora else f'format={fmt}'} takes none: drop base=")
        ckpt = Path(str(cfg.ckpt_path))
        out = cfg.out if cfg.out is not None else str(ckpt.with_name(f"{ckpt.stem}_lora") if lora else
                                                      ckpt.with_name(f"{ckpt.stem}_diffusers") if fmt ==
                                                      "diffusers" else ckpt.with_suffix(".safetensors"))
        from ringdit.checkpoints.layout import checked_output
        from ringdit.checkpoints.safetensors_export import export_safetensors
        from ringdit.lora import lora_enabled
        from ringdit.spec.checkpoint import recorded_hparams

        if not lora and lora_enabled(recorded_hparams(str(ckpt)).get("lora")):
            raise ConfigError(f"ckpt_path={ckpt} is a LoRA run's checkpoint: it holds only the adapters, not a model; "
                              f"export them with lora=true (diffusers' LoRA format) or format=comfyui, or sample it "
                              f"with infer.py ckpt_path={ckpt}")
        what = ("format=comfyui" if fmt == "comfyui" else "lora=true" if cfg.format is None else
                f"lora=true format={fmt}") if lora else f"format={fmt}"
        # before reading any weights: the one guard for every destination (file or folder, existing, the checkpoint)
        folder = lora or fmt == "diffusers"
        if folder and Path(str(out)).suffix == ".safetensors":  # a file name where a folder is written
            raise ConfigError(f"out={out}: {what} writes a folder (the adapter file inside, one per expert of a "
                              f"two-expert model); give a folder, e.g. out={Path(str(out)).with_suffix('')}")
        checked_output(out, folder=folder, what=what, overwrite=cfg.overwrite, source=ckpt)
        note = None
        if lora:
            written = export_adapter(str(ckpt), Path(out).expanduser(), fmt, cfg.weights)
        elif fmt == "diffusers":
            from ringdit.checkpoints.diffusers_export import export_diffusers

            written, note = export_diffusers(str(ckpt), str(out), prefer=cfg.weights, base=cfg.base,
                                             max_shard_size=cfg.max_shard_size)
        else:
            written = export_safetensors(str(ckpt), str(out), prefer=cfg.weights)
    print(f"wrote the {cfg.weights} weights' {'LoRA adapter' if lora else 'model and configs'} to {written}")
    if note:
        print(f"note: {note}")


def export_adapter(ckpt: str, out: Path, fmt: str, prefer: str) -> Path:
    """A LoRA run's adapter in ``fmt`` (diffusers or comfyui), written into a new folder that then replaces ``out``
    whole: an overwrite leaves no file of the previous export behind, and a kill leaves the previous one."""
    import shutil

    from ringdit.checkpoints.layout import replace_folder, temporary_folder
    from ringdit.checkpoints.weights import read_weights

    state, info = read_weights(ckpt, prefer=prefer)
    tmp = Path(temporary_folder(out))
    try:
        if fmt == "comfyui":
            from ringdit.checkpoints.lora_formats import export_comfyui

            written = export_comfyui(state, info, tmp, name=out.name)
        else:
            from ringdit.lora import export_lora

            written = export_lora(state, info.get("lora") or {}, tmp)
        replace_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out / written.relative_to(tmp)


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (default ``sys.argv[1:]``); its exit code: 0, or 2 for a settings mistake."""
    try:
        export(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
