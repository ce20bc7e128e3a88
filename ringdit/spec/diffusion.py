"""The objective and the sampling settings of a run: Flux's resolution shift and the sampler's terminal stretch
resolved (a model family's own where it has them), and samplers, steps and guidance that fit the objective and the
model."""

from __future__ import annotations

import logging
import math

from omegaconf import DictConfig, OmegaConf

from ringdit.common.errors import ConfigError, require_count
from ringdit.common.safe_json import read_json
from ringdit.diffusion import objectives, resolution_shift
from ringdit.diffusion.experts import EXPERT_SETTINGS, time_range
from ringdit.diffusion.objectives import DDPM, RESOLUTION_SHIFT_KEYS, TIME_SHIFT_TYPES, check_ddpm, check_flow
from ringdit.diffusion.schedulers import (
    SCHEDULERS,
    PipelineTimesteps,
    build_scheduler,
    check_flow_scheduler,
    check_scheduler_file,
    is_scheduler_sampler,
    scheduler_config,
    set_timesteps,
)
from ringdit.spec.model import model_class

log = logging.getLogger(__name__)


def training_diffusion(cfg: DictConfig, model_config: dict, tokens: int) -> tuple[dict, dict]:
    """train.py's (objective, sampling): ``diffusion.objective`` with its shift resolved for ``tokens`` per sample,
    and ``diffusion.sampling`` checked against it and the model, with the preview grids' own cfg_scale too."""
    objective = OmegaConf.to_container(cfg.diffusion.objective, resolve=True)
    sampling = OmegaConf.to_container(cfg.diffusion.sampling, resolve=True)
    if str(objective.get("_target_")).endswith("FlowMatching"):
        check_flow(objective)  # its times and loss weighting, before any rank starts
    check_shift("diffusion.sampling.shift", sampling.get("shift"))
    resolve_shift(objective, sampling, tokens, model_config)
    check_sampling(model_config, objective, sampling, prefix="diffusion.sampling.")
    resolve_shift_terminal(sampling, model_config, objective)
    resolve_scheduler(sampling, model_config, prefix="diffusion.sampling.")
    grid_cfg_scale = OmegaConf.select(cfg, "callbacks.sample_grid.cfg_scale")
    if grid_cfg_scale is not None:  # the preview grids sample with their own scale
        check_sampling(model_config, objective, {**sampling, "cfg_scale": grid_cfg_scale},
                       prefix="callbacks.sample_grid.")
    return objective, sampling


def training_expert(cfg: DictConfig, model_config: dict) -> str | None:
    """``diffusion.expert``: which expert of a two-expert model (``model.boundary_ratio``) trains -- ``high``,
    ``low`` or ``both`` (the default) --; None for a model with one transformer, where setting it is a mistake."""
    setting = cfg.diffusion.get("expert")
    if setting is not None and setting not in EXPERT_SETTINGS:
        raise ConfigError(f"diffusion.expert={setting!r} is not one of {', '.join(EXPERT_SETTINGS)}: the high-noise "
                          f"expert, the low-noise one, or both in one run")
    if model_config.get("boundary_ratio") is None:
        if setting is not None:
            raise ConfigError(f"diffusion.expert={setting} picks an expert of a two-expert model (Wan 2.2 A14B: "
                              f"model=wan22_a14b*), but this model has one transformer (no model.boundary_ratio); "
                              f"leave diffusion.expert unset")
        return None
    if not str(OmegaConf.select(cfg, "diffusion.objective._target_")).endswith("FlowMatching"):
        raise ConfigError(f"model.boundary_ratio={model_config['boundary_ratio']}: a two-expert model splits the "
                          f"flow-matching times between its experts; train it with diffusion=flow")
    check_expert_times(setting or "both", model_config["boundary_ratio"], cfg.diffusion.objective)
    return setting or "both"


