"""Wan VACE (``diffusers.WanVACETransformer3DModel``, Wan2.1-VACE-1.3B / 14B): Wan 2.1 text-to-video with a control
video, run under ringdit's plan with diffusers' weights and modules.

What the plan has to know about this model, read from its ``forward`` and ``WanVACETransformerBlock``:

- Two token streams of the same grid: the video (``patch_embedding``) and the control video (``vace_patch_embedding``
  of the control latents, zero-padded by the model to the video's token count). The VACE blocks run first, each a
  Wan block over the control tokens -- self-attention over the control video, cross-attention to the text -- whose
  ``proj_out`` gives a hint; the first adds the video tokens to the control tokens (``proj_in(control) + video``).
  The main blocks then run over the video, and after main block ``vace_layers[i]`` the model adds hint ``i`` (times
  its scale) to the video tokens: a per-token sum, local to every rank once both streams are cut alike.
- The plan cuts the video tokens where each block list starts (argument 0 of ``blocks.0`` and of ``vace_blocks.0``:
  the model's forward hands both the whole sequence) and the control tokens where they enter the VACE blocks
  (argument 2 of ``vace_blocks.0``): a stream of its own, ``control``, with its own length and padding, which the
  VACE self-attention attends over (``attention_streams``). Its length is the video's, so every rank holds the
  control tokens of its own video tokens, and the RoPE rotations cut with the video (``rope``, as Wan's plan) rotate
  both. The later VACE blocks also receive the whole video (unused: only the first projects it). The prediction is
  gathered at ``proj_out``; the control stream is never gathered (it is not predicted).

The control input is what ``WanVACEPipeline.prepare_video_latents`` / ``prepare_masks`` build: ``(B, vace_in_channels,
T, H, W)`` = the VAE latents of the inactive and the reactive video (``video * (1 - mask)``, ``video * mask``, 16 + 16
channels) and the pixel mask packed 8 x 8 per latent cell (64 channels): 96 for the published models. It has the
latents' grid (the pipeline's reference images, prepended as frames, are not taken here). Classifier-free guidance
keeps it in the unconditional prediction, as the pipeline passes it to both.
"""

from __future__ import annotations

from math import prod

import torch
from torch import nn

from ringdit.models.conditioning import CONTROL_KEY as CONTROL  # the control latents' key, the stream's name
from ringdit.models.diffusers.family import Family
from ringdit.models.parallel_plan import ParallelPlan, StreamPlan

Tensor = torch.Tensor


def control_latents(cond: dict, latents: Tensor, channels: int) -> Tensor:
    """``cond["control"]`` (B, C_vace, T, H, W), checked against the latents ``(B, C, T, H, W)`` and the model's
    ``channels`` (vace_in_channels): the model pads a shorter control video with zeros and fails on a longer one, so
    another grid is refused here."""
    control = cond.get(CONTROL)
    if control is None:
        raise ValueError("model.family=wan_vace denoises under a control video, but the conditioning has no "
                         "'control' latents (B, vace_in_channels, T, H, W); give the data's control latents")
    if control.dim() != 5 or control.shape[0] != latents.shape[0] or control.shape[2:] != latents.shape[2:]:
        raise ValueError(f"the control latents {tuple(control.shape)} do not fit the latents {tuple(latents.shape)}: "
                         f"a control video has the clip's frames and size (the latents' T, H, W)")
    if control.shape[1] != channels:
        raise ValueError(f"the control latents have {control.shape[1]} channels but model.config.vace_in_channels is "
                         f"{channels}: encode the control video as the model's pipeline does")
    return control


