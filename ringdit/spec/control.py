"""``infer.py control=``: the control video of a control-video model's samples (Wan VACE), checked before anything
starts; encoded on the launching process by ``ringdit.sampling.conditions`` (``ringdit.media.control_pixels``)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from ringdit.common.errors import ConfigError
from ringdit.media.control_pixels import check_control_clip
from ringdit.models.conditioning import CONTROL_KEY
from ringdit.models.diffusers.families import find_family
from ringdit.spec.model import kind_name


@dataclass(frozen=True)
class ControlInput:
    """One control clip, conditioning every sample (the samples' frames and size, checked)."""

    file: str
    size: tuple[int, int]  # (H, W) in pixels of the samples
    frames: int            # video frames of the samples
    temporal: int          # pixel frames per latent frame of the model family's VAE

    @classmethod
    def from_config(cls, cfg: DictConfig, model_config: dict, data_info: dict, *, ckpt_path: str, vae: str | None,
                    user_size: tuple[list[int], int | None], given_prompts: bool,
                    prompt_sizes: int = 1) -> ControlInput | None:
        family = control_family(model_config)
        control = cfg.get("control")
        if not control:
            if family is not None and given_prompts:
                raise ConfigError(f"ckpt_path={ckpt_path} is a control-video model (model.family={family.name}): give "
                                  f"the control video with control=<video file>, or neither prompts nor text_embeds "
                                  f"for the training data's held-out prompts and their control latents")
            return None
        if family is None:
            raise ConfigError(f"control={control}: ckpt_path={ckpt_path} is not a control-video model (model.family="
                              f"{kind_name(model_config)}: it takes no control video); leave control= unset, "
                              f"or train a control-video model (model=wan_vace*)")
        if prompt_sizes > 1:
            raise ConfigError(f"control={control} with a prompt_file of several sizes: one control clip fits one size; "
                              f"give the prompts one size (or one prompt file per size)")
        if "vae" not in data_info:  # synthetic latents: sizes in latent cells, and no VAE the data were encoded with
            raise ConfigError(f"control={control}: ckpt_path={ckpt_path} was trained on data that record no VAE "
                              f"(latents made without one, as data=synthetic_text_latents makes), so a clip cannot be "
                              f"encoded as its control latents were; leave control=, prompts and text_embeds unset "
                              f"to sample the held-out prompts with their own control latents")
        (height, width), frames = user_size
        check_control_clip(str(control), height, width, int(frames or 1))
        temporal, spatial = family.vae_factors
        expected = (model_config.get("config") or {}).get("vace_in_channels")
        channels = 2 * data_info["channels"] + spatial ** 2  # [inactive ; reactive latents ; packed mask]
        if expected is not None and expected != channels:
            raise ConfigError(f"control={control}: the data's VAE gives {channels} control channels (2 x "
                              f"{data_info['channels']} latents + {spatial}x{spatial} mask) but model.config."
                              f"vace_in_channels is {expected}; sample a model trained on this VAE's latents")
        if not vae:
            raise ConfigError(f"control={control}: the control video is encoded with the data's VAE, and no VAE folder "
                              f"is known; give vae=<the VAE folder the data was prepared with>")
        return cls(file=str(control), size=(height, width), frames=int(frames or 1), temporal=temporal)


def control_family(model_config: dict):
    """The model's Family when it denoises under a control video (its conditioning takes ``control``), else None."""
    family = find_family(model_config.get("family"))
    return family if family is not None and CONTROL_KEY in family.condition_keys else None
