"""The objective and the sampling settings of a run: Flux's resolution shift resolved, and samplers, steps and
guidance that fit the objective and the model."""

from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf

from ringdit.errors import ConfigError, require_count

log = logging.getLogger(__name__)


def training_diffusion(cfg: DictConfig, model_config: dict, tokens: int) -> tuple[dict, dict]:
    """train.py's (objective, sampling): ``diffusion.objective`` with its shift resolved for ``tokens`` per sample,
    and ``diffusion.sampling`` checked against it and the model, with the preview grids' own cfg_scale too."""
    objective = OmegaConf.to_container(cfg.diffusion.objective, resolve=True)
    sampling = OmegaConf.to_container(cfg.diffusion.sampling, resolve=True)
    resolve_shift(objective, sampling, tokens, model_config)
    check_sampling(model_config, objective, sampling, prefix="diffusion.sampling.")
    grid_cfg_scale = OmegaConf.select(cfg, "callbacks.sample_grid.cfg_scale")
    if grid_cfg_scale is not None:  # the preview grids sample with their own scale
        check_sampling(model_config, objective, {**sampling, "cfg_scale": grid_cfg_scale})
    return objective, sampling


def training_expert(cfg: DictConfig, model_config: dict, objective: dict) -> str | None:
    """``diffusion.expert``: which expert of a two-expert model (``model.boundary_ratio``) trains -- ``high``,
    ``low`` or ``both`` (the default) --; None for a model with one transformer, where setting it is a mistake."""
    from ringdit.diffusion.experts import EXPERT_SETTINGS

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
    if not str(objective["_target_"]).endswith("FlowMatching"):
        raise ConfigError(f"model.boundary_ratio={model_config['boundary_ratio']}: a two-expert model splits the "
                          f"flow-matching times between its experts; train it with diffusion=flow")
    return setting or "both"


def resolve_shift(objective: dict, sampling: dict, tokens: int, model_config: dict | None = None) -> None:
    """``diffusion.objective.shift=resolution``: Flux's shift, for each sample's own token count (every bucket its
    own), in training and sampling; logged for ``tokens`` (the data's most frequent bucket). A diffusers family whose
    pipeline has its own constants (LTX-Video's) gets them in ``objective["resolution"]``, unless it gives some."""
    if objective.get("shift") != "resolution":
        if isinstance(objective.get("shift"), str):
            raise ConfigError(f"diffusion.objective.shift must be a number > 0 or 'resolution', got "
                              f"{objective['shift']!r}")
        return
    from ringdit.diffusion import resolution_shift
    from ringdit.spec.model import is_diffusers_model

    if objective.get("resolution") is None and model_config is not None and is_diffusers_model(model_config):
        from ringdit.models.diffusers.families import get_family

        constants = get_family(model_config["family"]).resolution_shift
        if constants is not None:  # kept with the run's objective: infer.py samples with them too
            objective["resolution"] = dict(constants)
    log.info("diffusion.objective.shift=resolution: per sample size, e.g. %.4f for %d image tokens",
             resolution_shift(tokens, **(objective.get("resolution") or {})), tokens)
    if sampling.get("shift") in (None, "resolution"):
        sampling["shift"] = "resolution"


def check_sampling(model_cfg: dict, objective_cfg, sampling: dict, prefix: str = "") -> None:
    """The sampler fits the objective, steps are positive, guidance has a null class to guide with and guides some
    of the model's channels. ``prefix``: where the keys live (train.py's ``diffusion.sampling.``)."""
    from ringdit.diffusion import objectives
    from ringdit.spec.model import is_diffusers_model

    objective = str(objective_cfg["_target_"]).rsplit(".", 1)[-1]
    allowed = getattr(getattr(objectives, objective, None), "samplers", ())  # each objective declares its samplers
    if sampling.get("sampler") is not None and sampling["sampler"] not in allowed:
        raise ConfigError(f"sampler={sampling['sampler']!r} does not fit the {objective} objective; use one of {allowed}")
    if sampling.get("steps") is not None:
        require_count("steps", sampling["steps"])
    timesteps = objective_cfg.get("num_timesteps", 1000) if objective == "DDPM" else None
    if timesteps is not None and sampling.get("steps") is not None and sampling["steps"] > timesteps:
        raise ConfigError(f"{prefix}steps={sampling['steps']} is more than the DDPM schedule's {timesteps} steps; "
                          f"use at most {timesteps}")
    guided, channels = sampling.get("guidance_channels"), model_cfg.get("in_channels")
    if guided is not None and (isinstance(guided, bool) or not isinstance(guided, int) or guided < 1
                               or channels is not None and guided > channels):
        raise ConfigError(f"{prefix}guidance_channels={guided!r} is not a number of the model's {channels} latent "
                          f"channels; use null to guide all of them, or 1..{channels} (3: the original DiT's)")
    cfg_scale = sampling.get("cfg_scale")
    if sampling.get("cfg_scale_2") is not None and model_cfg.get("boundary_ratio") is None:
        raise ConfigError(f"{prefix}cfg_scale_2={sampling['cfg_scale_2']} is the low-noise expert's guidance of a "
                          f"two-expert model (Wan 2.2 A14B), but this model has one transformer; set cfg_scale only")
    if sampling.get("guidance") is not None and not is_diffusers_model(model_cfg):
        raise ConfigError(f"{prefix}guidance={sampling['guidance']!r} is the guidance embedding's value of a "
                          f"guidance-distilled model (Flux-dev); the DiT has none and would ignore it: leave it unset, "
                          f"and set the strength of classifier-free guidance with cfg_scale")
    if is_diffusers_model(model_cfg):  # guidance away from the empty or negative prompt: pretrained models learnt it
        return
    if cfg_scale is not None and cfg_scale != 1.0 and not model_cfg.get("class_dropout_prob", 0.1) > 0:
        raise ConfigError(f"cfg_scale={cfg_scale} needs a model trained with label dropout (a null class), but "
                          f"model.class_dropout_prob={model_cfg.get('class_dropout_prob')}; use cfg_scale=1")
