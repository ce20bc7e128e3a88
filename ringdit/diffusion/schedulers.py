"""Samplers from diffusers' flow schedulers, through their own classes: ``sampler=flow_euler``
(``FlowMatchEulerDiscreteScheduler``: Flux's, LTX-Video's, HunyuanVideo 1.5's), ``unipc`` (``UniPCMultistepScheduler``
with flow sigmas: Wan's and SkyReels-V2's), ``dpmpp`` (``DPMSolverMultistepScheduler`` with flow sigmas,
DPM-Solver++), and a family's own where its pipeline steps another (``Family.scheduler``, registered under the
family's name by the families' registry: ``sampler=minimax_h3`` is ``MiniMaxH3Scheduler``, in its own conventions,
``CLEAN_TIME``). They step a flow-matching model (velocity, ``noise - x0``) exactly as the model family's diffusers
pipeline steps it, so that a sample equals the pipeline's for the same initial latents, prompt and scheduler.

Their configuration (``scheduler_config``) is the pipeline folder's ``scheduler/scheduler_config.json`` when the model
comes from one (read and checked before any rank starts: ``ringdit.spec.diffusion``), else built from the run's
sampling settings (``shift``, ``shift_terminal``, the objective's resolution constants): the schedule ringdit's own
``euler`` steps through, in the scheduler's own arithmetic.

A scheduler is stateful (its step index, a multistep solver's history of predictions): ``sample_with_scheduler``
builds a fresh one per call (one batch). Every rank of a sequence-parallel group builds the same one and steps it on
the same gathered prediction, so every rank holds the same samples; the model call itself is sequence-parallel, and
guidance, CFG parallel, step caching and a two-expert model's choice of expert all live in the denoiser it is given.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ringdit.common.dtypes import default_dtype
from ringdit.common.errors import ConfigError
from ringdit.diffusion.objectives import resolution_mu

Tensor = torch.Tensor

# sampler= name -> the diffusers scheduler class that samples with it: the flow schedulers any family steps, and each
# family's own (register_scheduler, from its record's ``scheduler``)
SCHEDULERS = {
    "flow_euler": "FlowMatchEulerDiscreteScheduler",
    "unipc": "UniPCMultistepScheduler",
    "dpmpp": "DPMSolverMultistepScheduler",
}
# schedulers in MiniMax-H3's conventions: timesteps 1 - sigma (1 = clean), a data-ward velocity (x0 - noise) stepped,
# and set_timesteps(n) counting the terminal sigma 0 among its n grid points (n - 1 model calls); ringdit's model time
# is sigma x 1000 and its velocity noise - x0, converted both ways where such a scheduler is stepped
CLEAN_TIME = {"MiniMaxH3Scheduler"}
# what makes UniPC / DPM-Solver++ step a flow-matching model: sigmas 1 -> 0 and a velocity prediction
FLOW_SIGMAS = {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}
# the keys of the flow shift: FlowMatchEuler calls it shift, the multistep solvers flow_shift
SHIFT_KEY = {"FlowMatchEulerDiscreteScheduler": "shift", "MiniMaxH3Scheduler": "shift"}


@dataclass(frozen=True)
class PipelineTimesteps:
    """How a model family's diffusers pipeline sets its scheduler's timesteps and steps it (``Family``'s
    ``pipeline_timesteps``; the default is WanPipeline's and SkyReels-V2's: ``set_timesteps(steps)``).

    ``sigmas``: the sigmas it hands ``set_timesteps``: None (the scheduler's own), ``"to_last"``
    (``linspace(1, 1 / steps, steps)``: FluxPipeline, LTXPipeline, QwenImagePipeline, Flux2Pipeline) or ``"to_zero"``
    (``linspace(1, 0, steps + 1)[:-1]``: HunyuanVideo15Pipeline). A scheduler whose ``set_timesteps`` takes no sigmas
    (DPM-Solver++) makes its own, as would ``drops_for_flow_sigmas`` pipelines (Flux's) for any flow-sigmas scheduler.
    ``float32_prediction``: the pipeline rounds the model's prediction to float32 (LTXPipeline's
    ``noise_pred.float()``, before its guidance combines the halves: ``samplers.sample`` casts each half, so the
    denoiser this module steps gives float32) and steps the scheduler on it; the same numbers as an upcast bf16
    prediction, a rounding of an fp64 one.
    """

    sigmas: str | None = None
    drops_for_flow_sigmas: bool = False
    float32_prediction: bool = False


def register_scheduler(sampler: str, class_name: str) -> None:
    """``sampler=<sampler>`` steps diffusers' ``class_name``: a model family's own scheduler, registered by the
    families' registry from its record (this module sits below the kinds and cannot read them)."""
    if SCHEDULERS.get(sampler, class_name) != class_name:
        raise ValueError(f"sampler={sampler} is already {SCHEDULERS[sampler]}, not {class_name}")
    SCHEDULERS[sampler] = class_name


def is_scheduler_sampler(sampler) -> bool:
    return isinstance(sampler, str) and sampler in SCHEDULERS


def scheduler_class(sampler: str):
    import diffusers

    return getattr(diffusers, SCHEDULERS[sampler])


def scheduler_config(sampler: str, folder_config: dict | None = None, *, shift: float | str | None = None,
                     shift_terminal: float | bool | None = None, resolution: dict | None = None) -> dict:
    """The configuration ``sampler``'s scheduler class is built from.

    ``folder_config``: a pipeline folder's ``scheduler_config.json``. Of the same class it is the base as it is (the
    pipeline's scheduler); of another flow scheduler (Wan's UniPC config for ``sampler=flow_euler``), its settings
    are carried over -- the flow shift under the other class's name, flow sigmas for the multistep solvers.
    None: flow sigmas and a shift of 1.

    The run's schedule is laid over it, so that ``diffusion.sampling.shift`` / ``shift_terminal`` always reach the
    scheduler: ``shift`` a number (dynamic shifting off), or ``"resolution"`` (dynamic shifting: the folder's own
    constants where it shifts dynamically, else ``resolution``'s, Flux's by default), None: the folder's (else 1);
    ``shift_terminal`` a time in (0, 1), False: no stretch, None: the folder's (else none).
    """
    cls = scheduler_class(sampler)
    name, shift_key = cls.__name__, SHIFT_KEY.get(cls.__name__, "flow_shift")
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    config = {} if shift_key == "shift" else dict(FLOW_SIGMAS)
    if folder_config is not None:
        config = {k: v for k, v in folder_config.items() if not k.startswith("_")}
        if folder_config.get("_class_name") != name:
            given_shift = config.pop("shift", config.pop("flow_shift", None))
            if given_shift is not None:
                config[shift_key] = given_shift
            if shift_key == "flow_shift":
                config.update(FLOW_SIGMAS)
    elif shift is None:
        shift = 1.0
    if shift == "resolution":
        if not config.get("use_dynamic_shifting"):  # the folder's constants where it has them: its pipeline's
            constants = resolution or {}
            config.update(use_dynamic_shifting=True,
                          time_shift_type=constants.get("time_shift_type", "exponential"))
            for key in ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift"):  # the linear rule's
                source = {"base_image_seq_len": "base_tokens", "max_image_seq_len": "max_tokens"}.get(key, key)
                if source in constants:
                    config[key] = constants[source]
    elif shift is not None:
        config.update({shift_key: float(shift), "use_dynamic_shifting": False})
    if shift_terminal is False:
        config.pop("shift_terminal", None)
    elif shift_terminal:
        config["shift_terminal"] = float(shift_terminal)
    return {k: v for k, v in config.items() if k in accepted}


# settings whose values diffusers takes without complaint but which cannot work: (lowest, highest, open below)
SCHEDULER_BOUNDS = {"num_train_timesteps": (1, 100_000, False), "flow_shift": (0, None, True), "shift": (0, None, True),
                    "solver_order": (1, 3, False)}


def check_scheduler_file(config: dict, file, class_name: str | None = None) -> None:
    """Each setting of a pipeline folder's ``scheduler_config.json`` (``config``, read from ``file``) of the type
    ``class_name``'s (the folder's ``_class_name`` when ringdit knows it) own default has -- a number where it takes a
    number, true / false where a switch -- and in range where a value would fail late or silently (a shift <= 0, a
    table of 10**12 timesteps); else a ``ConfigError`` naming the file, the key, the value and the fix."""
    import math

    import diffusers

    class_name = class_name or config.get("_class_name")
    defaults = {}
    if class_name in SCHEDULERS.values():
        defaults = {name: param.default for name, param in
                    inspect.signature(getattr(diffusers, class_name).__init__).parameters.items()
                    if param.default is not inspect.Parameter.empty}
    fix = "fix the value (save_pretrained writes it), or remove the key for the scheduler's default"
    for key, value in config.items():
        if key.startswith("_"):
            continue
        default = defaults.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if isinstance(default, bool) and not isinstance(value, bool):
            what = "true or false"
        elif isinstance(default, int) and not isinstance(default, bool) and not (number and float(value).is_integer()):
            what = "an integer"
        elif isinstance(default, float) and not (number and math.isfinite(value)):
            what = "a finite number"
        elif isinstance(default, str) and not isinstance(value, str):
            what = "a string"
        elif key in SCHEDULER_BOUNDS and not (number and math.isfinite(value)):
            what = "a finite number"
        else:
            low, high, open_below = SCHEDULER_BOUNDS.get(key, (None, None, False))
            if low is None or (value > low if open_below else value >= low) and (high is None or value <= high):
                continue
            what = f"{'above' if open_below else 'at least'} {low}" + (f" and at most {high}" if high else "")
        shown = f" ({class_name}'s default: {json_value(default)})" if key in defaults else ""
        raise ConfigError(f"{file}: {key}={json_value(value)} must be {what}{shown}; {fix}")


def json_value(value) -> str:
    """``value`` as the JSON file writes it ("abc" quoted, true, null)."""
    import json

    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def build_scheduler(sampler: str, config: dict):
    """A fresh scheduler of ``sampler``'s class from ``config`` (``scheduler_config``'s)."""
    return scheduler_class(sampler).from_config(config)


def check_flow_scheduler(scheduler, where: str) -> None:
    """A multistep solver that steps epsilon or v predictions over a DDPM schedule would sample a flow model wrongly
    without failing: refuse it (``ValueError`` starting with ``where``)."""
    config = scheduler.config
    if "use_flow_sigmas" in config and not (config.use_flow_sigmas and config.prediction_type == "flow_prediction"):
        raise ValueError(f"{where}: {type(scheduler).__name__} with use_flow_sigmas={config.use_flow_sigmas}, "
                         f"prediction_type={config.prediction_type!r} steps a DDPM schedule, not a flow-matching "
                         f"model's velocity; a flow model needs use_flow_sigmas=true and "
                         f"prediction_type=flow_prediction")


def dynamic_mu(config, tokens: int, steps: int, resolution: dict | None) -> float:
    """The exponent of dynamic shifting for a sample of ``tokens`` model tokens, as the pipelines compute it:
    Flux.2's empirical rule when ``resolution`` holds ``empirical_mu_steps``, else ``calculate_shift`` with the
    scheduler config's constants (FluxPipeline's, LTXPipeline's, QwenImagePipeline's)."""
    if resolution and "empirical_mu_steps" in resolution:
        return resolution_mu(tokens, empirical_mu_steps=resolution["empirical_mu_steps"], steps=steps)
    return resolution_mu(tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                         config.get("base_shift", 0.5), config.get("max_shift", 1.15))


def set_timesteps(scheduler, steps: int, pipeline: PipelineTimesteps, tokens: int | None,
                  resolution: dict | None, device=None) -> None:
    """``scheduler.set_timesteps`` called as the family's pipeline calls it (``pipeline``), with the dynamic shift's
    mu for ``tokens`` model tokens where the config shifts dynamically."""
    arguments = {"device": device}
    accepted = inspect.signature(scheduler.set_timesteps).parameters
    sigmas = None
    if pipeline.sigmas is not None and "sigmas" in accepted:
        flow_sigmas = getattr(scheduler.config, "use_flow_sigmas", False)
        if not (flow_sigmas and pipeline.drops_for_flow_sigmas):
            sigmas = (np.linspace(1.0, 1 / steps, steps) if pipeline.sigmas == "to_last" else
                      np.linspace(1.0, 0.0, steps + 1)[:-1])
    if getattr(scheduler.config, "use_dynamic_shifting", False):
        if tokens is None:
            raise ValueError("a scheduler with use_dynamic_shifting needs the sample's token count")
        arguments["mu"] = dynamic_mu(scheduler.config, tokens, steps, resolution)
    if sigmas is not None:
        scheduler.set_timesteps(sigmas=sigmas, **arguments)
    else:  # MiniMaxH3Scheduler's count includes the terminal 0: steps + 1 grid points for steps model calls
        scheduler.set_timesteps(steps + (type(scheduler).__name__ in CLEAN_TIME), **arguments)


@torch.no_grad()
def sample_with_scheduler(denoiser, noise: Tensor, steps: int, sampler: str, config: dict, *,
                          pipeline: PipelineTimesteps = PipelineTimesteps(), tokens: int | None = None,
                          resolution: dict | None = None, model_dtype: torch.dtype | None = None,
                          streams: Sequence[tuple[int, dict]] = ()) -> Tensor:
    """Step a fresh ``sampler`` scheduler of ``config`` from ``noise`` through ``steps`` steps, as the pipeline does:
    the model sees the latents in ``model_dtype`` (the pipelines' ``latents.to(transformer_dtype)``; None: as they
    are) and the scheduler's timestep as model time (sigma x 1000), and ``scheduler.step`` keeps the latents in the
    dtype it returns (float32 noise stays float32 under UniPC, as in WanPipeline). ``denoiser(x, model_time) ->
    velocity``.

    ``streams``: (size, config) of each stream packed after the video's along dim 1 of ``noise`` (``JointLatents``'
    order: MiniMax-H3's audio), each stepped by a scheduler of its own config, as MiniMax-H3's pipeline steps its audio
    at shift 3 beside its video at 12; the denoiser then takes every stream's model time, ``(B, 1 + len(streams))``,
    the video's first."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    with float32_default():
        schedulers = [build_scheduler(sampler, stream_config) for stream_config in (config, *(c for _, c in streams))]
        for scheduler in schedulers:
            check_flow_scheduler(scheduler, f"sampler={sampler}")
            set_timesteps(scheduler, steps, pipeline, tokens, resolution, device=noise.device)
    lengths = {len(scheduler.timesteps) for scheduler in schedulers}
    if len(lengths) > 1:  # a shift that rounds two grid points to one sigma (MiniMaxH3Scheduler drops the duplicate)
        raise ValueError(f"sampler={sampler} with {steps} steps: the streams' schedules have {sorted(lengths)} steps; "
                         f"use another number of steps or shift")
    sizes = [noise.shape[1] - sum(size for size, _ in streams), *(size for size, _ in streams)]
    clean_time = type(schedulers[0]).__name__ in CLEAN_TIME
    x = noise
    for step in range(lengths.pop()):
        model_input = x if model_dtype is None else x.to(model_dtype)
        # model time as a float: float64 for an fp64 model (Flux divides it by 1000 as the pipeline does), else
        # float32 (a bf16 timestep would round it)
        time_dtype = torch.float64 if model_input.dtype == torch.float64 else torch.float32
        timesteps = [scheduler.timesteps[step] for scheduler in schedulers]
        times = torch.stack([(1 - t.to(time_dtype)) * 1000 if clean_time else t.to(time_dtype) for t in timesteps])
        times = times[None].expand(x.shape[0], -1) if streams else times[0].expand(x.shape[0])  # (B, streams) / (B,)
        prediction = denoiser(model_input, times)  # float32 where the pipeline casts
        prediction = -prediction if clean_time else prediction  # MiniMax-H3's scheduler steps x0 - noise
        with float32_default():
            x = torch.cat([scheduler.step(velocity, t, part, return_dict=False)[0] for scheduler, t, velocity, part
                           in zip(schedulers, timesteps, prediction.split(sizes, 1), x.split(sizes, 1))], dim=1)
    return x


def float32_default():
    """The scheduler's arithmetic under float32 as the default dtype, as the pipelines run it: diffusers' schedulers
    make their tables (sigmas, UniPC's ``rks``) in the default dtype, which Lightning's ``trainer.precision=64-true``
    turns to float64 while sampling -- UniPC's solve then mixes float64 with the float32 latents and fails."""
    return default_dtype(torch.float32)


__all__ = ["CLEAN_TIME", "SCHEDULERS", "PipelineTimesteps", "build_scheduler", "check_flow_scheduler", "dynamic_mu",
           "is_scheduler_sampler", "register_scheduler", "sample_with_scheduler", "scheduler_class", "scheduler_config", "set_timesteps"]
