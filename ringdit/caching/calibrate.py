"""TeaCache calibration: fit the rescaling polynomial of a checkpoint's model and store it beside the checkpoint.

    python -m ringdit.caching calibrate CKPT [--num-samples 32] [--steps N] [--cfg-scale S] [--out FILE]
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ringdit.caching.cache import StepCache
from ringdit.caching.settings import COEFFICIENTS_FILE, CacheSettings, model_fingerprint
from ringdit.errors import ConfigError


def fit_coefficients(records: list[tuple[float, float]], degree: int = 4) -> tuple[float, ...]:
    """TeaCache's rescaling: a polyfit of the residual's relative change against the modulated input's."""
    import numpy as np

    points = np.array([r for r in records if all(map(math.isfinite, r))], dtype=np.float64)
    if len(points) <= degree:
        raise ConfigError(f"calibration recorded {len(points)} usable evaluations, fewer than degree + 1 = "
                          f"{degree + 1}; sample more steps or samples")
    return tuple(float(c) for c in np.polyfit(points[:, 0], points[:, 1], degree))


def calibrate(module, condition, seeds: list[int], degree: int = 4, **overrides) -> tuple[float, ...]:
    """Sample ``condition`` with every block running, record (modulated input change, residual change) per sample and
    evaluation, and fit TeaCache's polynomial to them. ``module``: a ``DiffusionModule`` with its model built."""
    recorder = StepCache(CacheSettings("teacache", 0.0), calibrate=True)
    previous, module.step_cache = module.step_cache, recorder
    try:
        module.generate(condition, seeds, **overrides)
    finally:
        module.step_cache = previous
    return fit_coefficients(recorder.records, degree)


def load_for_sampling(ckpt_path: str, weights: str = "ema"):
    """A ``DiffusionModule`` with the checkpoint's model and weights, on one process, in eval mode."""
    from ringdit.checkpoints.loading import safe_torch_load
    from ringdit.training import DiffusionModule

    hparams = safe_torch_load(ckpt_path, mmap=True)["hyper_parameters"]
    module = DiffusionModule(model=hparams["model"], objective=hparams["objective"], data=hparams["data"],
                             sampling=hparams.get("sampling"), init_from=ckpt_path, init_weights=weights)
    module.configure_model()
    return module.eval()


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ringdit.caching", description="Fit TeaCache's rescaling "
                                     "polynomial for a checkpoint and write it beside it (teacache.json).")
    parser.add_argument("command", choices=["calibrate"])
    parser.add_argument("ckpt_path")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--steps", type=int, default=None, help="default: the checkpoint's sampling steps")
    parser.add_argument("--cfg-scale", type=float, default=None)
    parser.add_argument("--out", default=None, help=f"default: {COEFFICIENTS_FILE} beside the checkpoint")
    args = parser.parse_args(argv)
    module = load_for_sampling(args.ckpt_path)
    seeds = list(range(args.num_samples))
    if module.text_conditioned:  # no prompts at hand: the empty prompt's trajectories (a fit of the dynamics)
        condition = module.model.null_condition(args.num_samples)
    else:
        condition = torch.arange(args.num_samples) % module.hparams.data["num_classes"]
    coefficients = calibrate(module, condition, seeds, steps=args.steps, cfg_scale=args.cfg_scale)
    out = Path(args.out) if args.out else Path(args.ckpt_path).expanduser().parent / COEFFICIENTS_FILE
    out.write_text(json.dumps({"coefficients": coefficients, "model": list(model_fingerprint(module.model)),
                               "ckpt_path": str(args.ckpt_path), "num_samples": args.num_samples}, indent=1))
    print(f"wrote {out}: coefficients {list(coefficients)}")
