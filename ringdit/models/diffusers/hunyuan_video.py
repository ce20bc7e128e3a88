"""HunyuanVideo 1.5 (``diffusers.HunyuanVideo15Transformer3DModel``): dual-stream joint attention over
``[video ; text]`` with a padded text mask, 3-D RoPE on the video tokens, run unmodified under ringdit's plan.

What the plan has to know about this model, read from its ``forward`` and its processor:

- The text comes *after* the video tokens in every joint attention, so the plan says ``text_first=False``: each rank's
  chunk is ``[its video shard ; its text shard]``.
- The model builds its text before the blocks: the Qwen2.5-VL states go through the token refiner (attention over the
  text only, by diffusers' generic ``AttnProcessor2_0``, which calls PyTorch attention directly: it is local by
  nature and stays unrouted, on the whole text, on every rank), then the ByT5 and image-embedding streams are joined
  and every sample's tokens reordered, real ones first. The blocks receive that joined text and its mask ``(B, L)``
  positionally, ``block(hidden_states, encoder_hidden_states, temb, attention_mask, freqs_cis)``: the plan records the
  mask whole at the first block (``text_mask``), and cuts the text and the mask at every block (the model's forward
  hands each block the whole mask).
- The processor pads the mask with True over the video tokens and passes ``dispatch_attention_fn`` a full
  ``(B, 1, S, S)`` boolean mask, the outer product of that key mask with itself. ``PlannedAttention`` reduces it to
  the key mask it is (and refuses any other) and the ring takes the masked keys from the recorded text mask; masked
  text query rows then attend normally instead of being zeroed as PyTorch does for fully masked rows, which changes
  nothing the model outputs: no query ever reads a masked key, and the text stream is not predicted.
- RoPE ``(cos, sin)``, each ``(S, head_dim)``, is cut like the video tokens; the processor rotates q and k in fp32
  (``apply_rotary_emb`` computes in float and casts back, so an fp64 model's q/k are rounded to fp32), on each rank's
  own rows: the same elementwise arithmetic as on one process.

ringdit's latents are the model's ``out_channels`` channels; the rest of its input (the first-frame latents and their
mask, for image-to-video) is zero, as diffusers' text-to-video pipeline passes it, and so is the image embedding, a
single masked token (the pipeline's 729 masked tokens change nothing: masked keys get no weight). The ByT5 glyph text
is the data's (``glyph_text`` / ``glyph_text_mask``, (B, 256, D_byt5) from prepare's ``glyph_encoder``, the
pipeline's ``encoder_hidden_states_2`` / ``encoder_attention_mask_2``; the empty prompt's, all masked, is the null
condition's, so classifier-free guidance and the training condition drop replace it as they replace the text); data
without it give a single masked zero token, the pipeline's for a prompt without quoted text. Model time is the
flow-matching sigma x 1000, as the pipeline's scheduler passes it; guidance is classifier-free (the model has no
guidance embedding).

Image-to-video (``hunyuan_video15_i2v``: the same architecture, trained on the first frame, as
``HunyuanVideo15ImageToVideoPipeline`` calls it): the model's input channels carry the first frame's latents and a
mask (``ringdit.models.diffusers.image_to_video``, kind ``"first_frame_channels"``: built before this forward), and
the image embedding is the data's SigLIP ``image_embeds`` (B, 729, D_image), unmasked keys beside the text (the model
unmasks them because they are not all zero). Both halves of classifier-free guidance, and the training condition drop,
keep the image (the pipeline's negative prompt replaces the text only). A family of its own rather than a setting:
the architecture cannot tell the I2V checkpoints from the T2V ones (only their config's ``task_type`` differs, which
the model's forward never reads).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ringdit.models.diffusers.family import ChatTemplate, Family, PipelineTimesteps
from ringdit.models.diffusers.original_names import HUNYUAN_VIDEO15_NAMES
from ringdit.models.block_io import BlockIO
from ringdit.models.parallel_plan import ParallelPlan

Tensor = torch.Tensor


def _hunyuan_video15_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict,
                             image: Tensor | None = None) -> Tensor:
    """x (B, C, T, H, W) latents (C = out_channels), t (B,) in 0..1000, cond: text (B, L, D) Qwen2.5-VL states
    padded to L, text_mask (B, L) True on real tokens [, glyph_text (B, G, D_byt5) ByT5 states of the quoted text,
    glyph_text_mask (B, G) True on its real tokens]; image (B, N, D_image): image-to-video's SigLIP states, with x
    the whole input (B, in_channels, T, H, W) (``_hunyuan_video15_i2v_forward``)."""
    config = transformer.config
    batch, channels = x.shape[:2]
    # text-to-video: no first-frame condition latents, and a zero condition mask (B, in - C, T, H, W); none left to
    # add when x carries them (image-to-video)
    condition = x.new_zeros(batch, config.in_channels - channels, *x.shape[2:])
    mask = cond["text_mask"].bool()
    # the model averages the text over its real tokens: a prompt with none (an empty-prompt encoding that kept no
    # token) would divide 0 by 0; its first (zero) token stands for it instead
    mask = mask | ((torch.arange(mask.shape[1], device=mask.device) == 0) & ~mask.any(dim=1, keepdim=True))
    glyph_text, glyph_mask = _glyph(cond, x, config.text_embed_2_dim)
    if image is None:
        image = x.new_zeros(batch, 1, config.image_embed_dim)  # (B, 1, D_image): zero = text-to-video
    return transformer(
        hidden_states=torch.cat([x, condition], dim=1), timestep=t, encoder_hidden_states=cond["text"],
        encoder_attention_mask=mask, encoder_hidden_states_2=glyph_text, encoder_attention_mask_2=glyph_mask,
        image_embeds=image, return_dict=False,
    )[0]


def _hunyuan_video15_i2v_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict) -> Tensor:
    """x (B, 2C + 1, T, H, W) the model input [latents ; first-frame condition latents ; mask] (built by
    ``DiffusersTransformer.forward``), t (B,), cond: text-to-video's keys and image_embeds (B, N, D_image) the first
    frame's SigLIP last hidden states (729 tokens for the published models'), as the pipeline's ``image_embeds``."""
    image = cond["image_embeds"]
    width = transformer.config.image_embed_dim
    if image.dim() != 3 or image.shape[0] != x.shape[0] or image.shape[-1] != width:
        raise ValueError(f"image_embeds have shape {tuple(image.shape)}; expected ({x.shape[0]}, N, {width}): the "
                         f"first frame's SigLIP states at the model's image_embed_dim (prepare task=i2v with the "
                         f"pipeline folder's image_encoder)")
    return _hunyuan_video15_forward(transformer, x, t, cond, image=image.to(x))


