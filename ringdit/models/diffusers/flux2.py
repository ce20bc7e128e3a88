"""Flux.2 (``diffusers.Flux2Transformer2DModel``): joint ``[text ; image]`` attention in double- and single-stream
blocks, 4-axis RoPE from position ids, run unmodified under ringdit's plan -- the same plan as Flux's.

What the plan has to know about this model, read from its ``forward`` and its processors:

- Its forward takes the packed image tokens ``(B, S, 128)`` with their position ids ``(S, 4)`` and the text states
  ``(B, L, D)`` with theirs ``(L, 4)``, and the plan cuts all four at the model's input: each rank's chunk is
  ``[its text shard ; its image shard]`` in both kinds of block (the double-stream processor joins
  ``[text ; image]`` q/k/v itself; the model joins the streams for the single-stream blocks and, after them, drops
  the first ``encoder_hidden_states.shape[1]`` rows, which is this rank's text chunk). The rotations ``(cos, sin)``
  are computed from the rank's own ids, position by position, so they are the rows the whole sequence would have.
- Both processors (``Flux2AttnProcessor``, ``Flux2ParallelSelfAttnProcessor``) call ``dispatch_attention_fn``
  from their module's namespace with no mask: the router reaches them. The single-stream attention has no ``to_q``
  (q, k, v and the MLP input are one fused projection): its heads are its ``heads`` of ``head_dim``.
- Its modulation is shared across blocks: one per-sample ``(B, 6D)`` / ``(B, 3D)`` table computed once from the
  timestep and guidance embedding and handed to every block whole. Nothing per token, nothing to cut.
- RoPE rotates q and k in fp32 (``apply_rotary_emb`` computes ``x.float() * cos + ...`` and casts back; the
  rotations are fp32), so an fp64 model's q and k are rounded to fp32 there. The sharded path runs the same
  processor code on each rank's own rows: the same elementwise arithmetic as on one process.
- The text has no mask (Flux2Pipeline passes none: its padded Mistral states are attended to as trained); only
  the text's tail padding on the ranks is masked, by the plan's text stream length.

ringdit's latents are the VAE's 32 channels at 1/8 of the pixels, as Flux2Pipeline holds them normalised (its
``vae.bn`` statistics apply to the 2x2-patchified channels: the data must be the patchified, normalised latents
unpatchified back to 32 channels); the family packs them 2x2 into 128-channel tokens, row-major, as the pipeline's
``_patchify_latents`` + ``_pack_latents`` do (the same order as Flux's packing); ``ringdit.media.vae`` makes such
latents from AutoencoderKLFlux2 (for prepare) and decodes them (for infer.py). Model time is sigma x 1000; the
model is called with sigma (the pipeline's ``timestep / 1000``) and multiplies by 1000 itself, and the guidance
embedding (FLUX.2-dev is guidance-distilled) takes the guidance scale, ``model.guidance``.
"""

from __future__ import annotations

import torch
from torch import nn

from ringdit.models.diffusers.family import ChatTemplate, Family, PipelineTimesteps
from ringdit.models.parallel_plan import ParallelPlan

Tensor = torch.Tensor


def image_ids(height: int, width: int, device) -> Tensor:
    """(H * W, 4) position ids (t=0, row, col, l=0) of a token grid, as Flux2Pipeline's ``_prepare_latent_ids``."""
    rows, cols = torch.meshgrid(torch.arange(height, device=device), torch.arange(width, device=device), indexing="ij")
    zeros = torch.zeros_like(rows)
    return torch.stack([zeros, rows, cols, zeros], dim=-1).reshape(-1, 4).float()


