"""The ORIGINAL layer names of a diffusers family's LoRA layers (as the model's authors and ComfyUI name them, not
diffusers'): each ``Family`` record's ``original_lora_names``, read by ``ringdit.checkpoints.lora_formats`` (ComfyUI's
format, both ways).

Each family's names are the inverse of what diffusers reads (``diffusers/loaders/lora_conversion_utils.py``):
Wan and SkyReels-V2 ``_convert_non_diffusers_wan_lora_to_diffusers``, Flux ``_convert_kohya_flux_lora_to_diffusers``
(the BFL names), LTX-Video ``_convert_non_diffusers_ltxv_lora_to_diffusers`` and QwenImage
``_convert_non_diffusers_qwen_lora_to_diffusers`` (their original names are diffusers' own, a few LTX layers aside);
HunyuanVideo 1.5 has no LoRA reader in diffusers: its names are those of Tencent's checkpoint, as diffusers' script
``scripts/convert_hunyuan_video1_5_to_diffusers.py`` converts them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """diffusers layer names matching ``pattern`` are the original layer ``name`` (``\\1``: the block index); a
    layer fused in the original is ``part`` of ``parts`` (diffusers' layer names, in the fused weight's row order)."""

    pattern: str
    name: str
    parts: tuple[str, ...] = ()
    part: str = ""
    alpha: bool = True  # False: the family's diffusers reader takes no alpha for this layer (the scale goes into up)


def _attention(diffusers_prefix: str, original_prefix: str, names: dict[str, str], **kw) -> list[Rule]:
    return [Rule(rf"{diffusers_prefix}\.{re.escape(ours)}", f"{original_prefix}.{theirs}", **kw)
            for ours, theirs in names.items()]


def _fused(diffusers_prefix: str, original: str, parts: tuple[str, ...]) -> list[Rule]:
    return [Rule(rf"{diffusers_prefix}\.{re.escape(part)}", original, parts=parts, part=part) for part in parts]


B = r"(\d+)"  # a block's index

# Wan 2.1 / 2.2 and SkyReels-V2 (Wan's layer names): the inverse of _convert_non_diffusers_wan_lora_to_diffusers.
WAN_NAMES = (
    *_attention(rf"blocks\.{B}\.attn1", r"blocks.\1.self_attn",
                {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}),
    *_attention(rf"blocks\.{B}\.attn2", r"blocks.\1.cross_attn",
                {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "add_k_proj": "k_img",
                 "add_v_proj": "v_img"}),
    Rule(rf"blocks\.{B}\.ffn\.net\.0\.proj", r"blocks.\1.ffn.0"),
    Rule(rf"blocks\.{B}\.ffn\.net\.2", r"blocks.\1.ffn.2"),
    # outside the blocks diffusers' reader takes no alpha
    Rule(r"condition_embedder\.time_proj", "time_projection.1", alpha=False),
    Rule(r"proj_out", "head.head", alpha=False),
    Rule(r"condition_embedder\.text_embedder\.linear_1", "text_embedding.0", alpha=False),
    Rule(r"condition_embedder\.text_embedder\.linear_2", "text_embedding.2", alpha=False),
    Rule(r"condition_embedder\.time_embedder\.linear_1", "time_embedding.0", alpha=False),
    Rule(r"condition_embedder\.time_embedder\.linear_2", "time_embedding.2", alpha=False),
    Rule(r"condition_embedder\.image_embedder\.ff\.net\.0\.proj", "img_emb.proj.1", alpha=False),
    Rule(r"condition_embedder\.image_embedder\.ff\.net\.2", "img_emb.proj.3", alpha=False),
)

# Flux.1 (Black Forest Labs' names): the inverse of _convert_kohya_flux_lora_to_diffusers.
FLUX_NAMES = (
    *_fused(rf"transformer_blocks\.{B}\.attn", r"double_blocks.\1.img_attn.qkv", ("to_q", "to_k", "to_v")),
    *_fused(rf"transformer_blocks\.{B}\.attn", r"double_blocks.\1.txt_attn.qkv",
            ("add_q_proj", "add_k_proj", "add_v_proj")),
    *_attention(rf"transformer_blocks\.{B}", r"double_blocks.\1",
                {"attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0",
                 "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
                 "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin"}),
    *_fused(rf"single_transformer_blocks\.{B}", r"single_blocks.\1.linear1",
            ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")),
    *_attention(rf"single_transformer_blocks\.{B}", r"single_blocks.\1",
                {"proj_out": "linear2", "norm.linear": "modulation.lin"}),
)

# LTX-Video: Lightricks' names are diffusers' but for two modules (convert_ltx_transformer_checkpoint_to_diffusers).
# Its diffusers reader only strips "diffusion_model.": it takes lora_A / lora_B keys (as LTX-Video-Trainer writes
# them; ComfyUI reads those too) and no alpha, so the scale goes into lora_B.
LTX_VIDEO_NAMES = (Rule(r"proj_in", "patchify_proj", alpha=False),
                   Rule(r"time_embed\.(.+)", r"adaln_single.\1", alpha=False), Rule(r"(.+)", r"\1", alpha=False))

# QwenImage: the original names are diffusers'.
QWENIMAGE_NAMES = (Rule(r"(.+)", r"\1"),)

# HunyuanVideo 1.5 (Tencent's names): the inverse of diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py.
REFINER = rf"context_embedder\.token_refiner\.refiner_blocks\.{B}"
HUNYUAN_VIDEO15_NAMES = (
    *_attention(rf"transformer_blocks\.{B}", r"double_blocks.\1",
                {"attn.to_q": "img_attn_q", "attn.to_k": "img_attn_k", "attn.to_v": "img_attn_v",
                 "attn.to_out.0": "img_attn_proj", "attn.add_q_proj": "txt_attn_q", "attn.add_k_proj": "txt_attn_k",
                 "attn.add_v_proj": "txt_attn_v", "attn.to_add_out": "txt_attn_proj", "ff.net.0.proj": "img_mlp.fc1",
                 "ff.net.2": "img_mlp.fc2", "ff_context.net.0.proj": "txt_mlp.fc1", "ff_context.net.2": "txt_mlp.fc2",
                 "norm1.linear": "img_mod.linear", "norm1_context.linear": "txt_mod.linear"}),
    *_fused(REFINER, r"txt_in.individual_token_refiner.blocks.\1.self_attn_qkv", ("attn.to_q", "attn.to_k",
                                                                                   "attn.to_v")),
    *_attention(REFINER, r"txt_in.individual_token_refiner.blocks.\1",
                {"attn.to_out.0": "self_attn_proj", "ff.net.0.proj": "mlp.fc1", "ff.net.2": "mlp.fc2",
                 "norm_out.linear": "adaLN_modulation.1"}),
    Rule(r"proj_out", "final_layer.linear"),
)
