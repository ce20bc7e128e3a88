"""Apply a ``ParallelPlan`` to a diffusers transformer: attention routed to ringdit, tokens split and gathered.

Nothing of the diffusers model is rewritten. Its attention processors keep computing q/k/v, norms and RoPE and call
diffusers' ``dispatch_attention_fn(query, key, value, ...)`` with ``(B, S, H, D)`` tensors; while a planned
attention module runs, that call is answered by the module's ringdit attention (``USPAttention`` for
self-attention, local attention for cross-attention) instead of diffusers' kernel. Outside those modules the call
goes to diffusers as before, so an unplanned model in the same process is unaffected.

The split/gather boundary is made of forward hooks that call ``shard_sequence`` / ``gather_sequence``, whose
autograd follows ringdit's convention (the objective is the sum of the ranks' losses): see
``ringdit.parallel.collectives``.
"""

from __future__ import annotations

import contextvars
import sys
from fnmatch import fnmatchcase
from typing import Any, Callable

import torch
from torch import nn

from ringdit.attention import AttentionBackend, USPAttention, get_attn_backend, local_attention
from ringdit.models.diffusers.plan import Key, ParallelPlan
from ringdit.parallel import current_parallel_dims, gather_sequence, shard_sequence

Tensor = torch.Tensor
Attend = Callable[[Tensor, Tensor, Tensor, "float | None"], Tensor]

# The ringdit attention of the planned module that is running now (None: let diffusers attend).
_active_attention: contextvars.ContextVar[Attend | None] = contextvars.ContextVar("ringdit_attention", default=None)


class SequenceState:
    """The global token count of the forward in flight: fixed by the first split, read by self-attention (the tail
    padding beyond it gets no attention weight) and by the gather. Reset when the model's forward starts; kept after
    it, because activation checkpointing recomputes blocks during backward."""

    def __init__(self):
        self.length: int | None = None

    def record(self, length: int) -> None:
        if self.length is None:
            self.length = length
        elif self.length != length:
            raise ValueError(f"a planned split saw {length} tokens after another saw {self.length}: the plan's split "
                             f"points must carry the same token sequence")


def parallelize(model: nn.Module, plan: ParallelPlan, backend: str | AttentionBackend | None = None) -> SequenceState:
    """Attach ``plan`` to ``model`` in place (idempotent per model); returns the model's ``SequenceState``.

    The USPAttention layers are built here, so the ring-capability check of the backend runs at construction.
    """
    if hasattr(model, "_ringdit_sequence"):
        return model._ringdit_sequence
    backend = backend if isinstance(backend, AttentionBackend) else get_attn_backend(backend)
    state = SequenceState()
    model._ringdit_sequence = state
    model.register_forward_pre_hook(lambda module, args: setattr(state, "length", None))

    self_attention = _matching(model, plan.self_attention, "self_attention")
    for name, module in self_attention.items():
        module.usp_attention = USPAttention(module.heads, _head_dim(module), backend=backend)
        _route(module, _sharded_attention(module.usp_attention, state))
    for name, module in _matching(model, plan.cross_attention, "cross_attention").items():
        if name in self_attention:
            raise ValueError(f"plan names {name} as both self- and cross-attention")
        _route(module, _local_attention(backend))

    for name, module in _matching(model, plan.split_inputs, "split_inputs").items():
        module.register_forward_pre_hook(_split_inputs_hook(plan.split_inputs[_pattern_of(name, plan.split_inputs)],
                                                            state), with_kwargs=True)
    for table, transform in ((plan.split_outputs, _shard), (plan.gather_outputs, _gather)):
        for name, module in _matching(model, table, "outputs").items():
            module.register_forward_hook(_outputs_hook(table[_pattern_of(name, table)], state, transform))
    return state


# ---- attention routing -------------------------------------------------------------------------------------------