def check_expert_times(expert: str, boundary: float, objective) -> None:
    """The expert that trains has times in ``diffusion.objective.min_time`` .. ``max_time`` (``both``: one of them
    has; the other then never trains)."""
    low, high = objective.get("min_time", 0.0), objective.get("max_time", 1.0)
    for name in ("high", "low") if expert != "both" else ():
        start, end = time_range(name, boundary)
        if name == expert and max(low, start) >= min(high, end):
            other = "low" if name == "high" else "high"
            raise ConfigError(f"diffusion.expert={name} trains the times {start} .. {end} (model.boundary_ratio), "
                              f"but diffusion.objective.min_time={low} .. max_time={high} leaves it none; widen "
                              f"min_time / max_time into that range, or train diffusion.expert={other}")


def resolve_shift(objective: dict, sampling: dict, tokens: int, model_config: dict | None = None) -> None:
    """``diffusion.objective.shift=resolution``: Flux's shift, for each sample's own token count (every bucket its
    own), in training and sampling; logged for ``tokens`` (the data's most frequent bucket). A diffusers family whose
    pipeline has its own constants (LTX-Video's) or rule (Flux.2's, which depends on the sampling steps too) gets them
    in ``objective["resolution"]``, unless it gives some."""
    check_resolution(objective.get("resolution"))
    if objective.get("shift") != "resolution":
        if isinstance(objective.get("shift"), str):
            raise ConfigError(f"diffusion.objective.shift must be a number > 0 or 'resolution', got "
                              f"{objective['shift']!r}")
        return

    if objective.get("resolution") is None and model_config is not None:
        constants = model_class(model_config).sampling_defaults(model_config)["resolution"]
        folder = folder_resolution(model_config)
        if folder is not None and (constants is None or "empirical_mu_steps" not in constants):
            constants = folder  # the pipeline's own (Flux.2's pipeline ignores its folder's: its rule stays)
        if constants is not None:  # kept with the run's objective: infer.py samples with them too
            objective["resolution"] = dict(constants)
    constants, steps = objective.get("resolution") or {}, sampling.get("steps")
    sampled = f" (sampling at {steps} steps: {resolution_shift(tokens, steps=steps, **constants):.4f})" \
        if "empirical_mu_steps" in constants and steps else ""  # Flux.2's depends on the steps
    log.info("diffusion.objective.shift=resolution: per sample size, e.g. %.4f for %d image tokens%s",
             resolution_shift(tokens, **constants), tokens, sampled)
    if sampling.get("shift") in (None, "resolution"):
        sampling["shift"] = "resolution"


# a scheduler config's dynamic-shift keys -> resolution_mu's keywords
SCHEDULER_SHIFT_KEYS = {"base_image_seq_len": "base_tokens", "max_image_seq_len": "max_tokens",
                        "base_shift": "base_shift", "max_shift": "max_shift", "time_shift_type": "time_shift_type"}


def folder_resolution(model_config: dict) -> dict | None:
    """The dynamic shift's constants of ``model.pretrained``'s pipeline folder: its
    ``scheduler/scheduler_config.json``'s, where that scheduler shifts dynamically (``use_dynamic_shifting``: the
    constants its pipeline's ``calculate_shift`` takes, Qwen-Image's 256 / 8192 / 0.5 / 0.9 ...; those it leaves out
    are the scheduler class's defaults, Flux's, as ``resolution_mu``'s); None where the model comes from no such
    folder or its scheduler shifts by a fixed amount. The file is read and checked as ``resolve_scheduler`` reads
    it."""
    from pathlib import Path

    pretrained = model_config.get("pretrained")
    file = Path(str(pretrained)).expanduser() / "scheduler" / "scheduler_config.json" if pretrained else None
    if file is None or not file.is_file():
        return None
    config = read_json(file, f"model.pretrained's scheduler config {file}", kind=dict,
                       fix="give the pipeline's scheduler_config.json, or set diffusion.objective.resolution")
    check_scheduler_file(config, file)
    if not config.get("use_dynamic_shifting"):
        return None
    return {key: config[name] for name, key in SCHEDULER_SHIFT_KEYS.items() if name in config}


