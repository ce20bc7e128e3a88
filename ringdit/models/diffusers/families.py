"""The diffusers model families ringdit runs sequence-parallel: one ``Family`` each, holding its ``ParallelPlan``.

To add a family (QwenImage, HunyuanVideo, LTX, ...):

1. Read the transformer's ``forward``: find the module whose input first carries the patch tokens
   (``split_inputs``), the module that turns per-position RoPE into per-token rotations (``split_outputs``), and
   the output projection (``gather_outputs``); list the attention modules over the tokens (``self_attention``) and
   those whose keys are text only (``cross_attention``). Its processors must call ``dispatch_attention_fn``.
2. Write ``forward(transformer, x, t, cond)``: how ringdit's ``(B, C, [T,] H, W)`` latents, model time (0..1000)
   and conditioning dict map onto the diffusers call, returning the prediction shaped like ``x``.
3. Register it in ``FAMILIES`` and add a ``conf/model/<family>*.yaml`` preset; the exactness test
   (``tests/test_diffusers_models.py``) then compares it with the unmodified model on one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ringdit.models.diffusers.plan import ParallelPlan

Tensor = torch.Tensor


@dataclass(frozen=True)
class Family:
    name: str
    model_class: str  # the diffusers class, e.g. "WanTransformer3DModel"
    plan: ParallelPlan
    forward: Callable[[nn.Module, Tensor, Tensor, dict], Tensor]
    video: bool  # latents (B, C, T, H, W) rather than (B, C, H, W)
    condition_keys: tuple[str, ...]  # the conditioning tensors the model reads (data=text_latents provides them)


def _wan_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict) -> Tensor:
    """x (B, C, T, H, W) latents, t (B,) in 0..1000 (Wan's sigma x 1000), cond["text"] (B, L, D_text) UMT5 states
    zero-padded to L (Wan attends to the padding as it was trained: no mask)."""
    return transformer(hidden_states=x, timestep=t, encoder_hidden_states=cond["text"], return_dict=False)[0]


WAN = Family(
    name="wan",
    model_class="WanTransformer3DModel",
    plan=ParallelPlan(
        self_attention=("blocks.*.attn1",),
        cross_attention=("blocks.*.attn2",),
        split_inputs={"blocks.0": {0: 1, "hidden_states": 1}},  # (B, S, D) patch tokens
        split_outputs={"rope": {0: 1, 1: 1}},  # (cos, sin), each (1, S, 1, head_dim)
        gather_outputs={"proj_out": {None: 1}},  # (B, S, patch_volume * C_out)
    ),
    forward=_wan_forward,
    video=True,
    condition_keys=("text",),
)

FAMILIES: dict[str, Family] = {family.name: family for family in (WAN,)}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model.family={name!r} is not a supported diffusers family; choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]
