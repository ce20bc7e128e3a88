"""Qwen-Image-Edit (``diffusers.QwenImageTransformer2DModel`` as ``QwenImageEditPipeline`` and
``QwenImageEditPlusPipeline`` call it): QwenImage denoising an image beside the latents of a reference image, run
under ringdit's plan with diffusers' weights and modules.

What the plan has to know, read from the edit pipelines' denoising loop and the transformer's ``forward``:

- The pipeline packs the reference image's VAE latents into 2 x 2 patches as it packs the noisy latents and hands the
  transformer ``hidden_states = cat([latents, image_latents], dim=1)``: one tensor holding two streams back to back,
  the image (predicted) and the reference (never predicted: the pipeline keeps ``noise_pred[:, :latents.size(1)]``).
  ``img_shapes`` lists both grids per sample, ``[(1, h, w), (1, h_ref, w_ref)]``, and the model's RoPE
  (``QwenEmbedRope``) gives each its own positions -- the reference's frame index is 1 (the list index), its rows and
  columns centred as the image's -- concatenated in the same order; the text's positions start after the largest
  grid's half-size. The model embeds (``img_in``), modulates and projects (``proj_out``) the whole concatenation.
- So the reference is a stream packed after the tokens in the tokens' own tensors (``ParallelPlan.packed``): every
  cut of the tokens -- the block input, the rotations, Qwen-Image-Edit-2511's per-token ``modulate_index`` -- cuts
  the image part and the reference part each over the ranks, with its own tail padding, and every rank holds
  ``[its image tokens ; its reference tokens]``; the gather at ``proj_out`` joins each part back. The joint attention
  attends over ``[text ; image ; reference]`` (``attention_streams``). The streams' lengths are read from
  ``img_shapes`` when the model's forward starts.
- Qwen-Image-Edit-2511 (``zero_cond_t: true``) modulates the reference tokens with timestep 0: the model doubles the
  timestep batch and picks per token by ``modulate_index`` ``(B, S + S_ref)`` (0 on the image, 1 on the reference),
  which each block receives whole and the plan cuts like the tokens.

The reference latents are ``cond["reference"]`` ``(B, C, H_ref, W_ref)``: the VAE latents of the reference image, as
``QwenImageEditPipeline._encode_vae_image`` normalises them. The edit pipelines resize the reference to about a
megapixel at its own aspect ratio and sample at that size by default; ringdit prepares and samples it at the image's
size. Classifier-free guidance keeps it in the unconditional prediction (the pipelines pass it to both).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from math import prod
from typing import Callable

import torch
from torch import nn

from ringdit.models.conditioning import REFERENCE_KEY as REFERENCE  # the reference latents' key, the stream's name
from ringdit.models.diffusers.family import ChatTemplate, Family
from ringdit.models.diffusers.packing import pack_latents, unpack_latents
from ringdit.models.parallel_plan import TEXT, TOKENS, PackedStreams, ParallelPlan

Tensor = torch.Tensor


def reference_latents(cond: dict, latents: Tensor) -> Tensor:
    """``cond["reference"]`` (B, C, H_ref, W_ref), checked against the latents ``(B, C, H, W)``: the same samples and
    channels, a grid of whole 2 x 2 patches."""
    reference = cond.get(REFERENCE)
    if reference is None:
        raise ValueError("model.family=qwenimage_edit denoises beside a reference image, but the conditioning has no "
                         "'reference' latents (B, C, H, W); give the data's reference latents")
    if reference.dim() != 4 or reference.shape[:2] != latents.shape[:2] or any(s % 2 for s in reference.shape[2:]):
        raise ValueError(f"the reference latents {tuple(reference.shape)} do not fit the latents "
                         f"{tuple(latents.shape)}: a reference image has the samples' count and latent channels and "
                         f"an even latent height and width")
    return reference


def image_shapes(latents: Tensor, reference: Tensor) -> list[list[tuple[int, int, int]]]:
    """The pipelines' ``img_shapes``: per sample the image's and the reference's token grids (1, h, w)."""
    grids = [(1, latents.shape[-2] // 2, latents.shape[-1] // 2), (1, reference.shape[-2] // 2,
                                                                   reference.shape[-1] // 2)]
    return [grids] * latents.shape[0]


def stream_lengths(img_shapes: list) -> tuple[int, int]:
    """(image tokens, reference tokens) of the transformer's ``img_shapes`` input: its first grid is the image's, the
    rest the reference images' (Edit Plus: several, back to back), as its RoPE and ``modulate_index`` read them."""
    grids = img_shapes[0]
    return prod(grids[0]), sum(prod(grid) for grid in grids[1:])


def _qwenimage_edit_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict) -> Tensor:
    """x (B, C, H, W) latents, t (B,) in 0..1000, cond: text (B, L, D) Qwen2.5-VL states padded to L, text_mask (B, L)
    True on real tokens, reference (B, C, H_ref, W_ref) the reference image's latents -> (B, C, H, W)."""
    reference = reference_latents(cond, x).to(x.dtype)
    height, width = x.shape[-2:]
    tokens = pack_latents(x)  # (B, S, 4C)
    out = transformer(
        hidden_states=torch.cat([tokens, pack_latents(reference)], dim=1),  # (B, S + S_ref, 4C), as the pipelines
        encoder_hidden_states=cond["text"], encoder_hidden_states_mask=cond["text_mask"], timestep=t / 1000,
        img_shapes=image_shapes(x, reference), guidance=cond.get("guidance"), return_dict=False,
    )[0]
    return unpack_latents(out[:, : tokens.shape[1]], height, width)  # the image's tokens: the pipelines' slice


def _edit_chat_template(base: Callable[[], ChatTemplate], name: str, pipeline: str) -> ChatTemplate:
    """``base`` (Qwen-Image's Qwen2.5-VL and its template) as the edit pipeline ``pipeline`` encodes a prompt: with its
    reference image (ringdit.media.edit_prompt reads the pipeline's own prompt string and crop from its code)."""
    return replace(base(), name=name, edit_pipeline=pipeline)


def edit_family(qwenimage: Family) -> Family:
    """Qwen-Image-Edit's family: QwenImage's (its geometry, text encoder recipe, scheduler, LoRA names) with the
    reference packed after the image tokens."""
    base = qwenimage.plan
    return replace(
        qwenimage,
        name="qwenimage_edit",
        # prompt_template=qwenimage_edit / qwenimage_edit_plus: each caption with its reference image, as
        # QwenImageEditPipeline / QwenImageEditPlusPipeline (Qwen-Image-Edit-2509 / 2511) encode it
        chat_template=functools.partial(_edit_chat_template, qwenimage.chat_template, "qwenimage_edit",
                                        "QwenImageEditPipeline"),
        chat_variants={"qwenimage_edit_plus": functools.partial(
            _edit_chat_template, qwenimage.chat_template, "qwenimage_edit_plus", "QwenImageEditPlusPipeline")},
        plan=replace(
            base,
            # Qwen-Image-Edit-2511's per-token modulation index (B, S + S_ref), handed whole to every block (by name,
            # or positionally by diffusers' own gradient checkpointing)
            split_inputs={**base.split_inputs, "transformer_blocks.*": {"modulate_index": 1, 6: 1}},
            packed=PackedStreams(streams=(REFERENCE,), module="", key="img_shapes", lengths=stream_lengths),
            attention_streams={"transformer_blocks.*.attn": (TEXT, TOKENS, REFERENCE)},
        ),
        forward=_qwenimage_edit_forward,
        condition_keys=("text", "text_mask", REFERENCE),
        # the reference's tokens join the image's in every block: ringdit prepares and samples it at the image's
        # size, so as many as the image's grid
        stream_tokens=lambda config, grid: {REFERENCE: prod(grid)},
        image_condition="reference",  # infer.py image= and the server's image give the reference (as first frames)
        # QwenImage's TeaCache probe reads one modulation per sample; Qwen-Image-Edit-2511 modulates per token, and
        # no coefficients are published for the edit models: cache=teacache is refused
        teacache_input=None,
        teacache_coefficients={},
    )