def check_resolution(resolution) -> None:
    """``diffusion.objective.resolution``: null, or some of ``resolution_shift``'s constants -- the linear rule's, or
    Flux.2's ``empirical_mu_steps`` alone."""
    if resolution is None:
        return
    setting = "diffusion.objective.resolution"
    unknown = sorted(set(resolution) - set(RESOLUTION_SHIFT_KEYS)) if isinstance(resolution, dict) else None
    if unknown is None or unknown:
        raise ConfigError(f"{setting}={resolution!r} is not a map of resolution_shift's constants "
                          f"({', '.join(RESOLUTION_SHIFT_KEYS)}); give some of them, or null for the model family's")

    kind = resolution.get("time_shift_type", "exponential")
    if kind not in TIME_SHIFT_TYPES:
        raise ConfigError(f"{setting}.time_shift_type={kind!r} is not one of {', '.join(TIME_SHIFT_TYPES)} (how the "
                          f"scheduler applies mu: exp(mu) or mu as the shift); give exponential, Flux's")
    for key in ("base_tokens", "max_tokens", "base_shift", "max_shift"):
        value = resolution.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{setting}.{key}={value!r} is not a finite number; give the scheduler config's (Flux's "
                              f"base_tokens 256, max_tokens 4096, base_shift 0.5, max_shift 1.15)")
    if resolution.get("base_tokens", 256) == resolution.get("max_tokens", 4096):
        raise ConfigError(f"{setting}: base_tokens and max_tokens are both {resolution.get('max_tokens', 4096)}, so "
                          f"mu has no slope; give two token counts (Flux's 256 and 4096)")
    steps = resolution.get("empirical_mu_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"{setting}.empirical_mu_steps={steps!r} is not a number of steps; give a whole number "
                          f">= 1 (Flux.2's training default: 200), or null for the linear rule")
    if steps is not None and len(resolution) > 1:
        raise ConfigError(f"{setting}={resolution}: empirical_mu_steps (Flux.2's rule) replaces the linear rule, whose "
                          f"constants would be ignored; give empirical_mu_steps alone, or the constants alone")


def check_shift(setting: str, value) -> None:
    """A flow sampler's ``shift``: null, a finite number > 0, or ``resolution`` (the sample size's shift)."""
    if value is None or value == "resolution":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{setting}={value!r} is not a shift: give a number > 0 (Wan: 3 at 480p, 5 at 720p; 1 = "
                          f"no shift) or resolution (the sample size's, as Flux's scheduler)")


def check_shift_terminal(setting: str, value) -> None:
    """A sampler's ``shift_terminal``: null, false, or a time in (0, 1) (0 would be no step; 1 no time left)."""
    if value is None or value is False:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError(f"{setting}={value!r} is not a time in (0, 1): give the last non-zero sampling time "
                          f"(LTX-Video's scheduler: 0.1), null for the model family's, or false for no stretch")


def resolve_shift_terminal(sampling: dict, model_config: dict, objective: dict) -> None:
    """``diffusion.sampling.shift_terminal`` (flow matching): null takes the model family's (LTX-Video's scheduler:
    0.1), kept in the run's sampling settings, so infer.py samples with it too (and a checkpoint from before the
    setting gets it there); false: none."""
    if not str(objective.get("_target_", "")).endswith("FlowMatching"):
        return  # (check_sampling refused a stretch for another objective)
    if sampling.get("shift_terminal") is None:
        sampling["shift_terminal"] = model_class(model_config).sampling_defaults(model_config)["shift_terminal"]


