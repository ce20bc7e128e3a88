"""SkyReels-V2 (``diffusers.SkyReelsV2Transformer3DModel``): Wan 2.1's architecture, trained with diffusion forcing.

Diffusion forcing gives every latent frame its own timestep, ``t (B, F)``. The model expands it inside its forward
(no module to hook) into a per-token modulation ``(B, 6, S, D)`` that every block reads whole, and a per-token final
shift / scale ``(B, S, D)``. So the plan, beside Wan's (self-attention sharded, cross-attention to the replicated
text local, RoPE sliced), cuts that modulation at every block's input (``blocks.*`` input 2, dim 2: each rank keeps
its own tokens' rows, as Wan's per-token timesteps) and gathers the tokens at the final norm (``norm_out``) instead
of the output projection: the final shift / scale, the projection and the unpatchify then run on the whole sequence
on every rank (one norm-free affine and one linear: small next to the blocks).

The family always calls the model in diffusion-forcing mode: a per-sample ``t (B,)`` becomes ``(B, F)`` with the
same value on every frame, the same numbers as the per-sample mode (every token gets the same embedding), so one
plan fits both. ``fps`` (models with ``inject_sample_info``) is passed once for the whole batch: diffusers repeats
a per-sample fps embedding by the frame count in this mode, which is wrong for batch > 1; one entry broadcasts.
"""

from __future__ import annotations

import torch
from torch import nn

from ringdit.models.block_io import BlockIO
from ringdit.models.diffusers.family import Family
from ringdit.models.diffusers.original_names import WAN_NAMES
from ringdit.models.parallel_plan import ParallelPlan

Tensor = torch.Tensor

# SkyReels-V2's frame rate (its pipelines' default fps=24), which they embed as an index: 0 for 16 fps, 1 otherwise.
FPS = 24
FPS_INDEX = 0 if FPS == 16 else 1


def _skyreels_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict) -> Tensor:
    """x (B, C, T, H, W) latents, t (B,) or per latent frame (B, T / p_t) in 0..1000 (sigma x 1000, as Wan),
    cond["text"] (B, L, D_text) UMT5 states zero-padded to L (no mask, as Wan)."""
    config = transformer.config
    if config.num_frame_per_block > 1:
        raise NotImplementedError(f"SkyReels-V2 with num_frame_per_block={config.num_frame_per_block} attends "
                                  f"block-causally over frames (a dense mask), which ringdit's ring / Ulysses "
                                  f"attention does not take; use num_frame_per_block=1 (full attention)")
    frames = x.shape[2] // config.patch_size[0]
    if t.dim() == 1:
        t = t[:, None].expand(-1, frames)  # (B, F): one timestep per latent frame
    elif t.shape != (x.shape[0], frames):
        raise ValueError(f"SkyReels-V2 takes a timestep per sample (B,) or per latent frame (B, {frames}); got "
                         f"{tuple(t.shape)}")
    fps = [FPS_INDEX] if config.inject_sample_info else None
    return transformer(hidden_states=x, timestep=t, encoder_hidden_states=cond["text"],
                       enable_diffusion_forcing=True, fps=fps, return_dict=False)[0]


SKYREELS_V2 = Family(
    name="skyreels_v2",
    model_class="SkyReelsV2Transformer3DModel",
    plan=ParallelPlan(
        blocks=("blocks",),
        self_attention=("blocks.*.attn1",),
        cross_attention=("blocks.*.attn2",),
        # (B, S, D) patch tokens into the first block; the per-token modulation (B, 6, S, D) into every block
        split_inputs={"blocks.0": {0: 1}, "blocks.*": {2: 2}},
        split_outputs={"rope": {0: 1, 1: 1}},  # (cos, sin), each (1, S, 1, head_dim)
        gather_outputs={"norm_out": {None: 1}},  # (B, S, D): before the per-token final shift / scale
    ),
    forward=_skyreels_forward,
    video=True,
    vae_factors=(4, 8),
    fps=FPS,
    clip_frames=97,  # SkyReelsV2Pipeline's num_frames
    condition_keys=("text",),
    text_dim="text_dim",
    max_grid=lambda config: (config.get("rope_max_seq_len", 1024),) * 3,  # its RoPE table (Wan's), per axis
    cache_blocks=BlockIO("hidden_states"),  # the step cache's token stream (not in diffusers' block registry)
    original_lora_names=WAN_NAMES,  # Wan's layer names
)
