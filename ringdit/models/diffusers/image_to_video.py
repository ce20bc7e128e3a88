"""Image-to-video conditioning, as diffusers' ``WanImageToVideoPipeline`` and ``HunyuanVideo15ImageToVideoPipeline``
build it (and as Wan and HunyuanVideo 1.5 train it).

Three kinds, a property of the architecture (``Family.image_condition``):

- ``"first_frame"`` (Wan 2.2 TI2V-5B, the pipeline's ``expand_timesteps=True``): the model's input is the noisy video
  with its first latent frame replaced by the clean ``image_latents`` (the image encoded alone as a 1-frame video),
  and every token has its own timestep: 0 on the first frame's tokens, t elsewhere. The prediction of the first
  frame is never used (it is replaced again at every step and after the last), so the loss leaves it out.
- ``"channels"`` (Wan 2.1 I2V-14B, ``in_channels = 2 * out_channels + 4``): the model's input is
  ``[noisy video ; mask (4) ; image_condition]`` on the channels, where ``image_condition`` is the VAE latents of
  ``[first frame ; zero frames]`` and the mask is 1 on the first latent frame (the 4 pixel frames the VAE folds into
  it), 0 elsewhere. Optional CLIP embeddings (``image_embeds``) go to the cross-attention (``image_dim``).
- ``"first_frame_channels"`` (HunyuanVideo 1.5 I2V, ``in_channels = 2 * out_channels + 1``): the model's input is
  ``[noisy video ; condition latents ; mask (1)]`` on the channels, where the condition latents are ``image_latents``
  (the image encoded alone, as ``"first_frame"`` takes them) in the first latent frame and zero after, and the mask is
  1 on the first latent frame, 0 after (the pipeline's ``prepare_cond_latents_and_mask``; the authors' train.py
  ``get_condition`` puts the clip's own first latent frame there, the same latents for a causal VAE). The noisy first
  frame is not replaced: every frame is denoised at the step's one timestep, and the loss covers every frame (the
  authors' train.py). SigLIP image embeddings (``image_embeds``, 729 tokens) join the text as unmasked keys.

An image model may take an image too: ``"reference"`` (Qwen-Image-Edit) denoises beside a reference image's latents
``reference`` (B, C, H, W), encoded alone as the images are (``ringdit.models.diffusers.qwenimage_edit``); the model's
input is the noisy latents as they are. infer.py's ``image=`` and the server's image give it.
"""

from __future__ import annotations

import torch

from ringdit.common.errors import ConfigError

Tensor = torch.Tensor

IMAGE_CONDITIONS = ("first_frame", "channels", "first_frame_channels", "reference")
# what the data must hold
CONDITION_KEY = {"first_frame": "image_latents", "channels": "image_condition", "first_frame_channels": "image_latents",
                 "reference": "reference"}
VAE_TEMPORAL = 4  # Wan's VAE folds 4 pixel frames into one latent frame (the first frame alone into the first)


def first_frame_mask(shape: tuple[int, ...], device=None, dtype=torch.float32) -> Tensor:
    """(1, 1, T, H, W) for latents ``(B, C, T, H, W)``: 0 on the first latent frame, 1 elsewhere (the pipeline's
    ``first_frame_mask`` with ``expand_timesteps``)."""
    mask = torch.ones(1, 1, *shape[2:], device=device, dtype=dtype)
    mask[:, :, 0] = 0
    return mask


def replace_first_frame(x: Tensor, image_latents: Tensor) -> Tensor:
    """x (B, C, T, H, W) with its first latent frame replaced by ``image_latents`` (B, C, 1, H, W):
    ``(1 - mask) * condition + mask * latents`` as the pipeline writes it, where the condition is the 1-frame
    image latents (broadcast over T, kept only where mask = 0)."""
    if image_latents.shape != (*x.shape[:2], 1, *x.shape[3:]):
        raise ValueError(f"image_latents have shape {tuple(image_latents.shape)}; expected "
                         f"{(*x.shape[:2], 1, *x.shape[3:])} (the first frame's latents) for latents {tuple(x.shape)}")
    mask = first_frame_mask(x.shape, x.device, x.dtype)
    return (1 - mask) * image_latents.to(x) + mask * x


