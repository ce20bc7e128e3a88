"""Export a training checkpoint's weights to safetensors, for sampling and fine-tuning without Lightning.

    python -m ringdit.export ckpt_path=outputs/train/runs/<run>/checkpoints/last.ckpt out=weights.safetensors
    python -m ringdit.export ckpt_path=... weights=model      # the raw trained weights instead of the EMA

The file holds the EMA weights (or ``weights=model``) and, as metadata, the model, data, objective and sampling
configs: ``python infer.py ckpt_path=weights.safetensors`` and ``python train.py init_from=weights.safetensors``
use it directly. ``ckpt_path`` may be a sharded (FSDP) checkpoint folder: it is consolidated on this process.

    python -m ringdit.export ckpt_path=.../last.ckpt out=adapter/ lora=true   # a LoRA run's adapter, diffusers format

writes ``adapter/pytorch_lora_weights.safetensors``, which diffusers' ``load_lora_adapter`` /
``pipeline.load_lora_weights("adapter/")`` read.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ringdit.weights import export_safetensors, read_weights

USAGE = "usage: python -m ringdit.export ckpt_path=PATH [out=weights.safetensors] [weights=ema|model] [lora=true]"


def parse_args(argv: list[str]) -> dict[str, str]:
    args = {}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in ("ckpt_path", "out", "weights", "lora"):
            raise ValueError(f"unexpected argument {item!r}; {USAGE}")
        args[key] = value
    if "ckpt_path" not in args:
        raise ValueError(f"ckpt_path is required; {USAGE}")
    if args.setdefault("weights", "ema") not in ("ema", "model"):
        raise ValueError(f"weights must be ema or model, got {args['weights']!r}")
    if args.setdefault("lora", "false") not in ("true", "false"):
        raise ValueError(f"lora must be true or false, got {args['lora']!r}")
    if "out" not in args:
        ckpt = Path(args["ckpt_path"])
        args["out"] = str(ckpt.with_name(f"{ckpt.stem}_lora") if args["lora"] == "true" else ckpt.with_suffix(".safetensors"))
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args["lora"] == "true":
            from ringdit.lora import export_lora

            state, info = read_weights(args["ckpt_path"], prefer=args["weights"])
            out = export_lora(state, info.get("lora") or {}, args["out"])
        else:
            out = export_safetensors(args["ckpt_path"], args["out"], prefer=args["weights"])
    except ValueError as error:  # CheckpointError is one
        print(f"Error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args['weights']} weights and configs to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