def check_sampling(model_cfg: dict, objective_cfg, sampling: dict, prefix: str = "") -> None:
    """The sampler fits the objective, steps are positive, guidance has a null class to guide with and guides some
    of the model's channels. ``prefix``: where the keys live (train.py's ``diffusion.sampling.``)."""
    objective = str(objective_cfg["_target_"]).rsplit(".", 1)[-1]
    allowed = getattr(getattr(objectives, objective, None), "samplers", ())  # each objective declares its samplers
    sampler = sampling.get("sampler")
    if is_scheduler_sampler(sampler) and objective != "FlowMatching":
        raise ConfigError(f"{prefix}sampler={sampler} is diffusers' {SCHEDULERS[sampler]} for flow-matching models "
                          f"(it steps a velocity), but this model is trained with the {objective} objective (it "
                          f"predicts noise, epsilon); use one of {', '.join(allowed)}")
    if objective == "FlowMatching":
        allowed = (*allowed, *SCHEDULERS)
    if sampler is not None and sampler not in allowed:
        raise ConfigError(f"{prefix}sampler={sampler!r} does not fit the {objective} objective; use one of "
                          f"{', '.join(allowed)} (ringdit's own: {', '.join(getattr(objectives, objective).samplers)};"
                          f" diffusers' flow schedulers: {', '.join(SCHEDULERS)})" if objective == "FlowMatching" else
                          f"{prefix}sampler={sampler!r} does not fit the {objective} objective; use one of "
                          f"{', '.join(allowed)}")
    if sampling.get("steps") is not None:
        require_count(f"{prefix}steps", sampling["steps"])
    terminal = sampling.get("shift_terminal")
    check_shift_terminal(f"{prefix}shift_terminal", terminal)
    if terminal is not None and terminal is not False and objective != "FlowMatching":
        raise ConfigError(f"{prefix}shift_terminal={terminal!r} stretches a flow sampler's times, but this is the "
                          f"{objective} objective; leave shift_terminal null")
    if objective == "DDPM":
        check_ddpm_objective(objective_cfg, sampler, prefix)
    timesteps = objective_cfg.get("num_timesteps", 1000) if objective == "DDPM" else None
    if timesteps is not None and sampling.get("steps") is not None and sampling["steps"] > timesteps:
        raise ConfigError(f"{prefix}steps={sampling['steps']} is more than the DDPM schedule's {timesteps} steps; "
                          f"use at most {timesteps}")
    guided, channels = sampling.get("guidance_channels"), model_cfg.get("in_channels")
    if guided is not None and (isinstance(guided, bool) or not isinstance(guided, int) or guided < 1
                               or channels is not None and guided > channels):
        raise ConfigError(f"{prefix}guidance_channels={guided!r} is not a number of the model's {channels} latent "
                          f"channels; use null to guide all of them, or 1..{channels} (3: the original DiT's)")
    if sampling.get("cfg_scale_2") is not None and model_cfg.get("boundary_ratio") is None:
        raise ConfigError(f"{prefix}cfg_scale_2={sampling['cfg_scale_2']} is the low-noise expert's guidance of a "
                          f"two-expert model (Wan 2.2 A14B), but this model has one transformer; set cfg_scale only")
    model_class(model_cfg).check_guidance(model_cfg, sampling, prefix)  # what guidance the model kind takes
    check_joint_shift(model_cfg, sampling, prefix)


def check_joint_shift(model_cfg: dict, sampling: dict, prefix: str = "") -> None:
    """``joint_shift``: null (every stream at ``shift``), or {joint latent: shift > 0} for latents the model denoises
    with its video (MiniMax-H3's audio: its pipeline's 3.0), each stepped by a diffusers scheduler of its own."""
    joint_shift = sampling.get("joint_shift")
    if joint_shift is None:
        return
    defaults = model_class(model_cfg).sampling_defaults(model_cfg)
    keys, own = defaults.get("joint_latents", ()), defaults.get("scheduler")
    example = f"{prefix}joint_shift={{{keys[0] if keys else 'audio'}: 3.0}}"
    if not isinstance(joint_shift, dict) or not joint_shift:
        raise ConfigError(f"{prefix}joint_shift={joint_shift!r} is not a shift per joint latent: give e.g. {example}, "
                          f"or null to step every stream at {prefix}shift")
    for key, value in joint_shift.items():
        if key not in keys:
            denoised = f"its video and {', '.join(keys)}" if keys else "its video alone"
            raise ConfigError(f"{prefix}joint_shift names {key!r}, but this model denoises {denoised}; "
                              + (f"give e.g. {example}" if keys else f"leave {prefix}joint_shift null"))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{prefix}joint_shift.{key}={value!r} is not a shift: give a number > 0 (MiniMax-H3's "
                              f"audio: 3.0)")
    if not is_scheduler_sampler(sampling.get("sampler")):
        raise ConfigError(f"{prefix}joint_shift steps {', '.join(joint_shift)} on a schedule of its own, which only "
                          f"diffusers' scheduler samplers do, but {prefix}sampler={sampling.get('sampler')}; use "
                          + (f"{prefix}sampler={own} (its pipeline's scheduler) or " if own else "")
                          + f"{prefix}sampler={' / '.join(name for name in SCHEDULERS if name != own)}, or leave "
                          f"{prefix}joint_shift null")