def pack_mask(mask: Tensor, spatial: int, temporal: int) -> Tensor:
    """mask (B, T, H, W) in {0, 1} -> (B, spatial^2, T', H / spatial, W / spatial): each latent cell's
    ``spatial x spatial`` pixels on the channels, the T frames resampled to T' = ceil(T / temporal) by nearest-exact
    (``WanVACEPipeline.prepare_masks`` without reference images)."""
    batch, frames, height, width = mask.shape
    cells = mask.view(batch, frames, height // spatial, spatial, width // spatial, spatial)
    cells = cells.permute(0, 3, 5, 1, 2, 4).flatten(1, 2)  # (B, spatial^2, T, h, w)
    latent_frames = (frames + temporal - 1) // temporal
    return nn.functional.interpolate(cells, size=(latent_frames, height // spatial, width // spatial),
                                     mode="nearest-exact")


def control_condition(encode, video: Tensor, spatial: int, temporal: int, mask: Tensor | None = None) -> Tensor:
    """The model's ``control`` input from a control video, as ``WanVACEPipeline`` builds ``control_hidden_states``
    (``prepare_video_latents`` + ``prepare_masks``): video (B, 3, T, H, W) in [-1, 1], mask (B, T, H, W) of the
    pixels to generate (None: all of them, the pipeline's default), ``encode`` the VAE's normalised encode (B, 3, T, H,
    W) -> (B, C, T', h, w) -> (B, 2 C + spatial^2, T', h, w): [latents of the inactive video ; of the reactive video ;
    the packed mask]."""
    if mask is None:
        mask = video.new_ones(video.shape[0], *video.shape[2:])
    mask = (mask > 0.5).to(video.dtype)  # the pipeline's torch.where(mask > 0.5, 1, 0)
    inactive, reactive = encode(video * (1 - mask[:, None])), encode(video * mask[:, None])
    packed = pack_mask(mask, spatial, temporal).to(reactive)
    return torch.cat([inactive, reactive, packed], dim=1)


def _wan_vace_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict) -> Tensor:
    """x (B, C, T, H, W) latents, t (B,) in 0..1000 (Wan's sigma x 1000), cond: text (B, L, D_text) UMT5 states
    zero-padded to L (no mask), control (B, vace_in_channels, T, H, W) [, control_scale (len(vace_layers),) the
    pipeline's conditioning_scale per VACE layer, default ones] -> (B, C, T, H, W)."""
    control = control_latents(cond, x, transformer.config.vace_in_channels).to(x.dtype)
    return transformer(hidden_states=x, timestep=t, encoder_hidden_states=cond["text"], control_hidden_states=control,
                       control_hidden_states_scale=cond.get("control_scale"), return_dict=False)[0]


WAN_VACE = Family(
    name="wan_vace",
    model_class="WanVACETransformer3DModel",
    plan=ParallelPlan(
        blocks=("blocks", "vace_blocks"),
        self_attention=("blocks.*.attn1", "vace_blocks.*.attn1"),
        cross_attention=("blocks.*.attn2", "vace_blocks.*.attn2"),
        # (B, S, D) video tokens, handed whole to the first main block and the first VACE block (positionally)
        split_inputs={"blocks.0": {0: 1}, "vace_blocks.0": {0: 1}},
        split_outputs={"rope": {0: 1, 1: 1}},  # (cos, sin), each (1, S, 1, head_dim): the control tokens' too
        gather_outputs={"proj_out": {None: 1}},  # (B, S, patch_volume * C_out)
        streams={CONTROL: StreamPlan(inputs={"vace_blocks.0": {2: 1}})},  # (B, S, D) control tokens
        attention_streams={"vace_blocks.*.attn1": (CONTROL,)},
    ),
    forward=_wan_vace_forward,
    video=True,
    vae_factors=(4, 8),  # Wan 2.1's VAE
    fps=16,  # Wan 2.1's (WanVACEPipeline's example export_to_video(..., fps=16))
    clip_frames=81,  # WanVACEPipeline's num_frames
    condition_keys=("text", CONTROL),
    # the control tokens, the video's grid (the model pads the control video to the video's tokens), through the VACE
    # blocks: each a Wan block of the main blocks' width over as many tokens
    stream_tokens=lambda config, grid: {CONTROL: prod(grid)},
    text_dim="text_dim",
    max_grid=lambda config: (config.get("rope_max_seq_len", 1024),) * 3,  # WanRotaryPosEmbed's table, per axis
)
