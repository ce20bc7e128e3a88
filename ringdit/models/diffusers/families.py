"""The diffusers model families ringdit runs sequence-parallel: one ``Family`` each, holding its ``ParallelPlan``
(Wan -- text-to-video, Wan 2.2 TI2V and Wan 2.1 I2V --, Flux and QwenImage here; HunyuanVideo 1.5 -- text- and
image-to-video --, SkyReels-V2, LTX-Video, Flux.2, CogVideoX 1.5, Wan VACE, LTX-2, Qwen-Image-Edit and MiniMax-H3 in
their own modules).

To add a family (its own module, like ``hunyuan_video.py``):

1. Read the transformer's ``forward``: find the module input that first carries the patch tokens
   (``split_inputs``), the module that turns per-position RoPE into per-token rotations or the position ids it
   reads (``split_outputs`` / ``split_inputs``), and the output projection (``gather_outputs``); list the attention
   modules over the tokens (``self_attention``), over ``[text ; image]`` (``joint_attention``: the text is sharded
   too, so name where it is cut, ``text_inputs`` / ``text_outputs``, and its mask, ``text_mask``) and those whose
   keys are text only (``cross_attention``). Its processors must call ``dispatch_attention_fn``.
2. Write ``forward(transformer, x, t, cond)``: how ringdit's ``(B, C, [T,] H, W)`` latents, model time (0..1000)
   and conditioning dict map onto the diffusers call, returning the prediction shaped like ``x``.
3. Register it in ``FAMILIES`` and add a ``conf/model/<family>*.yaml`` preset; an exactness test like
   ``tests/test_diffusers_models.py``'s then compares it with the unmodified model on one process.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import nn

from ringdit.diffusion.schedulers import register_scheduler
from ringdit.models.diffusers.cogvideox import COGVIDEOX15
from ringdit.models.diffusers.family import ChatTemplate, Family, PipelineTimesteps
from ringdit.models.diffusers.flux2 import FLUX2
from ringdit.models.diffusers.hunyuan_video import HUNYUAN_VIDEO15, HUNYUAN_VIDEO15_I2V
from ringdit.models.diffusers.original_names import FLUX_NAMES, QWENIMAGE_NAMES, WAN_NAMES
from ringdit.models.diffusers.packing import pack_latents, unpack_latents
from ringdit.models.diffusers.ltx2 import LTX2
from ringdit.models.diffusers.ltx_video import LTX_VIDEO
from ringdit.models.diffusers.minimax_h3 import MINIMAX_H3
from ringdit.models.diffusers.qwenimage_edit import edit_family
from ringdit.models.diffusers.skyreels import SKYREELS_V2
from ringdit.models.diffusers.wan_vace import WAN_VACE
from ringdit.models.parallel_plan import ParallelPlan

Tensor = torch.Tensor


# ---- Wan 2.x: self-attention over video tokens, cross-attention to text, 3-D RoPE -----------------------------------


def _wan_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict) -> Tensor:
    """x (B, C_in, T, H, W) model input (Wan 2.1 I2V's carries the mask and image channels too), t (B,) in 0..1000
    (Wan's sigma x 1000) or (B, S) one per token (Wan 2.2 TI2V), cond["text"] (B, L, D_text) UMT5 states
    zero-padded to L (Wan attends to the padding as it was trained: no mask) [, cond["image_embeds"] (B, N, D_img)
    CLIP states for models with ``image_dim``] -> (B, C_out, T, H, W)."""
    # data prepared with an image_encoder carry image_embeds for every model trained on them; only a transformer with
    # image_dim has the embedder that reads them (diffusers would call its None image_embedder)
    image = cond.get("image_embeds") if transformer.config.get("image_dim") else None
    return transformer(hidden_states=x, timestep=t, encoder_hidden_states=cond["text"],
                       encoder_hidden_states_image=image, return_dict=False)[0]


WAN = Family(
    name="wan",
    model_class="WanTransformer3DModel",
    plan=ParallelPlan(
        blocks=("blocks",),
        self_attention=("blocks.*.attn1",),
        cross_attention=("blocks.*.attn2",),
        # (B, S, D) patch tokens; Wan 2.2 TI2V's per-token timesteps (B, S) too, so their embeddings and every
        # block's modulation (B, S, 6, D) are per-rank like the tokens (a per-sample timestep (B,) stays whole)
        split_inputs={"blocks.0": {0: 1, "hidden_states": 1}, "": {"timestep": 1}},
        split_outputs={"rope": {0: 1, 1: 1}},  # (cos, sin), each (1, S, 1, head_dim)
        gather_outputs={"proj_out": {None: 1}},  # (B, S, patch_volume * C_out)
    ),
    forward=_wan_forward,
    video=True,
    vae_factors=(4, 8),
    fps=16,  # Wan 2.1 and Wan 2.2 A14B (T2V, I2V): WanPipeline's example export_to_video(..., fps=16)
    clip_frames=81,  # WanPipeline's (and WanImageToVideoPipeline's) num_frames
    condition_keys=("text",),
    text_dim="text_dim",
    image_embeds="image_dim",  # CLIP states as extra cross-attention keys, where the config sets image_dim (I2V-14B)
    max_grid=lambda config: (config.get("rope_max_seq_len", 1024),) * 3,  # WanRotaryPosEmbed's table, per axis
    pipelines=("WanPipeline",),  # Wan 2.1 / 2.2 text-to-video, two experts where its boundary_ratio says
    teacache_input=lambda block, io, args, kwargs: (io.argument(block, "temb", args, kwargs), False),  # (B, 6, D)
    # timestep projection, the same on every rank, as TeaCache4Wan2.1 reads it; its "use_ret_steps" polynomials,
    # whose input is that projection and which want the first evaluations computed (warmup)
    teacache_coefficients={
        (1536, 30): (-5.21862437e+04, 9.23041404e+03, -5.28275948e+02, 1.36987616e+01, -4.99875664e-02),  # 1.3B
        (5120, 40): (-3.03318725e+05, 4.90537029e+04, -2.65530556e+03, 5.87365115e+01, -3.15583525e-01),  # 14B
    },
    original_lora_names=WAN_NAMES,
)

# Wan 2.2 TI2V (image and text to video, the 5B): the same transformer, in_channels == out_channels; the image is the
# clean first latent frame, with per-token timesteps (WanImageToVideoPipeline with expand_timesteps=True). A family of
# its own, not a Wan setting: the architecture alone cannot tell it from text-to-video (Wan2.2-TI2V-5B also samples
# text-to-video), so the preset says which conditioning its checkpoints were trained with.
WAN22_TI2V = replace(WAN, name="wan22_ti2v", condition_keys=("text", "image_latents"), image_condition="first_frame",
                     vae_factors=(4, 16), pipelines=(),  # Wan 2.2's VAE: 16x spatial
                     fps=24,  # Wan2.2-TI2V-5B makes 24 fps video (its model card: 720P at 24fps)
                     clip_frames=121)  # 5 s at its 24 fps (Wan2.2 generate.py's frame_num for ti2v-5B)

# Wan 2.1 I2V (the 14B 480p / 720p): in_channels = 2 * out_channels + 4 (video ; mask ; first-frame latents), and
# CLIP image embeddings as extra cross-attention keys where the config has image_dim. ringdit's latents have
# out_channels channels: the model input is built from them (ringdit.models.diffusers.image_to_video).
WAN_I2V = replace(WAN, name="wan_i2v", condition_keys=("text", "image_condition"), image_condition="channels",
                  latent_channels=lambda config: config["out_channels"], pipelines=())


# ---- Flux: joint [text ; image] attention in dual- and single-stream blocks, RoPE from position ids --------------


def image_ids(height: int, width: int, device) -> Tensor:
    """(H * W, 3) position ids (0, row, col) of a token grid, as FluxPipeline makes them."""
    rows, cols = torch.meshgrid(torch.arange(height, device=device), torch.arange(width, device=device), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()


def _flux_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict) -> Tensor:
    """x (B, C, H, W) latents (H, W even), t (B,) in 0..1000, cond: text (B, L, D) T5 states, pooled (B, P) CLIP
    embedding, guidance (B,) for guidance-distilled models (Flux-dev)."""
    height, width = x.shape[-2:]
    text = cond["text"]
    out = transformer(
        hidden_states=pack_latents(x), encoder_hidden_states=text, pooled_projections=cond["pooled"],
        timestep=t / 1000, img_ids=image_ids(height // 2, width // 2, x.device),
        txt_ids=text.new_zeros(text.shape[1], 3), guidance=cond.get("guidance"), return_dict=False,
    )[0]
    return unpack_latents(out, height, width)


FLUX = Family(
    name="flux",
    model_class="FluxTransformer2DModel",
    plan=ParallelPlan(
        blocks=("transformer_blocks", "single_transformer_blocks"),
        joint_attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
        # image tokens (B, S, 4C) and their ids (S, 3), or (B, S, 3) as older pipelines pass them (the model takes
        # ids[0]): the ids' token dim is the second to last in both forms
        split_inputs={"": {"hidden_states": 1, "img_ids": -2}},
        text_inputs={"": {"encoder_hidden_states": 1, "txt_ids": -2}},  # T5 states (B, L, D), ids (L, 3) / (B, L, 3)
        gather_outputs={"proj_out": {None: 1}},  # (B, S, 4C): the image tokens only
    ),
    forward=_flux_forward,
    video=False,
    vae_factors=(None, 8),
    condition_keys=("text", "pooled"),
    text_dim="joint_attention_dim",
    pooled_dim="pooled_projection_dim",
    latent_channels=lambda config: config["in_channels"] // 4,
    patch_shape=lambda config: (2 * config["patch_size"], 2 * config["patch_size"]),  # 2x2 packing x its patch
    # FluxPipeline: sigmas linspace(1, 1 / steps, steps), none for a flow-sigmas scheduler (UniPC, DPM-Solver++)
    pipeline_timesteps=PipelineTimesteps(sigmas="to_last", drops_for_flow_sigmas=True),
    teacache_input=lambda block, io, args, kwargs: (  # (B, S_local, D), as TeaCache4FLUX reads it
        block.norm1(io.argument(block, "hidden_states", args, kwargs),
                    emb=io.argument(block, "temb", args, kwargs))[0], True),
    teacache_coefficients={  # TeaCache4FLUX's, FLUX.1-dev's size
        (3072, 19): (4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00, 2.64230861e-01)},
    original_lora_names=FLUX_NAMES,
)

# ---- QwenImage: joint attention in dual-stream blocks, text padded to a fixed length with a mask -----------------


def _qwenimage_modulated(block, io, args, kwargs) -> tuple[Tensor, bool]:
    """TeaCache's probe: the first block's modulated image stream (B, S_local, D), a token shard."""
    hidden, temb = io.argument(block, "hidden_states", args, kwargs), io.argument(block, "temb", args, kwargs)
    shift, scale, _ = block.img_mod(temb).chunk(2, dim=-1)[0].chunk(3, dim=-1)
    return block.img_norm1(hidden) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1), True


def _qwenimage_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict) -> Tensor:
    """x (B, C, H, W) latents, t (B,) in 0..1000, cond: text (B, L, D) Qwen2.5-VL states padded to L, text_mask
    (B, L) True on real tokens: masked text keys get no attention weight."""
    batch, _, height, width = x.shape
    out = transformer(
        hidden_states=pack_latents(x), encoder_hidden_states=cond["text"],
        encoder_hidden_states_mask=cond["text_mask"], timestep=t / 1000,
        img_shapes=[[(1, height // 2, width // 2)]] * batch, guidance=cond.get("guidance"), return_dict=False,
    )[0]
    return unpack_latents(out, height, width)


def _qwenimage_chat_template() -> ChatTemplate:
    """QwenImagePipeline._get_qwen_prompt_embeds': its prompt string (prompt_template_encode) around the prompt,
    tokenized to its length + the template's tokens, Qwen2.5-VL's last hidden states, the template's leading tokens
    (prompt_template_encode_start_idx, 34) dropped, zero after the real tokens. The pipeline sets both in its
    __init__, so they are read from that code (its literal assignments), not copied here."""
    import ast
    import inspect
    import textwrap

    from diffusers import QwenImagePipeline

    tree = ast.parse(textwrap.dedent(inspect.getsource(QwenImagePipeline.__init__)))
    constants = {node.targets[0].attr: node.value.value for node in ast.walk(tree)
                 if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)
                 and isinstance(node.value, ast.Constant)}
    text, crop = constants["prompt_template_encode"], int(constants["prompt_template_encode_start_idx"])
    system = text.split("<|im_start|>system\n", 1)[-1].split("<|im_end|>", 1)[0]
    return ChatTemplate("qwenimage", system, crop, (-1,), masked=True, generation_prompt=True,
                        model_types=("qwen2_5_vl",), text=text)


QWENIMAGE = Family(
    name="qwenimage",
    model_class="QwenImageTransformer2DModel",
    plan=ParallelPlan(
        blocks=("transformer_blocks",),
        joint_attention=("transformer_blocks.*.attn",),
        split_inputs={"transformer_blocks.0": {"hidden_states": 1, 0: 1}},  # (B, S, D) image tokens
        split_outputs={"pos_embed": {0: 0}},  # (image rotations (S, D/2), text rotations (L, D/2))
        # The text (B, L, D) is cut where the image is; its mask (B, L) at every attention, which each block
        # passes on whole from the model's forward. Before the cut the model's forward sees the whole text: its
        # text rotations start after the image's largest position and need the global text length.
        text_inputs={"transformer_blocks.0": {"encoder_hidden_states": 1, 1: 1},
                     "transformer_blocks.*.attn": {"encoder_hidden_states_mask": 1}},
        text_outputs={"pos_embed": {1: 0}},
        text_mask=("transformer_blocks.0", "encoder_hidden_states_mask"),
        gather_outputs={"proj_out": {None: 1}},
    ),
    forward=_qwenimage_forward,
    video=False,
    vae_factors=(None, 8),
    condition_keys=("text", "text_mask"),
    text_dim="joint_attention_dim",
    latent_channels=lambda config: config["in_channels"] // 4,
    patch_shape=lambda config: (config["patch_size"], config["patch_size"]),
    pipeline_timesteps=PipelineTimesteps(sigmas="to_last"),  # QwenImagePipeline: linspace(1, 1 / steps, steps)
    # shift=resolution: Qwen-Image's scheduler_config.json (a pipeline folder's own config is read instead)
    resolution_shift={"base_tokens": 256, "max_tokens": 8192, "base_shift": 0.5, "max_shift": 0.9},
    teacache_input=_qwenimage_modulated,
    chat_template=_qwenimage_chat_template,  # prompt_template=qwenimage: its Qwen2.5-VL as QwenImagePipeline encodes
    original_lora_names=QWENIMAGE_NAMES,
)

QWENIMAGE_EDIT = edit_family(QWENIMAGE)  # Qwen-Image-Edit: the reference image packed after the image's tokens

FAMILIES: dict[str, Family] = {family.name: family for family in (WAN, WAN22_TI2V, WAN_I2V, FLUX, QWENIMAGE,
                                                                   QWENIMAGE_EDIT, HUNYUAN_VIDEO15,
                                                                   HUNYUAN_VIDEO15_I2V, SKYREELS_V2, LTX_VIDEO, FLUX2,
                                                                   COGVIDEOX15, WAN_VACE, LTX2, MINIMAX_H3)}
for _family in FAMILIES.values():  # sampler=<family> steps its pipeline's own scheduler (MiniMax-H3's)
    if _family.scheduler is not None:
        register_scheduler(_family.name, _family.scheduler)


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model.family={name!r} is not a supported diffusers family; choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]


# ---- the registry's questions: code outside ringdit/models/ asks these and never reads FAMILIES itself ------------


def find_family(name: str | None) -> Family | None:
    """The family called ``name``; None for no name or one that is no diffusers family (the DiT's "dit")."""
    return FAMILIES.get(name or "")


def family_of_pipeline(class_name: str | None) -> Family | None:
    """The family whose published pipeline class (``model_index.json``'s ``_class_name``) is ``class_name``."""
    return next((family for family in FAMILIES.values() if class_name in family.pipelines), None)


def published_pipelines() -> list[str]:
    """Every pipeline class whose folders ringdit samples as published (``Family.pipelines``), sorted."""
    return sorted({pipeline for family in FAMILIES.values() for pipeline in family.pipelines})


def families_of_class(class_name: str | None) -> list[Family]:
    """The families built on the diffusers transformer class ``class_name`` (one class can be several: Wan 2.1 and
    Wan 2.2 TI2V are both ``WanTransformer3DModel``)."""
    return [family for family in FAMILIES.values() if family.model_class == class_name]


def chat_templates() -> dict[str, Callable[[], ChatTemplate]]:
    """``prompt_template``'s names: the families whose pipelines wrap the prompt in a chat template (a family that
    shares another's template, HunyuanVideo 1.5's image-to-video, goes by the first's name)."""
    templates = {}
    for name, family in FAMILIES.items():
        if family.chat_template is not None and family.chat_template not in templates.values():
            templates[name] = family.chat_template
        templates.update(family.chat_variants)  # Qwen-Image-Edit's qwenimage_edit_plus
    return templates


def connector_templates() -> dict[str, str]:
    """``prompt_template``'s names whose pipelines run the encoder's states through text connectors
    (``Family.text_connectors``): {the family's name: its text encoder's model_type}."""
    return {name: family.text_connectors for name, family in FAMILIES.items() if family.text_connectors}


def edit_templates() -> list[str]:
    """The ``prompt_template`` names whose pipelines encode each prompt with its reference image
    (``ChatTemplate.edit_pipeline``), for the advice of a refusal."""
    return [name for name, template in chat_templates().items() if template().edit_pipeline]


def with_original_lora_names() -> list[str]:
    """The families whose LoRA adapters have original (ComfyUI) layer names (``Family.original_lora_names``)."""
    return sorted(name for name, family in FAMILIES.items() if family.original_lora_names)
