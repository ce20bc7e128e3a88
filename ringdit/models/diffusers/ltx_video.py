"""LTX-Video (``diffusers.LTXVideoTransformer3DModel``): self-attention over packed video tokens, cross-attention
to T5 text with a padding mask, RoPE from the latent grid.

The model takes tokens ``(B, S, C * p_t * p * p)`` (the pipeline packs the VAE latents) and computes per-token RoPE
``(B, S, D)`` from the grid size, so the plan cuts the tokens at the model's input and the rotations at the RoPE
module's output; a per-token timestep ``(B, S)`` (LTX's conditioning frames are clean: t = 0 on their tokens) is cut
there too, so the per-token modulation and final shift / scale are per-rank like the tokens (a per-sample ``(B,)``
stays whole). The text is replicated: cross-attention is local.

Its cross-attention mask is a float additive bias, ``-10000`` on padded text keys, expanded to ``(B, heads, 1, L)``:
ringdit reads it as a per-sample boolean key mask (``ringdit.models.parallelize``: checked to be 0 or a large
negative per key, the same for every head and query) and attends to the real keys only, which is what the bias
does (``exp(-10000)`` is 0 in fp32). LTX's RoPE multiplies fp32 rotations with ``q.float()``: in an fp64 model it
rounds q and k to fp32; the sharded path runs the same processor code, so it does the same arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn

from ringdit.models.diffusers.family import Family, PipelineTimesteps
from ringdit.models.diffusers.original_names import LTX_VIDEO_NAMES
from ringdit.models.parallel_plan import ParallelPlan

Tensor = torch.Tensor

# LTXPipeline's default frame rate (its frame_rate=25), which its RoPE is scaled by: the videos play at it too
FPS = 25
# LTXPipeline's default RoPE scale: the VAE's compression (8 frames, 32 pixels) over the frame rate.
ROPE_INTERPOLATION_SCALE = (8 / FPS, 32, 32)


def pack_video(x: Tensor, patch: int, patch_t: int) -> Tensor:
    """(B, C, T, H, W) -> (B, T/pt * H/p * W/p, C * pt * p * p): LTX's patches as tokens, as LTXPipeline packs."""
    batch, channels, frames, height, width = x.shape
    x = x.reshape(batch, channels, frames // patch_t, patch_t, height // patch, patch, width // patch, patch)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack_video(tokens: Tensor, grid: tuple[int, int, int], patch: int, patch_t: int) -> Tensor:
    """The inverse of ``pack_video`` for a token grid ``(T/pt, H/p, W/p)``."""
    batch = tokens.shape[0]
    x = tokens.reshape(batch, *grid, -1, patch_t, patch, patch)  # (B, F, H', W', C, pt, p, p)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def _ltx_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict) -> Tensor:
    """x (B, C, T, H, W) latents, t (B,) or per token (B, S) in 0..1000 (sigma x 1000), cond: text (B, L, D) T5
    states padded to L, text_mask (B, L) True on real tokens."""
    config = transformer.config
    patch, patch_t = config.patch_size, config.patch_size_t
    grid = (x.shape[2] // patch_t, x.shape[3] // patch, x.shape[4] // patch)
    out = transformer(
        hidden_states=pack_video(x, patch, patch_t), encoder_hidden_states=cond["text"], timestep=t,
        encoder_attention_mask=cond["text_mask"], num_frames=grid[0], height=grid[1], width=grid[2],
        rope_interpolation_scale=ROPE_INTERPOLATION_SCALE, return_dict=False,
    )[0]
    return unpack_video(out, grid, patch, patch_t)


LTX_VIDEO = Family(
    name="ltx_video",
    model_class="LTXVideoTransformer3DModel",
    plan=ParallelPlan(
        blocks=("transformer_blocks",),
        self_attention=("transformer_blocks.*.attn1",),
        cross_attention=("transformer_blocks.*.attn2",),
        split_inputs={"": {"hidden_states": 1, "timestep": 1}},  # tokens (B, S, C'); a per-token timestep (B, S)
        split_outputs={"rope": {0: 1, 1: 1}},  # (cos, sin), each (B, S, D)
        gather_outputs={"proj_out": {None: 1}},  # (B, S, C')
    ),
    forward=_ltx_forward,
    video=True,
    vae_factors=(8, 32),
    fps=FPS,
    clip_frames=161,  # LTXPipeline's num_frames
    condition_keys=("text", "text_mask"),
    text_dim="caption_channels",
    latent_channels=lambda config: config["in_channels"] // (config["patch_size_t"] * config["patch_size"] ** 2),
    patch_shape=lambda config: (config["patch_size_t"], config["patch_size"], config["patch_size"]),
    # LTXPipeline's calculate_shift constants, from LTX-Video's scheduler_config.json (shift=resolution)
    resolution_shift={"base_tokens": 1024, "max_tokens": 4096, "base_shift": 0.95, "max_shift": 2.05},
    shift_terminal=0.1,  # the same scheduler_config.json's: its sigmas are stretched to end at 0.1
    # LTXPipeline: sigmas linspace(1, 1 / steps, steps); it steps the scheduler on noise_pred.float()
    pipeline_timesteps=PipelineTimesteps(sigmas="to_last", float32_prediction=True),
    original_lora_names=LTX_VIDEO_NAMES,
    original_lora_keys=("lora_A", "lora_B"),  # as LTX-Video-Trainer writes them (ComfyUI reads those too)
)