def check_ddpm_objective(objective_cfg, sampler: str | None, prefix: str = "") -> None:
    """``diffusion=ddpm``'s settings: each a value the schedule takes (``ringdit.diffusion.objectives.check_ddpm``),
    no key it does not know, and a sampler that can step it."""
    import inspect

    settings = {key: value for key, value in dict(objective_cfg).items() if key != "_target_"}
    known = set(inspect.signature(DDPM.__init__).parameters) - {"self"}
    for key in sorted(set(settings) - known):
        raise ConfigError(f"diffusion.objective.{key}={settings[key]!r} is not a DDPM setting; use one of "
                          f"{', '.join(sorted(known))}")
    check_ddpm(settings)
    if sampler == "ddpm" and settings.get("rescale_zero_snr"):
        raise ConfigError(f"{prefix}sampler=ddpm (the original DiT's ancestral sampler) with "
                          "diffusion.objective.rescale_zero_snr=true: its posterior divides by the last step's "
                          f"alpha_bar, which is 0; use {prefix}sampler=ddim")


def resolve_scheduler(sampling: dict, model_config: dict, prefix: str = "") -> None:
    """A diffusers scheduler sampler (``sampler=flow_euler / unipc / dpmpp``): its configuration is the pipeline
    folder's ``scheduler/scheduler_config.json`` when ``model.pretrained`` is a pipeline folder that has one -- read
    (``ringdit.common.safe_json``), built and stepped once here, so that a broken file is refused before any rank starts --
    and kept in the sampling settings (``scheduler_config``: a checkpoint samples with it even where the folder is
    gone); else the run's schedule (``shift``, ``shift_terminal``), built when sampling."""
    from pathlib import Path

    sampler = sampling.get("sampler")
    if not is_scheduler_sampler(sampler):
        return
    pretrained = model_config.get("pretrained")
    file = Path(str(pretrained)).expanduser() / "scheduler" / "scheduler_config.json" if pretrained else None
    fix = (f"give the pipeline's scheduler_config.json (a JSON object of {SCHEDULERS[sampler]}'s settings), or "
           f"remove scheduler/ from the folder to sample with the run's shift")
    if file is not None and (file.exists() or file.parent.is_dir()):
        sampling["scheduler_config"] = read_json(file, f"model.pretrained's scheduler config {file}", fix=fix,
                                                 kind=dict)
        check_scheduler_file(sampling["scheduler_config"], file)
    folder_config = sampling.get("scheduler_config")
    terminal = (folder_config or {}).get("shift_terminal") if folder_config is not None else \
        sampling.get("shift_terminal")
    if terminal and sampler == "dpmpp":
        raise ConfigError(f"{prefix}sampler=dpmpp: DPMSolverMultistepScheduler cannot stretch its sigmas to end at "
                          f"shift_terminal={terminal} (the model family's scheduler's: LTX-Video's); use "
                          f"{prefix}sampler=flow_euler or unipc, or set {prefix}shift_terminal=false")
    if folder_config is None:
        return
    where = f"{file if file is not None else 'the checkpoint'}'s scheduler config (for {prefix}sampler={sampler})"
    try:
        scheduler = build_scheduler(sampler, scheduler_config(sampler, folder_config))
        set_timesteps(scheduler, 4, PipelineTimesteps(), 256, None)  # every setting used once: a bad value fails here
    except Exception as error:  # diffusers' own complaint about a value (a str shift, an unknown spacing ...)
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{where} does not build a working {SCHEDULERS[sampler]} ({reason}); {fix}") from None
    try:
        check_flow_scheduler(scheduler, where)
    except ValueError as error:
        raise ConfigError(str(error)) from None
