"""Export a training checkpoint's weights to safetensors, for sampling and fine-tuning without Lightning.

    python -m ringdit.export ckpt_path=outputs/train/runs/<run>/checkpoints/last.ckpt out=weights.safetensors
    python -m ringdit.export ckpt_path=... weights=model      # the raw trained weights instead of the EMA

The file holds the EMA weights (or ``weights=model``) and, as metadata, the model, data, objective and sampling
configs: ``python infer.py ckpt_path=weights.safetensors`` and ``python train.py init_from=weights.safetensors``
use it directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ringdit.weights import export_safetensors

USAGE = "usage: python -m ringdit.export ckpt_path=PATH [out=weights.safetensors] [weights=ema|model]"


def parse_args(argv: list[str]) -> dict[str, str]:
    args = {}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in ("ckpt_path", "out", "weights"):
            raise ValueError(f"unexpected argument {item!r}; {USAGE}")
        args[key] = value
    if "ckpt_path" not in args:
        raise ValueError(f"ckpt_path is required; {USAGE}")
    if args.setdefault("weights", "ema") not in ("ema", "model"):
        raise ValueError(f"weights must be ema or model, got {args['weights']!r}")
    args.setdefault("out", str(Path(args["ckpt_path"]).with_suffix(".safetensors")))
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        out = export_safetensors(args["ckpt_path"], args["out"], prefer=args["weights"])
    except ValueError as error:  # CheckpointError is one
        print(f"Error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args['weights']} weights and configs to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
