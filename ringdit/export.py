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

    python -m ringdit.export ckpt_path=.../last.ckpt out=finetuned/ format=diffusers

writes a diffusers model's transformer as diffusers folders: ``finetuned/transformer/`` (and ``transformer_2/``, a
two-expert model's low-noise expert), each ``config.json`` + ``diffusion_pytorch_model.safetensors``.

A LoRA run's checkpoint holds only the adapters, so its plain export
(``lora=false``) is refused: it would be a model file without its model; ``infer.py ckpt_path=<the .ckpt>`` samples
it on its base.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from ringdit.cli import hydra_main, user_errors
from ringdit.errors import ConfigError

FORMATS = ("ringdit", "diffusers")  # format=: a .safetensors file with the configs, or diffusers transformer folders


@hydra_main("export")  # conf/export.yaml
def export(cfg: DictConfig) -> None:
    with user_errors():  # a wrong setting or checkpoint (CheckpointError): one line, exit code 2
        if cfg.weights not in ("ema", "model"):
            raise ConfigError(f"weights must be ema or model, got {cfg.weights!r}")
        if not isinstance(cfg.lora, bool):
            raise ConfigError(f"lora must be true or false, got {cfg.lora!r}")
        if cfg.format not in FORMATS:
            raise ConfigError(f"format={cfg.format!r} is not one of {', '.join(FORMATS)}: ringdit writes one "
                              f".safetensors file with the run's configs, diffusers a folder per transformer")
        ckpt = Path(str(cfg.ckpt_path))
        out = cfg.out if cfg.out is not None else str(ckpt.with_name(f"{ckpt.stem}_lora") if cfg.lora else
                                                      ckpt.with_name(f"{ckpt.stem}_diffusers") if cfg.format ==
                                                      "diffusers" else ckpt.with_suffix(".safetensors"))
        from ringdit.checkpoints.layout import checked_output
        from ringdit.checkpoints.safetensors_export import export_safetensors
        from ringdit.checkpoints.weights import read_weights
        from ringdit.lora import lora_enabled
        from ringdit.spec.checkpoint import recorded_hparams

        if not cfg.lora and lora_enabled(recorded_hparams(str(ckpt)).get("lora")):
            raise ConfigError(f"ckpt_path={ckpt} is a LoRA run's checkpoint: it holds only the adapters, not a model; "
                              f"export them with lora=true (diffusers' LoRA format), or sample it with infer.py "
                              f"ckpt_path={ckpt}")
        what = "lora=true" if cfg.lora else f"format={cfg.format}"
        checked_output(out, folder=cfg.lora or cfg.format == "diffusers", what=what)  # before reading any weights
        if cfg.lora:
            from ringdit.lora import export_lora

            state, info = read_weights(str(ckpt), prefer=cfg.weights)
            written = export_lora(state, info.get("lora") or {}, str(out))
        elif cfg.format == "diffusers":
            from ringdit.checkpoints.diffusers_export import export_diffusers

            written = export_diffusers(str(ckpt), str(out), prefer=cfg.weights)
        else:
            written = export_safetensors(str(ckpt), str(out), prefer=cfg.weights)
    print(f"wrote {cfg.weights} weights and configs to {written}")


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (default ``sys.argv[1:]``); its exit code: 0, or 2 for a settings mistake."""
    try:
        export(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