def _sharded_attention(attention: USPAttention, state: SequenceState) -> Attend:
    def attend(query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
        _check_scale(scale, attention.softmax_scale)
        sharded = current_parallel_dims().sp_degree > 1
        return attention(query, key, value, valid_len=state.length if sharded else None)  # (B, S_local, H, D)

    return attend


def _local_attention(backend: AttentionBackend) -> Attend:
    def attend(query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
        return local_attention(backend, query, key, value, softmax_scale=scale)  # replicated keys: no communication

    return attend


def _check_scale(scale: float | None, expected: float) -> None:
    if scale is not None and abs(scale - expected) > 1e-12 * expected:
        raise ValueError(f"the model asks for softmax scale {scale}, the USPAttention layer was built for {expected}")


def _route(module: nn.Module, attend: Attend) -> None:
    """While ``module`` runs, its processor's ``dispatch_attention_fn`` calls go to ``attend``."""
    _install_router(type(module.processor).__module__)
    tokens: list[contextvars.Token] = []
    module.register_forward_pre_hook(lambda m, args: tokens.append(_active_attention.set(attend)))
    module.register_forward_hook(lambda m, args, out: _active_attention.reset(tokens.pop()), always_call=True)


def _install_router(processor_module: str) -> None:
    """Point the processor module's ``dispatch_attention_fn`` at the router (once per module)."""
    namespace = sys.modules[processor_module]
    original = getattr(namespace, "dispatch_attention_fn", None)
    if original is None:
        raise TypeError(f"{processor_module} does not call diffusers' dispatch_attention_fn; its attention cannot "
                        f"be routed to ringdit (write a plan for a processor that does)")
    if getattr(original, "_ringdit_router", False):
        return

    def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              *args, **kwargs):
        attend = _active_attention.get()
        if attend is None:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale, *args, **kwargs)
        if attn_mask is not None or dropout_p or is_causal:
            raise NotImplementedError("ringdit attention takes no attention mask, dropout or causal masking here")
        return attend(query, key, value, scale)

    dispatch_attention_fn._ringdit_router = True
    namespace.dispatch_attention_fn = dispatch_attention_fn


def _head_dim(module: nn.Module) -> int:
    return module.to_q.out_features // module.heads


# ---- split / gather ----------------------------------------------------------------------------------------------


def _shard(value: Tensor, dim: int, state: SequenceState) -> Tensor:
    state.record(value.shape[dim])
    return shard_sequence(value, dim=dim)


def _gather(value: Tensor, dim: int, state: SequenceState) -> Tensor:
    if current_parallel_dims().sp_degree == 1:
        return value
    return gather_sequence(value, dim=dim, length=state.length)


def _split_inputs_hook(keys: dict[Key, int], state: SequenceState):
    def hook(module, args, kwargs):
        args = list(args)
        for key, dim in keys.items():
            if isinstance(key, int) and key < len(args):
                args[key] = _shard(args[key], dim, state)
            elif isinstance(key, str) and kwargs.get(key) is not None:
                kwargs[key] = _shard(kwargs[key], dim, state)
        return tuple(args), kwargs

    return hook


def _outputs_hook(keys: dict[Key, int], state: SequenceState, transform):
    def hook(module, args, output):
        if None in keys:
            return transform(output, keys[None], state)
        output = list(output)
        for key, dim in keys.items():
            output[key] = transform(output[key], dim, state)
        return tuple(output)

    return hook


def _matching(model: nn.Module, patterns, what: str) -> dict[str, nn.Module]:
    """The modules whose names match any pattern; a pattern that matches nothing is a stale plan."""
    modules = dict(model.named_modules())
    found: dict[str, nn.Module] = {}
    for pattern in patterns:
        hits = {name: module for name, module in modules.items() if fnmatchcase(name, pattern)}
        if not hits:
            raise ValueError(f"the parallel plan's {what} pattern {pattern!r} matches no module of "
                             f"{type(model).__name__}: the plan does not fit this model")
        found.update(hits)
    return found


def _pattern_of(name: str, table: dict[str, Any]) -> str:
    return next(pattern for pattern in table if fnmatchcase(name, pattern))
