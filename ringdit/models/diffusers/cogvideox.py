"""CogVideoX 1.5 (``diffusers.CogVideoXTransformer3DModel`` with RoPE and 2x2x2 patches): joint attention over
``[text ; video]`` in every block, run under ringdit's plan with diffusers' weights and modules.

What the plan has to know about this model, read from its ``forward``, its block and its processor:

- The model's forward embeds ``[text ; video]`` together (``patch_embed``: per-token projections; CogVideoX 1.5 adds
  no positional embedding there, its positions are RoPE's) and cuts the result at the length of the text it was
  given, ``encoder_hidden_states.shape[1]``. The plan cuts the text where it enters the model's forward, so that
  length is this rank's text chunk and the cut stays right, and cuts the video tokens where the blocks start
  (``transformer_blocks.0``). Each block cuts its feed-forward output at its own text input's length: local too.
  After the blocks the model normalises the video tokens alone (``norm_final``, per token) and projects them; the
  plan gathers them at ``proj_out``. The text is never gathered (it is not predicted).
- The pipeline computes the 3-D RoPE (``CogVideoXPipeline._prepare_rotary_positional_embeddings``:
  ``get_3d_rotary_pos_embed`` with ``grid_type="slice"`` and ``max_size`` the config's sample size in tokens) and
  passes it as ``image_rotary_emb``. This family's forward does the same and hands it over as one tensor
  ``(2, S, head_dim)`` (cos ; sin), which the model passes through unchanged and ``apply_rotary_emb`` unpacks as it
  unpacks the pair: the plan cuts it with the video tokens, at the model's input.
- diffusers' ``CogVideoXAttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` directly (and rotates q and k in
  place); ``CogVideoXAttnProcessor`` below computes the same -- the same projections, q/k norms and fp32 rotation of
  the video rows (``apply_rotary_emb``) -- and attends through ``dispatch_attention_fn``, which ringdit routes
  (``Family.attention_processors`` installs it on every block). No mask: the pipeline pads the T5 prompt to 226
  tokens and attends to the padding, as the model was trained.

ringdit's latents are ``(B, C, T, H, W)``; the model takes ``(B, T, C, H, W)``. T must be a multiple of
``patch_size_t`` (the pipeline pads its latent frames to one; ringdit's data must have them). Model time is the
integer DDPM step: CogVideoX is a v-prediction model on a zero-terminal-SNR scaled-linear schedule, trained and
sampled with ``diffusion=ddpm`` and CogVideoX's settings (``experiment=cogvideox_tiny``).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb, get_3d_rotary_pos_embed
from torch import nn

from ringdit.common.errors import ConfigError
from ringdit.models.diffusers.family import Family
from ringdit.models.parallel_plan import ParallelPlan

Tensor = torch.Tensor


class CogVideoXAttnProcessor:
    """diffusers' ``CogVideoXAttnProcessor2_0`` with its attention through ``dispatch_attention_fn``: q, k, v of
    ``[text ; video]`` ``(B, L + S, H, D)``, RoPE on the video rows, and the output split back."""

    def __call__(self, attn: nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor,
                 attention_mask: Tensor | None = None, image_rotary_emb: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if attention_mask is not None:
            raise NotImplementedError("CogVideoX attends without a mask; ringdit's processor takes none")
        text_length = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)  # (B, L + S, D)
        query, key, value = (projection(hidden_states).unflatten(2, (attn.heads, -1))
                             for projection in (attn.to_q, attn.to_k, attn.to_v))  # (B, L + S, H, D_head)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None:  # the video rows only, as diffusers' processor rotates them
            query = _rotate_video(query, image_rotary_emb, text_length)
            if not attn.is_cross_attention:
                key = _rotate_video(key, image_rotary_emb, text_length)
        hidden_states = dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.flatten(2, 3)))
        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_length, hidden_states.shape[1] - text_length], dim=1)
        return hidden_states, encoder_hidden_states


def _rotate_video(x: Tensor, rotary: Tensor, text_length: int) -> Tensor:
    """x (B, L + S, H, D) with its video rows rotated by ``rotary`` (cos, sin), each (S, D)."""
    video = apply_rotary_emb(x[:, text_length:], rotary, sequence_dim=1)
    return torch.cat([x[:, :text_length], video], dim=1)


def install_processors(transformer: nn.Module) -> None:
    transformer.set_attn_processor(CogVideoXAttnProcessor())


def rotary_embedding(config, grid: tuple[int, int, int], device) -> Tensor:
    """(2, F * H' * W', head_dim) float32: cos and sin of the token grid ``(F, H', W')``, as
    ``CogVideoXPipeline._prepare_rotary_positional_embeddings`` computes them for CogVideoX 1.5 (patch_size_t set)."""
    patch = config.patch_size
    cos, sin = get_3d_rotary_pos_embed(
        embed_dim=config.attention_head_dim, crops_coords=None, grid_size=(grid[1], grid[2]), temporal_size=grid[0],
        grid_type="slice", max_size=(config.sample_height // patch, config.sample_width // patch), device=device)
    return torch.stack([cos, sin])


def _cogvideox_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict) -> Tensor:
    """x (B, C, T, H, W) latents (T a multiple of patch_size_t), t (B,) integer DDPM steps, cond: text (B, L, D) T5
    states (the pipeline's: padded to 226 tokens, no mask) -> the v prediction (B, C, T, H, W)."""
    config = transformer.config
    patch, patch_t = config.patch_size, config.patch_size_t
    grid = (x.shape[2] // patch_t, x.shape[3] // patch, x.shape[4] // patch)
    out = transformer(hidden_states=x.transpose(1, 2), encoder_hidden_states=cond["text"], timestep=t,
                      image_rotary_emb=rotary_embedding(config, grid, x.device), return_dict=False)[0]
    return out.transpose(1, 2)  # (B, T, C, H, W) -> (B, C, T, H, W)


def _patch_shape(config: dict) -> tuple[int, int, int]:
    """(p_t, p, p), for the CogVideoX 1.5 layout only: RoPE (CogVideoX 1.0's sin-cos table is added to ``[text ;
    video]`` in the patch embedding, where the plan has cut them apart) and temporal patches."""
    layout = {key: config.get(key) for key in ("use_rotary_positional_embeddings", "patch_size_t")}
    if not layout["use_rotary_positional_embeddings"] or not layout["patch_size_t"]:
        raise ConfigError(f"model.family=cogvideox15 runs the CogVideoX 1.5 layout (use_rotary_positional_embeddings:"
                          f" true, patch_size_t: 2), but model.config has {layout}; use model=cogvideox15*")
    return (config["patch_size_t"], config["patch_size"], config["patch_size"])


COGVIDEOX15 = Family(
    name="cogvideox15",
    model_class="CogVideoXTransformer3DModel",
    plan=ParallelPlan(
        blocks=("transformer_blocks",),
        joint_attention=("transformer_blocks.*.attn1",),
        # the video tokens (B, S, D) where the blocks start; the rotations (2, S, head_dim) at the model's input
        split_inputs={"transformer_blocks.0": {"hidden_states": 1}, "": {"image_rotary_emb": 1}},
        # the text (B, L, D) at the model's input: its forward cuts [text ; video] at this rank's text length
        text_inputs={"": {"encoder_hidden_states": 1}},
        gather_outputs={"proj_out": {None: 1}},  # (B, S, C * p_t * p * p)
    ),
    forward=_cogvideox_forward,
    video=True,
    vae_factors=(4, 8),  # AutoencoderKLCogVideoX: 4 frames, 8 pixels per latent cell
    fps=16,  # CogVideoX 1.5's model card: 16 fps (CogVideoX 1.0 made 8: its pipeline's example)
    clip_frames=81,  # CogVideoXPipeline's num_frames: the config's sample_frames (81 for CogVideoX 1.5)
    frame_pad=2,  # 1 + 8k frames give an odd count of latent frames; prepare pads them to pairs
    condition_keys=("text",),
    text_dim="text_embed_dim",
    text_len=lambda config: config["max_text_seq_length"],  # the pipeline pads every prompt to 226 T5 tokens
    patch_shape=_patch_shape,
    # RoPE's "slice" grid has sample_height / sample_width // patch_size rows / columns: a larger grid fails in it
    max_grid=lambda config: (10**9, config["sample_height"] // config["patch_size"],
                             config["sample_width"] // config["patch_size"]),
    attention_processors=install_processors,
)
