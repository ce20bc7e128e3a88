"""The exponential moving average of the weights that training keeps (the weights worth sampling)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

Tensor = torch.Tensor


def ema_update(decay: float) -> Callable:
    """AveragedModel's ``multi_avg_fn`` for an EMA whose decay ramps up as (1 + n) / (10 + n) before reaching
    ``decay`` (early weights are not frozen into a long average of the random init); one fused update per step."""

    def update(averaged: list[Tensor], current: list[Tensor], num_averaged: Tensor) -> None:
        n = int(num_averaged)
        floats = [(a, c) for a, c in zip(averaged, current) if a.is_floating_point()]
        weight = 1 - min(decay, (1 + n) / (10 + n))
        for sharded in (False, True):  # under FSDP parameters are DTensors, buffers plain: one fused update each
            group = [(a, c) for a, c in floats if hasattr(a, "to_local") == sharded]
            if group:
                torch._foreach_lerp_([a for a, _ in group], [c for _, c in group], weight)
        for a, c in zip(averaged, current):  # integer and bool buffers (a text mask) are copied, not averaged
            if not a.is_floating_point():
                a.copy_(c)

    return update


def averaged_copy(model: nn.Module, decay: float) -> AveragedModel:
    """A frozen copy of ``model`` (parallelized like it: a deepcopy shares the mesh) that ``update_parameters``
    moves towards the model's weights."""
    ema = AveragedModel(model, multi_avg_fn=ema_update(decay), use_buffers=True)
    ema.requires_grad_(False)
    return ema
