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

from ringdit.commands.task import Task, command
from ringdit.common.errors import ConfigError, require_number

FORMATS = ("ringdit", "diffusers", "comfyui")
LORA_FORMATS = ("diffusers", "comfyui")  # a LoRA adapter's: diffusers' pytorch_lora_weights, or ComfyUI's


# SIGTERM: the export stops where it is; out= is replaced only by a whole export (written aside, then renamed)
@command("export", doing="the export", kept="out= is as it was (it is replaced only once the export is whole); run "
                                              "the same command again")  # conf/export.yaml
def export(cfg: DictConfig, task: Task) -> None:
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
    # start-up time: the checkpoint side loads torch, the models and peft; --help and the settings' checks above
    # answer without them
    from ringdit.checkpoints.exporting import write_export

    written, note = write_export(cfg, ckpt, out, fmt=fmt, lora=lora, merge=merge)  # a wrong checkpoint: one line
    task.start()
    what = f"model with its LoRA adapter fused at strength {cfg.merge_strength:g}" if merge else \
        "LoRA adapter" if lora else "model and configs"
    print(f"wrote the {cfg.weights} weights' {what} to {written}")
    if note:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (default ``sys.argv[1:]``); its exit code: 0, or 2 for a settings mistake."""
    try:
        export(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