def _glyph(cond: dict, x: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """(glyph text (B, G, D_byt5), its mask (B, G) bool): the data's, else one masked zero token (no quoted text)."""
    if "glyph_text" in cond:
        return cond["glyph_text"], cond["glyph_text_mask"].bool()
    batch = x.shape[0]
    return x.new_zeros(batch, 1, width), torch.zeros(batch, 1, dtype=torch.bool, device=x.device)


def _chat_template() -> ChatTemplate:
    """HunyuanVideo15Pipeline._get_mllm_prompt_embeds': its Qwen2.5-VL's third-last hidden states after the 108
    template tokens, zero after the real tokens (masked); the prompt's quoted text goes to its ByT5 (glyph)."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline

    defaults = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters
    skip = int(defaults["num_hidden_layers_to_skip"].default)
    return ChatTemplate("hunyuan_video15", defaults["system_message"].default, int(defaults["crop_start"].default),
                        (-(skip + 1),), masked=True, generation_prompt=True, model_types=None, glyph=True)


HUNYUAN_VIDEO15 = Family(
    name="hunyuan_video15",
    model_class="HunyuanVideo15Transformer3DModel",
    plan=ParallelPlan(
        blocks=("transformer_blocks",),
        joint_attention=("transformer_blocks.*.attn",),
        split_inputs={"transformer_blocks.0": {0: 1, "hidden_states": 1}},  # (B, S, D) video tokens
        split_outputs={"rope": {0: 0, 1: 0}},  # (cos, sin), each (S, head_dim)
        # the joined text (B, L, D) where the blocks start, and its mask (B, L), which every block gets whole as its
        # 4th positional input (positional only: the pattern also matches each block's attention, whose keyword
        # attention_mask is the mask already cut)
        text_inputs={"transformer_blocks.0": {1: 1, "encoder_hidden_states": 1}, "transformer_blocks.*": {3: 1}},
        text_mask=("transformer_blocks.0", 3),
        text_first=False,  # [video ; text]
        gather_outputs={"proj_out": {None: 1}},  # (B, S, patch_volume * C_out)
    ),
    forward=_hunyuan_video15_forward,
    video=True,
    vae_factors=(4, 16),
    fps=24,  # HunyuanVideo 1.5's own generate.py writes 24 fps (121 frames: 5 s)
    clip_frames=121,  # HunyuanVideo15Pipeline's num_frames
    condition_keys=("text", "text_mask"),
    text_dim="text_embed_dim",
    glyph_dim="text_embed_2_dim",
    latent_channels=lambda config: config["out_channels"],
    patch_shape=lambda config: (config["patch_size_t"], config["patch_size"], config["patch_size"]),
    pipeline_timesteps=PipelineTimesteps(sigmas="to_zero"),  # HunyuanVideo15Pipeline: linspace(1, 0, steps + 1)[:-1]
    # the step cache's token streams: (video, text) in and out (not in diffusers' block registry)
    cache_blocks=BlockIO("hidden_states", "encoder_hidden_states", 0, 1),
    chat_template=_chat_template,
    original_lora_names=HUNYUAN_VIDEO15_NAMES,  # Tencent's checkpoint's
)

# HunyuanVideo 1.5 I2V (the 480p / 720p i2v transformers): the same model, its input channels [video ; first-frame
# latents ; mask] (in_channels = 2 * out_channels + 1) and SigLIP image embeddings; ringdit's latents are its
# out_channels channels and the model input is built from them (ringdit.models.diffusers.image_to_video)
HUNYUAN_VIDEO15_I2V = replace(HUNYUAN_VIDEO15, name="hunyuan_video15_i2v", forward=_hunyuan_video15_i2v_forward,
                              condition_keys=("text", "text_mask", "image_latents"),  # + image_embeds (image_embeds=)
                              image_condition="first_frame_channels", image_embeds="image_embed_dim")
