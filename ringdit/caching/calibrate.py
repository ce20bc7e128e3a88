"""TeaCache calibration: fit the rescaling polynomial of a checkpoint's model and store it beside the checkpoint.

    python -m ringdit.caching calibrate ckpt_path=CKPT [num_samples=32] [diffusion.sampling.steps=N]
        [diffusion.sampling.cfg_scale=S] [out=FILE]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from ringdit.common.atomic import atomic_write
from ringdit.models.build import build_model
from ringdit.caching.cache import StepCache
from ringdit.caching.cache_settings import COEFFICIENTS_FILE, CacheSettings, model_fingerprint
from ringdit.checkpoints.location import checked_output
from ringdit.checkpoints.loading import safe_torch_load
from ringdit.commands.task import Task, command
from ringdit.diffusion.pipeline import SamplingPipeline
from ringdit.common.errors import ConfigError, require_choice, require_count, require_number
from ringdit.models.conditioning import text_conditioned
from ringdit.parallel import ParallelDims
from ringdit.sampling.sampler import Sampler
from ringdit.spec.control import control_family


def fit_coefficients(records: list[tuple[float, float]], degree: int = 4) -> tuple[float, ...]:
    """TeaCache's rescaling: a polyfit of the residual's relative change against the modulated input's."""
    import numpy as np

    points = np.array([r for r in records if all(map(math.isfinite, r))], dtype=np.float64)
    if len(points) <= degree:
        raise ConfigError(f"calibration recorded {len(points)} usable evaluations, fewer than degree + 1 = "
                          f"{degree + 1}; sample more steps or samples")
    return tuple(float(c) for c in np.polyfit(points[:, 0], points[:, 1], degree))


def calibrate(sampler: Sampler, condition, seeds: list[int], degree: int = 4, **overrides) -> tuple[float, ...]:
    """Sample ``condition`` with every block running, record (modulated input change, residual change) per sample and
    evaluation, and fit TeaCache's polynomial to them. ``sampler``: a ``ringdit.sampling.Sampler``."""
    recorder = StepCache(CacheSettings("teacache", 0.0), calibrate=True)
    with sampler.using(step_cache=recorder) as recording:
        recording.generate(condition, seeds, **overrides)
    return fit_coefficients(recorder.records, degree)


def load_for_sampling(ckpt_path: str, weights: str = "ema", hparams: dict | None = None) -> Sampler:
    """A ``Sampler`` of the checkpoint's model with its ``weights`` (``ema`` or ``model``), on one process, in eval
    mode, on the CPU. ``hparams``: the checkpoint's, where they were read already."""
    hparams = safe_torch_load(ckpt_path, mmap=True)["hyper_parameters"] if hparams is None else hparams
    model, _ = build_model(hparams["model"], dims=ParallelDims(), init_from=ckpt_path, init_weights=weights)
    pipeline = SamplingPipeline.for_run(hydra.utils.instantiate(hparams["objective"]), hparams.get("sampling"),
                                        hparams["data"])
    return Sampler(model.eval(), ParallelDims(), pipeline, torch.device("cpu"))


@command("calibrate", doing="calibrating")  # conf/calibrate.yaml; SIGTERM: stops, nothing written (written last)
def calibrate_command(cfg: DictConfig, task: Task) -> None:
    """Fit TeaCache's rescaling polynomial for a checkpoint and write it beside it (teacache.json)."""
    require_count("num_samples", cfg.num_samples, hint="each sample adds one point per step to the fit")
    sampling = cfg.diffusion.sampling
    require_count("diffusion.sampling.steps", sampling.steps, optional=True)
    require_number("diffusion.sampling.cfg_scale", sampling.cfg_scale, low=0, optional=True)
    require_choice("weights", cfg.weights, ("ema", "model"))
    ckpt = Path(str(cfg.ckpt_path)).expanduser()
    if not ckpt.is_file():
        raise ConfigError(f"ckpt_path={cfg.ckpt_path} is not a file; give a training run's .ckpt (e.g. "
                          f"outputs/train/runs/<run>/checkpoints/last.ckpt)")
    out = Path(str(cfg.out)).expanduser() if cfg.out is not None else ckpt.parent / COEFFICIENTS_FILE
    if out.is_dir():
        raise ConfigError(f"out={cfg.out} is a folder; give the file to write (e.g. out={out / COEFFICIENTS_FILE})")
    if not isinstance(cfg.overwrite, bool):
        raise ConfigError(f"overwrite must be true or false, got {cfg.overwrite!r}")
    checked_output(out, folder=False, what="calibrate", overwrite=cfg.overwrite, source=ckpt)
    hparams = safe_torch_load(str(ckpt), mmap=True)["hyper_parameters"]
    family = control_family(hparams["model"])
    if family is not None:  # its samples need a control video, and calibration samples the empty prompt alone
        raise ConfigError(f"ckpt_path={cfg.ckpt_path} is a control-video model (model.family={family.name}): "
                          f"calibration samples the empty prompt without a control video, which it needs; "
                          f"calibrating control-video models is not supported yet")
    sampler = load_for_sampling(str(ckpt), weights=cfg.weights, hparams=hparams)
    seeds = list(range(cfg.num_samples))
    if text_conditioned(hparams["data"]):  # no prompts at hand: the empty prompt's trajectories (a fit of the
        condition = sampler.model.null_condition(cfg.num_samples)  # dynamics)
    else:
        condition = torch.arange(cfg.num_samples) % hparams["data"]["num_classes"]
    coefficients = calibrate(sampler, condition, seeds, steps=sampling.steps, cfg_scale=sampling.cfg_scale)
    task.start()
    record = {"coefficients": coefficients, "model": list(model_fingerprint(sampler.model)), "ckpt_path": str(ckpt),
              "num_samples": cfg.num_samples}
    with atomic_write(out) as tmp:
        tmp.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}: coefficients {list(coefficients)}")


def main(argv: list[str] | None = None) -> int:
    """``python -m ringdit.caching calibrate key=value ...``; the exit code: 0, or 2 for a settings mistake."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "calibrate":
        print("Error: python -m ringdit.caching has one command: calibrate (python -m ringdit.caching calibrate "
              "ckpt_path=CKPT; --help lists its settings)", file=sys.stderr)
        return 2
    try:
        calibrate_command(argv[1:])
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0