def token_timesteps(t: Tensor, shape: tuple[int, ...], patch: tuple[int, int, int]) -> Tensor:
    """(B, S) per-token timesteps for model time ``t`` (B,) and latents ``shape`` (B, C, T, H, W) patched by
    ``patch``: 0 on the first frame's tokens, t elsewhere, in the tokens' (T, H, W) order (the pipeline's
    ``(first_frame_mask[0][0][:, ::2, ::2] * t).flatten()`` for 1x2x2 patches)."""
    mask = first_frame_mask(shape, t.device, t.dtype)[0, 0]  # (T, H, W)
    tokens = mask[:: patch[0], :: patch[1], :: patch[2]].flatten()  # (S,)
    return tokens[None] * t[:, None]  # (B, S)


def channel_mask(shape: tuple[int, ...], device=None, dtype=torch.float32) -> Tensor:
    """(B, 4, T, H, W) for latents ``(B, C, T, H, W)``: the mask channels of ``WanImageToVideoPipeline``'s
    ``prepare_latents`` -- 1 on the first latent frame's 4 channels (its 4 repeated pixel-frame masks), 0 after."""
    batch, _, frames, height, width = shape
    pixel_frames = (frames - 1) * VAE_TEMPORAL + 1
    mask = torch.ones(batch, 1, pixel_frames, height, width, device=device, dtype=dtype)
    mask[:, :, 1:] = 0  # only the first pixel frame is given
    first = torch.repeat_interleave(mask[:, :, :1], VAE_TEMPORAL, dim=2)  # the first latent frame holds 4 of them
    mask = torch.cat([first, mask[:, :, 1:]], dim=2)  # (B, 1, 4 T, H, W)
    return mask.view(batch, -1, VAE_TEMPORAL, height, width).transpose(1, 2)  # (B, 4, T, H, W)


def channel_input(x: Tensor, image_condition: Tensor) -> Tensor:
    """(B, 2C + 4, T, H, W): ``cat([x, mask, image_condition])`` on the channels, the I2V model's input."""
    if image_condition.shape != x.shape:
        raise ValueError(f"image_condition has shape {tuple(image_condition.shape)}; expected {tuple(x.shape)} (the "
                         f"latents of [first frame ; zero frames], shaped like the video's latents)")
    return torch.cat([x, channel_mask(x.shape, x.device, x.dtype), image_condition.to(x)], dim=1)


def first_frame_channel_input(x: Tensor, image_latents: Tensor) -> Tensor:
    """(B, 2C + 1, T, H, W): ``cat([x, condition, mask])`` on the channels, HunyuanVideo 1.5 I2V's input, where the
    condition is ``image_latents`` (B, C, 1, H, W) in the first latent frame and zero after and the mask is 1 on the
    first latent frame (``HunyuanVideo15ImageToVideoPipeline.prepare_cond_latents_and_mask``)."""
    if image_latents.shape != (*x.shape[:2], 1, *x.shape[3:]):
        raise ValueError(f"image_latents have shape {tuple(image_latents.shape)}; expected "
                         f"{(*x.shape[:2], 1, *x.shape[3:])} (the first frame's latents) for latents {tuple(x.shape)}")
    given = 1 - first_frame_mask(x.shape, x.device, x.dtype)  # (1, 1, T, H, W): 1 on the first latent frame
    condition = given * image_latents.to(x)  # (B, C, T, H, W): the image's latents there, zero after
    return torch.cat([x, condition, given.expand(x.shape[0], 1, *x.shape[2:])], dim=1)


def require_image(kind: str, cond: dict, family: str) -> Tensor:
    """The conditioning tensor ``kind`` needs, or a one-line error naming it."""
    key = CONDITION_KEY[kind]
    if key not in cond:
        raise ConfigError(f"model.family={family} is image-to-video: its conditioning needs {key!r} (it holds "
                          f"{sorted(cond)}); prepare the data with the first frames (prepare task=i2v) or pass "
                          f"infer.py image=<file or folder>")
    return cond[key]
