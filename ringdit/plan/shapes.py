"""The model the plan is for: the input shape the data settings give (pixels, or latents through the model kind's
VAE), and the preset's sizes at that shape, read from the model built on the meta device."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ringdit.common.errors import ConfigError, require_count
from ringdit.costs import ModelSize, model_size
from ringdit.costs.model_size import sequence_streams
from ringdit.media.buckets import MAX_SIDE
from ringdit.models.frame_rule import FrameRule
from ringdit.plan.planner_settings import preset_name
from ringdit.spec.model import build_on_meta, kind_name, model_class, model_config

def latent_shape(cfg: DictConfig, model_cfg: dict, vae_factors: tuple[int | None, int], video: bool,
                 frame_pad: int = 1, patch: tuple[int, ...] = (1, 1), clip_frames: int | None = None) -> list[int]:
    """The model's input shape ((T,) H, W) for ``data.size`` / ``data.frames`` (pixels; latents when
    ``data.latent`` is true: ``vae_factors``, (temporal, spatial) of the model kind's VAE, and the latent frames
    padded to a multiple of ``frame_pad`` as prepare pads them: CogVideoX's); H and W whole tokens of ``patch``.
    ``data.frames`` null lays out ``clip_frames``, the frames of the model's published pipeline, where it has one."""
    size = cfg.data.size
    size = [size, size] if isinstance(size, int) and not isinstance(size, bool) else \
        list(size) if OmegaConf.is_list(size) else []
    if len(size) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and 0 < s <= MAX_SIDE for s in size):
        raise ConfigError(f"data.size must be H, W in pixels (or one integer for a square), each from 1 to "
                          f"{MAX_SIDE}, got {cfg.data.size!r}; e.g. data.size=[480,832]")
    # the pipeline's clip is a count of pixel frames: a default only where the sizes are pixels (data.latent=true)
    frames = cfg.data.frames if cfg.data.frames is not None or not video or not cfg.data.latent else clip_frames
    temporal, spatial = vae_factors if cfg.data.latent else (1, 1)
    family = kind_name(model_cfg)
    if video:
        require_count("data.frames", frames, hint="the frames of a video sample, e.g. 81")  # a DiT has no default
        if temporal and temporal > 1:  # the VAE's rule (CogVideoX's latents padded to pairs: 1 + 8k); the patch's
            FrameRule(temporal, frame_pad if cfg.data.latent else 1).check("data.frames", frames,  # is checked below
                                                                          who=f"{family}'s VAE")
    elif frames is not None:
        raise ConfigError(f"data.frames={frames} but {preset_name(model_cfg)} is an image model; leave "
                          f"data.frames null")
    step = [spatial * p for p in patch[-2:]]  # pixels (or cells) per token
    if any(s % k for s, k in zip(size, step)):
        why = f"the VAE's factor {spatial} x the model's patch {list(patch[-2:])}" if cfg.data.latent else \
            f"the model's patch {list(patch[-2:])}"
        fix = [max(k, round(s / k) * k) for s, k in zip(size, step)]
        raise ConfigError(f"data.size={size} is not a multiple of {step} ({why}); use data.size=[{fix[0]},{fix[1]}]"
                          + (", or data.latent=false for sizes that are the model's input already"
                             if cfg.data.latent else ""))
    latent = [s // spatial for s in size]
    if video:
        latent_frames = (frames - 1) // temporal + 1 if temporal and temporal > 1 else frames
        if cfg.data.latent:
            latent_frames = -(-latent_frames // frame_pad) * frame_pad
        latent = [latent_frames, *latent]
    return latent


def planned_model(cfg: DictConfig) -> tuple[ModelSize, str]:
    """The preset's sizes for the data's shape, from the model built on the meta device, and a line describing it."""
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    lora = OmegaConf.to_container(cfg.lora, resolve=True)
    # the model kind says what data it takes: its patch, whether it is a video model, its VAE's factors, and the
    # data description but the shape, which the sizes give
    plan = model_class(model_cfg).planned_data(model_cfg, OmegaConf.to_container(cfg.data, resolve=True))
    patch = plan["patch"]
    shape = latent_shape(cfg, model_cfg, plan["vae_factors"], plan["video"], plan.get("frame_pad", 1), patch,
                         plan.get("clip_frames"))
    data = {**plan["data"], "image_size": shape}
    if any(s % p for s, p in zip(shape, patch)):
        raise ConfigError(f"data.frames={cfg.data.frames or plan.get('clip_frames')} gives {shape[0]} latent frames, which the model's temporal "
                          f"patch {patch[0]} does not divide; choose frames whose latent count is a multiple of it")
    config = model_config(model_cfg, data)
    meta_model = build_on_meta(config)
    expert = OmegaConf.select(cfg, "diffusion.expert", default=None)
    if expert not in (None, "both"):
        if expert not in ("high", "low") or not meta_model.experts:
            raise ConfigError(f"diffusion.expert={expert!r}: high or low picks the expert of a two-expert model "
                              f"(model=wan22_a14b*) that trains; null for every other model")
        meta_model.train_only(expert)  # its gradients, optimizer state and EMA only
    size = model_size(config, meta_model, lora)
    grid = " x ".join(str(s // p) for s, p in zip(shape, patch))
    text = f" + {size.text_tokens} text tokens (sharded with the image)" if size.text_tokens else ""
    packed = sequence_streams(meta_model)
    # every stream the attention sees: one packed into the grid's sequence is in the count; another runs through
    # blocks of its own (Wan VACE's control) or is a sequence of its own in the same blocks (LTX-2's audio)
    inside = "".join(f" + {n} {name} tokens" for name, n in size.stream_tokens if name in packed)
    beside = "".join(f" + {n} {name} tokens (a sequence of its own, split over the ranks)"
                     for name, n in size.stream_tokens if name not in packed)
    clip = (f", {plan['clip_frames']} frames: the pipeline's clip; data.frames= to change it"
            if plan["video"] and cfg.data.frames is None else "")
    line = (f"{preset_name(model_cfg)}: {_count(size.parameters)} parameters"
            + (f" ({_count(size.lora_parameters)} of LoRA rank {lora['rank']})" if size.lora else "")
            + f", {size.depth} blocks, hidden {size.hidden_size}, {size.num_heads} heads, MLP {size.mlp_hidden}; "
              f"{size.tokens} tokens per sample ({grid} of the input {list(shape)}{clip}{inside}){beside}{text}")
    return size, line


def _count(n: int) -> str:
    """A parameter count: 14.29 B, 676.0 M, 2.0 M."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f} {unit}"
    return str(n)
