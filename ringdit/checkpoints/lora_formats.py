"""A LoRA adapter in ComfyUI's format: the model's ORIGINAL layer names (as the model's authors and ComfyUI name
them, not diffusers'), prefixed ``diffusion_model.``, with ``lora_down`` (A), ``lora_up`` (B) and ``alpha`` keys:

    diffusion_model.blocks.0.self_attn.q.lora_down.weight   (rank, in)
    diffusion_model.blocks.0.self_attn.q.lora_up.weight     (out, rank)
    diffusion_model.blocks.0.self_attn.q.alpha              ()  -- the layer adds (alpha / rank) * up @ down

Each family's names are the inverse of what diffusers reads (``diffusers/loaders/lora_conversion_utils.py``):
Wan and SkyReels-V2 ``_convert_non_diffusers_wan_lora_to_diffusers``, Flux ``_convert_kohya_flux_lora_to_diffusers``
(the BFL names), LTX-Video ``_convert_non_diffusers_ltxv_lora_to_diffusers`` and QwenImage
``_convert_non_diffusers_qwen_lora_to_diffusers`` (their original names are diffusers' own, a few LTX layers aside);
HunyuanVideo 1.5 has no LoRA reader in diffusers: its names are those of Tencent's checkpoint, as diffusers' script
``scripts/convert_hunyuan_video1_5_to_diffusers.py`` converts them.

Where the original model fuses layers that diffusers keeps apart (Flux's ``img_attn.qkv``, its single blocks'
``linear1`` = q, k, v and the MLP's input; HunyuanVideo 1.5's token refiner ``self_attn_qkv``), the adapters of the
parts become one adapter of the fused layer: the downs stacked, the ups block-diagonal (a part without an adapter
adds zero rows), so the rank is the sum of the parts' and alpha grows with it (alpha / rank is unchanged). That is
exact: the fused layer's update is the parts' updates stacked. A layer whose diffusers reader takes no alpha (Wan's
layers outside the blocks) gets its scale multiplied into ``lora_up`` and no ``alpha`` key (ComfyUI then scales by 1).
"""

from __future__ import annotations

import re
from pathlib import Path
from dataclasses import dataclass

import torch

from ringdit.errors import ConfigError

Tensor = torch.Tensor


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
WAN = [
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
]

# Flux.1 (Black Forest Labs' names): the inverse of _convert_kohya_flux_lora_to_diffusers.
FLUX = [
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
]

# LTX-Video: Lightricks' names are diffusers' but for two modules (convert_ltx_transformer_checkpoint_to_diffusers).
# Its diffusers reader only strips "diffusion_model.": it takes lora_A / lora_B keys (as LTX-Video-Trainer writes
# them; ComfyUI reads those too) and no alpha, so the scale goes into lora_B.
LTX_VIDEO = [Rule(r"proj_in", "patchify_proj", alpha=False),
             Rule(r"time_embed\.(.+)", r"adaln_single.\1", alpha=False), Rule(r"(.+)", r"\1", alpha=False)]

# QwenImage: the original names are diffusers'.
QWENIMAGE = [Rule(r"(.+)", r"\1")]

# HunyuanVideo 1.5 (Tencent's names): the inverse of diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py.
REFINER = rf"context_embedder\.token_refiner\.refiner_blocks\.{B}"
HUNYUAN_VIDEO15 = [
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
]

FAMILY_RULES = {"wan": WAN, "wan22_ti2v": WAN, "wan_i2v": WAN, "skyreels_v2": WAN, "flux": FLUX,
                "ltx_video": LTX_VIDEO, "qwenimage": QWENIMAGE, "hunyuan_video15": HUNYUAN_VIDEO15,
                "hunyuan_video15_i2v": HUNYUAN_VIDEO15}
PREFIX = "diffusion_model."
KEYS = {"ltx_video": ("lora_A", "lora_B")}  # (down, up) key names where they are not lora_down / lora_up


@dataclass
class Original:
    """One original layer's adapter being assembled: its parts' (down, up) by diffusers' layer name."""

    rule: Rule
    prefix: str  # diffusers' name of the fused layer's parts, less the part (``single_transformer_blocks.0.``)
    pieces: dict[str, tuple[Tensor, Tensor]]


def original_layer(family: str, module: str) -> tuple[str, Rule]:
    """The original name of diffusers' layer ``module`` (``blocks.0.attn1.to_q``) and the rule that gave it."""
    for rule in FAMILY_RULES[family]:
        match = re.fullmatch(rule.pattern, module)
        if match:
            return match.expand(rule.name), rule
    raise ConfigError(f"the adapter on {module} has no ComfyUI name for model.family={family} (ringdit maps the "
                      f"attention, MLP and modulation projections); export it with lora=true format=diffusers, or "
                      f"train with lora.targets that leave it out")


