"""The exponential moving average of the weights that training keeps (the weights worth sampling).

Only what trains is averaged: every weight in a full fine-tune, the adapters under LoRA. ``ModelAverage`` holds a copy
of those and *shares* everything else with the model (frozen weights, buffers), so a LoRA run's EMA costs the
adapters, not a second base model. Under FSDP the copies are made from the sharded parameters, so each rank averages
its own shards, on the model's mesh.

The average is never run as a model of its own: to sample, ``applied_to(model)`` swaps its weights into the model
and back (one parameter at a time, so it needs one parameter's worth of extra memory). Its state dict is the model's
(``module.<name>`` for every weight and buffer, ``n_averaged``), as ``torch.optim.swa_utils.AveragedModel`` wrote it:
checkpoints and exports keep their layout.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

Tensor = torch.Tensor


def ema_weight(decay: float, n_averaged: int) -> float:
    """How far one update moves the average towards the model: the decay ramps up as (1 + n) / (10 + n) before
    reaching ``decay``, so early weights are not frozen into a long average of the random init."""
    return 1 - min(decay, (1 + n_averaged) / (10 + n_averaged))


class ModelAverage(nn.Module):
    """The EMA of ``model``'s trainable weights; ``update_parameters(model)`` after each optimizer step."""

    def __init__(self, model: nn.Module, decay: float):
        super().__init__()
        self.decay = decay
        self.trained = [name for name, param in model.named_parameters() if param.requires_grad]
        trained = set(self.trained)
        named = [(name, nn.Parameter(param.detach().clone(), requires_grad=False) if name in trained else param)
                 for name, param in model.named_parameters(remove_duplicate=False)]
        transient = {f"{prefix}.{name}".lstrip(".") for prefix, module in model.named_modules()
                     for name in module._non_persistent_buffers_set}  # not saved by the model: not by its average
        self.module = _tree(named, list(model.named_buffers(remove_duplicate=False)), transient)
        self.register_buffer("n_averaged", torch.tensor(0, dtype=torch.long))

    def averaged(self) -> dict[str, Tensor]:
        """The averaged weights by name (the model's names)."""
        return {name: self.module.get_parameter(name) for name in self.trained}

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """Move the average towards ``model``'s weights: one fused lerp per step (the first update copies them)."""
        current = _sharded_parameters(model)
        pairs = [(_local(average), _local(current[name])) for name, average in self.averaged().items()]
        if pairs:
            if int(self.n_averaged) == 0:
                torch._foreach_copy_([a for a, _ in pairs], [c for _, c in pairs])
            else:
                torch._foreach_lerp_([a for a, _ in pairs], [c for _, c in pairs],
                                     ema_weight(self.decay, int(self.n_averaged)))
        self.n_averaged += 1

    @contextlib.contextmanager
    def applied_to(self, model: nn.Module) -> Iterator[nn.Module]:
        """``model`` holding the averaged weights inside the block, its own again after it (also on an error)."""
        self._swap(model)
        try:
            yield model
        finally:
            self._swap(model)

    @torch.no_grad()
    def _swap(self, model: nn.Module) -> None:
        current = _sharded_parameters(model)
        for name, average in self.averaged().items():
            a, b = _local(average), _local(current[name])
            held = b.clone()
            b.copy_(a)
            a.copy_(held)


def _local(tensor: Tensor) -> Tensor:
    """This rank's values of ``tensor`` (the local shard of an FSDP DTensor), to update in place."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _sharded_parameters(model: nn.Module) -> dict[str, Tensor]:
    """``model``'s parameters by name, as FSDP shards them: FSDP keeps the root's all-gathered weights registered
    between no-grad forwards, so they are freed first (the next forward gathers the shards again, new or not)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return dict(model.named_parameters())


def _tree(parameters: list[tuple[str, Tensor]], buffers: list[tuple[str, Tensor]], transient: set[str]) -> nn.Module:
    """A module holding ``parameters`` and ``buffers`` at their dotted names (``blocks.0.attn.qkv.weight``), so its
    state dict has the model's keys."""
    root = nn.Module()

    def parent(name: str) -> tuple[nn.Module, str]:
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if part not in node._modules:
                node.add_module(part, nn.Module())
            node = node._modules[part]
        return node, leaf

    for name, param in parameters:
        node, leaf = parent(name)
        node.register_parameter(leaf, param)
    for name, buffer in buffers:
        node, leaf = parent(name)
        node.register_buffer(leaf, buffer, persistent=name not in transient)
    return root