def text_ids(length: int, device) -> Tensor:
    """(L, 4) position ids (0, 0, 0, l) of the text tokens, as Flux2Pipeline's ``_prepare_text_ids``."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids


def _flux2_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict) -> Tensor:
    """x (B, C, H, W) latents (C = in_channels / 4; H, W even), t (B,) in 0..1000, cond: text (B, L, D) Mistral
    states, guidance (B,) the guidance scale of guidance-distilled models (FLUX.2-dev)."""
    # Flux's 2x2 packing is Flux.2's patchify + pack (imported here: families.py imports this module)
    from ringdit.models.diffusers.packing import pack_latents, unpack_latents

    height, width = x.shape[-2:]
    text = cond["text"]
    out = transformer(
        hidden_states=pack_latents(x), encoder_hidden_states=text, timestep=t / 1000,
        img_ids=image_ids(height // 2, width // 2, x.device), txt_ids=text_ids(text.shape[1], x.device),
        guidance=cond.get("guidance"), return_dict=False,
    )[0]
    return unpack_latents(out, height, width)


def _chat_template() -> ChatTemplate:
    """Flux2Pipeline.encode_prompt's: its Mistral3's layers 10, 20 and 30 joined (D = 3 x hidden size), nothing cut
    off, every state kept (its transformer takes all ``max_len`` states, no mask), its system message and its own
    formatting of the chats (content parts, "[IMG]" taken out of the prompt)."""
    import inspect

    from diffusers.pipelines.flux2 import pipeline_flux2

    # encode_prompt hands _get_mistral_3_small_prompt_embeds its own layers and the module's system message
    layers = inspect.signature(pipeline_flux2.Flux2Pipeline.encode_prompt).parameters["text_encoder_out_layers"]
    return ChatTemplate("flux2", pipeline_flux2.SYSTEM_MESSAGE, 0, tuple(int(i) for i in layers.default),
                        masked=False, generation_prompt=False, model_types=("mistral3",),
                        format=lambda prompts, system: pipeline_flux2.format_input(prompts=prompts,
                                                                                 system_message=system))


FLUX2 = Family(
    name="flux2",
    model_class="Flux2Transformer2DModel",
    plan=ParallelPlan(
        blocks=("transformer_blocks", "single_transformer_blocks"),
        joint_attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
        # image tokens (B, S, 4C) and their ids (S, 4), or (B, S, 4) as Flux2Pipeline passes them (the model takes
        # ids[0]): the ids' token dim is the second to last in both forms
        split_inputs={"": {"hidden_states": 1, "img_ids": -2}},
        text_inputs={"": {"encoder_hidden_states": 1, "txt_ids": -2}},  # text states (B, L, D), ids (L, 4) / (B, L, 4)
        gather_outputs={"proj_out": {None: 1}},  # (B, S, 4C): the image tokens only
    ),
    forward=_flux2_forward,
    video=False,
    vae_factors=(None, 8),
    condition_keys=("text",),
    text_dim="joint_attention_dim",
    latent_channels=lambda config: config["in_channels"] // 4,
    patch_shape=lambda config: (2 * config["patch_size"], 2 * config["patch_size"]),  # 2x2 packing x its patch
    # the image stream's attention projections as for Flux, and the single-stream blocks' fused q / k / v / MLP-in
    # projection (they have no to_q); not their to_out (attention and MLP out in one Linear): its suffix
    # "attn.to_out" also names the double-stream blocks' ModuleList, which peft cannot adapt
    lora_targets=("to_q", "to_k", "to_v", "to_out.0", "to_qkv_mlp_proj"),
    # shift=resolution: Flux2Pipeline's compute_empirical_mu(tokens, steps), imported from diffusers. Sampling takes
    # it at its own steps, as the pipeline does. Training has no step count; it takes 200, the fit's upper anchor (mu
    # is interpolated in the step count between fits at 10 and 200 steps), where the rule is one line for every size,
    # mu = a2 x tokens + b2: the line it uses at any step count above 4300 tokens (so training's shift has no jump
    # there), and FLUX.1's resolution shift (calculate_shift: 0.5 at 256 tokens, 1.15 at 4096; 4e-6 apart there).
    # Fewer sampling steps take a larger mu (at 50 steps and 4096 tokens 2.02 against 1.15).
    resolution_shift={"empirical_mu_steps": 200},
    # Flux2Pipeline: sigmas linspace(1, 1 / steps, steps), none for a flow-sigmas scheduler
    pipeline_timesteps=PipelineTimesteps(sigmas="to_last", drops_for_flow_sigmas=True),
    chat_template=_chat_template,
)