def comfyui_lora(adapters: dict[str, Tensor], scale: float, family: str,
                 out_features: dict[str, int]) -> dict[str, Tensor]:
    """``adapters`` -- one transformer's, by diffusers' names (``blocks.0.attn1.to_q.lora_A.weight``, ``lora_B``) --
    in ComfyUI's format. ``scale``: the adapters' alpha / rank; ``out_features``: every layer's output size (the
    rows a fused layer's part without an adapter takes)."""
    if family not in FAMILY_RULES:
        raise ConfigError(f"format=comfyui has no layer names for model.family={family}; it exports "
                          f"{', '.join(sorted(FAMILY_RULES))}; use format=diffusers")
    layers: dict[str, Original] = {}
    for key in sorted(adapters):
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[:-len(".lora_A.weight")]
        down, up = adapters[key], adapters[f"{module}.lora_B.weight"]
        name, rule = original_layer(family, module)
        layer = layers.setdefault(name, Original(rule, module[:len(module) - len(rule.part)], {}))
        layer.pieces[rule.part or module] = (down, up)
    out = {}
    for name, layer in layers.items():
        down, up = _fuse(layer, out_features) if layer.rule.parts else next(iter(layer.pieces.values()))
        key, (down_key, up_key) = f"{PREFIX}{name}", KEYS.get(family, ("lora_down", "lora_up"))
        out[f"{key}.{down_key}.weight"] = down.clone().contiguous()
        if layer.rule.alpha:
            out[f"{key}.{up_key}.weight"] = up.clone().contiguous()
            out[f"{key}.alpha"] = torch.tensor(scale * down.shape[0], dtype=torch.float32)  # alpha / rank = scale
        else:
            out[f"{key}.{up_key}.weight"] = (up * scale).contiguous()
    return out


def _fuse(layer: Original, out_features: dict[str, int]) -> tuple[Tensor, Tensor]:
    """The fused layer's adapter: the parts' downs stacked, their ups block-diagonal over the fused layer's rows (a
    part without an adapter: zero rows, so its rows of the weight stay as they are)."""
    downs = [layer.pieces[part][0] for part in layer.rule.parts if part in layer.pieces]
    rank = sum(down.shape[0] for down in downs)
    ups, column = [], 0
    for part in layer.rule.parts:
        rows = layer.pieces[part][1].shape[0] if part in layer.pieces else out_features[layer.prefix + part]
        block = downs[0].new_zeros(rows, rank)  # (rows of this part, rank of the fused adapter)
        if part in layer.pieces:
            down, up = layer.pieces[part]
            block[:, column:column + down.shape[0]] = up
            column += down.shape[0]
        ups.append(block)
    return torch.cat(downs), torch.cat(ups)


EXPERT_FILES = {"transformer.": "high_noise", "transformer_2.": "low_noise"}  # as Wan 2.2's LoRAs are published


def export_comfyui(state: dict[str, Tensor], info: dict, out_dir: Path, name: str) -> Path:
    """Write a LoRA checkpoint's adapter (``state``, ``info`` as ``read_weights`` gives them) in ComfyUI's format to
    ``out_dir/<name>.safetensors``; a two-expert model's as ``<name>_high_noise`` and ``<name>_low_noise``. Returns
    the first file written."""
    from safetensors.torch import save_file

    from ringdit.atomic import atomic_write
    from ringdit.lora import ADAPTER_NAME, adapter_state
    from ringdit.spec.model import ModelSpec, model_class

    model_cfg, lora = info.get("model") or {}, info.get("lora") or {}
    if not model_cfg or not model_class(model_cfg).diffusers_folders:
        raise ConfigError("format=comfyui names a diffusers family's layers; this checkpoint is ringdit's DiT: export "
                          "its adapter with lora=true format=diffusers")
    adapters = adapter_state(state)
    if not adapters or not lora.get("rank"):
        raise ConfigError("the checkpoint holds no LoRA adapter weights (trained without lora.rank > 0?)")
    scale = (lora.get("alpha") or lora["rank"]) / lora["rank"]  # peft's alpha / rank
    _, model = ModelSpec.from_config(model_cfg, 1)  # on meta: the layers' sizes
    parts = [prefix for prefix, _ in model.subfolders()]
    written = []
    for prefix in parts:
        ours = {key[len(prefix):].replace(f".{ADAPTER_NAME}.", "."): value for key, value in adapters.items()
                if key.startswith(prefix)}
        if not ours:
            continue
        transformer = model.get_submodule(prefix.rstrip("."))
        out_features = {module: layer.out_features for module, layer in transformer.named_modules()
                        if isinstance(layer, torch.nn.Linear)}
        tensors = comfyui_lora(ours, scale, model.family.name, out_features)
        path = out_dir / (f"{name}.safetensors" if len(parts) == 1 else f"{name}_{EXPERT_FILES[prefix]}.safetensors")
        with atomic_write(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        written.append(path)
    return written[0]
