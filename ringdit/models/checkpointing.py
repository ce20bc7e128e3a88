"""Activation checkpointing of the repeated blocks: all, none, or a selection (torchtitan's selective AC by layer).

``model.activation_checkpointing`` takes
- ``true`` / ``false``: every block / none;
- a fraction in [0, 1] (``0.5``): that share of each block list, spread evenly -- block i is checkpointed when
  ceil((i + 1) x f) > ceil(i x f), so 0.5 takes blocks 0, 2, 4 ..., and ceil(f x L) blocks in all;
- ``every_N`` (``every_2``): blocks 0, N, 2N ... (torchtitan's ``selective_ac_option=N``): the fraction 1 / N.

A checkpointed block keeps only its inputs for backward and runs its forward again there; the others keep every
activation. Checkpointing fewer blocks trades memory for less recomputation: with half the blocks, about half the
activation memory of none and half the extra forward of all.

``model.activation_offload=true`` moves what the checkpointed blocks keep -- their inputs -- to pinned CPU memory
during forward and back before their recomputation (``torch.autograd.graph.save_on_cpu`` around the checkpoint:
the checkpoint saves its inputs through it, its own recomputation stays on the device). It is for CUDA: on CPU ranks
the activations already live in host memory, so it is ignored there (a warning at start-up says so) rather than
copying tensors within the same memory.

Each block's ``forward`` is replaced on the instance (hooks, FSDP's included, stay outside the checkpoint, as with
torchtitan's checkpoint wrapper), so parameter names and state dicts do not change.
"""

from __future__ import annotations

import math
import re
import types

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint

from ringdit.common.errors import ConfigError
from ringdit.models.parallelize import _matching

PERIOD = re.compile(r"every_(\d+)")


def checkpoint_fraction(setting) -> float:
    """The share of the blocks ``model.activation_checkpointing`` checkpoints (module docstring); a ConfigError for
    anything else."""
    if setting is None or isinstance(setting, bool):
        return float(bool(setting))
    if isinstance(setting, (int, float)) and math.isfinite(setting) and 0 <= setting <= 1:
        return float(setting)
    period = PERIOD.fullmatch(setting) if isinstance(setting, str) else None
    if period and int(period.group(1)) >= 1:
        return 1 / int(period.group(1))
    raise ConfigError(f"model.activation_checkpointing must be true, false, a fraction of the blocks in [0, 1] "
                      f"(e.g. 0.5) or every_N (e.g. every_2: every second block), got {setting!r}")


def checkpointed_blocks(count: int, setting) -> list[bool]:
    """Which of ``count`` blocks are checkpointed under ``setting``: evenly spread, the first one included."""
    fraction = checkpoint_fraction(setting)
    return [math.ceil((i + 1) * fraction - 1e-9) > math.ceil(i * fraction - 1e-9) for i in range(count)]


def apply_activation_checkpointing(blocks: list[nn.Module], setting, offload: bool = False) -> None:
    """Checkpoint the blocks of one block list (a model's ``blocks``, or one expert's) that ``setting`` selects;
    ``offload``: their kept inputs in pinned CPU memory (CUDA only)."""
    for block, chosen in zip(blocks, checkpointed_blocks(len(blocks), setting)):
        if chosen:
            block.forward = types.MethodType(_offloaded_forward if offload else _checkpointed_forward, block)


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    own = type(self).forward
    if not torch.is_grad_enabled():  # sampling: nothing is kept for backward anyway
        return own(self, *args, **kwargs)
    return checkpoint(own, self, *args, use_reentrant=False, **kwargs)


# where offloading acts: CUDA (a test adds "cpu" to run the same code, unpinned, on CPU ranks)
OFFLOAD_DEVICES = ("cuda",)


def _offloaded_forward(self: nn.Module, *args, **kwargs):
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None or first.device.type not in OFFLOAD_DEVICES or not torch.is_grad_enabled():
        return _checkpointed_forward(self, *args, **kwargs)  # CPU: the activations are in host memory already
    with save_on_cpu(pin_memory=first.is_cuda):  # the checkpoint saves its inputs through this; see the docstring
        return _checkpointed_forward(self, *args, **kwargs)


def checkpoint_model_blocks(model: nn.Module, setting, offload: bool = False) -> None:
    """``apply_activation_checkpointing`` to each block list of ``model``'s parallel plan (a DiT's ``blocks``; Flux's
    dual- and single-stream lists; each expert's)."""
    if checkpoint_fraction(setting) > 0:
        for blocks in _matching(model, model.parallel_plan.blocks, "blocks").values():
            apply_activation_checkpointing(list(blocks), setting, offload)
