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
from functools import partial
from typing import Any

import torch
from torch import nn

from ringdit.attention import AttentionBackend, USPAttention, get_attn_backend, local_attention
from ringdit.models.diffusers.plan import Key, ParallelPlan
from ringdit.parallel import ParallelDims, gather_sequence, shard_sequence

Tensor = torch.Tensor

# The planned attention module that is running now (None: let diffusers attend).
_active_module: contextvars.ContextVar[nn.Module | None] = contextvars.ContextVar("ringdit_attention", default=None)


class SequenceState:
    """The mesh the split and gather run over (``dims``), and the global token count of the forward in flight: fixed
    by the first split, read by self-attention (the tail padding beyond it gets no attention weight) and by the
    gather. The count is reset when the model's forward starts and kept after it, because activation checkpointing
    recomputes blocks during backward."""

    def __init__(self, dims: ParallelDims):
        self.dims = dims
        self.length: int | None = None
        self.text_length = 0  # joint attention: the replicated text tokens leading the sequence
        self.text_mask: Tensor | None = None  # (B, text_length) bool, True on real tokens

    def record(self, length: int) -> None:
        if self.length is None:
            self.length = length
        elif self.length != length:
            raise ValueError(f"a planned split saw {length} tokens after another saw {self.length}: the plan's split "
                             f"points must carry the same token sequence")


def parallelize(model: nn.Module, plan: ParallelPlan, backend: str | AttentionBackend | None = None,
                dims: ParallelDims | None = None) -> SequenceState:
    """Attach ``plan`` to ``model`` in place (idempotent per model); returns the model's ``SequenceState``.

    The USPAttention layers are built here with ``dims``, so their checks (heads, ring-capable backend) run at
    construction; ``set_sequence_dims`` gives a parallelized model another mesh later. Hooks keep no references of
    their own: what they need hangs on the modules they are registered on, so a ``copy.deepcopy`` of the model (the
    EMA) is parallel on its own state.
    """
    if hasattr(model, "_ringdit_sequence"):
        return model._ringdit_sequence
    backend = backend if isinstance(backend, AttentionBackend) else get_attn_backend(backend)
    dims = dims or ParallelDims()
    state = SequenceState(dims)
    model._ringdit_sequence = state
    model.register_forward_pre_hook(_start_sequence)

    self_attention = _matching(model, plan.self_attention, "self_attention")
    joint_attention = _matching(model, plan.joint_attention, "joint_attention")
    cross_attention = _matching(model, plan.cross_attention, "cross_attention")
    for name in (self_attention.keys() | joint_attention.keys()) & cross_attention.keys():
        raise ValueError(f"the parallel plan names {name} as both sharded and cross-attention")
    for name, module in {**self_attention, **joint_attention}.items():
        _route(module, USPAttention(module.heads, _head_dim(module), backend=backend, dims=dims), state)
        module._ringdit_joint = name in joint_attention
    for module in cross_attention.values():
        _route(module, LocalAttention(backend), state)
    if joint_attention and plan.text_prefix is None:
        raise ValueError("a plan with joint_attention must name its text_prefix input")
    if plan.text_prefix is not None:
        name, key, dim = plan.text_prefix
        for module in _matching(model, (name,), "text_prefix").values():
            module._ringdit_sequence = state
            module.register_forward_pre_hook(partial(_record_text, key, dim, plan.text_mask), with_kwargs=True)

    for name, module in _matching(model, plan.split_inputs, "split_inputs").items():
        module._ringdit_sequence = state
        module.register_forward_pre_hook(partial(_split_inputs, plan.split_inputs[_pattern_of(name, plan.split_inputs)]),
                                         with_kwargs=True)
    for table, transform in ((plan.split_outputs, _shard), (plan.gather_outputs, _gather)):
        for name, module in _matching(model, table, "outputs").items():
            module._ringdit_sequence = state
            module.register_forward_hook(partial(_transform_outputs, table[_pattern_of(name, table)], transform))
    return state


def set_sequence_dims(model: nn.Module, dims: ParallelDims) -> None:
    """Run the parallelized ``model``'s split and gather over ``dims`` (its attention layers take them from
    ``ringdit.parallel.set_parallel_dims``, which calls this through ``DiffusersTransformer``)."""
    model._ringdit_sequence.dims = dims


def _start_sequence(model: nn.Module, args) -> None:
    model._ringdit_sequence.length = None


# ---- attention routing -------------------------------------------------------------------------------------------


class LocalAttention(nn.Module):
    """Attention over keys every rank holds whole (cross-attention to text): no communication."""

    def __init__(self, backend: AttentionBackend):
        super().__init__()
        self.backend = backend

    def forward(self, query: Tensor, key: Tensor, value: Tensor, *, softmax_scale: float | None = None) -> Tensor:
        return local_attention(self.backend, query, key, value, softmax_scale=softmax_scale)


def _attend(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, scale: float | None,
            attn_mask: Tensor | None = None) -> Tensor:
    """``module``'s ringdit attention of ``(B, S, H, D)`` tensors (the sequence dim sharded for self-attention)."""
    attention = module.ringdit_attention
    state = module._ringdit_sequence
    joint = getattr(module, "_ringdit_joint", False)
    text_mask = _text_mask_of(attn_mask, state.text_length) if joint and attn_mask is not None else state.text_mask
    if attn_mask is not None and not joint:
        raise NotImplementedError(f"{type(module).__name__} passes an attention mask; ringdit takes masks only on "
                                  f"the text keys of joint attention (plan it as joint_attention)")
    if isinstance(attention, LocalAttention):
        return attention(query, key, value, softmax_scale=scale)
    _check_scale(scale, attention.softmax_scale)
    sharded = state.dims.sp_degree > 1
    if joint:  # [text ; image]: the text replicated, the image sharded
        return attention(query, key, value, valid_len=state.length if sharded else None,
                         joint_prefix=state.text_length, prefix_mask=text_mask)
    return attention(query, key, value, valid_len=state.length if sharded else None)


def _text_mask_of(attn_mask: Tensor, text_length: int) -> Tensor | None:
    """A joint attention's key mask ``(B, 1, 1, text + image)`` (QwenImage's) as the text keys' mask ``(B, text)``:
    the image keys must all be attended (their padding is ringdit's, handled by ``valid_len``)."""
    keys = attn_mask.reshape(attn_mask.shape[0], -1)
    if attn_mask.dtype != torch.bool or keys.shape[1] != attn_mask.shape[-1]:
        raise NotImplementedError("ringdit takes a joint attention mask only as a boolean key mask (B, 1, 1, keys)")
    if not bool(keys[:, text_length:].all()):
        raise NotImplementedError("ringdit takes masks on the text keys only; this model masks image keys")
    text_mask = keys[:, :text_length]
    return None if bool(text_mask.all()) else text_mask


def _check_scale(scale: float | None, expected: float) -> None:
    if scale is not None and abs(scale - expected) > 1e-12 * expected:
        raise ValueError(f"the model asks for softmax scale {scale}, the USPAttention layer was built for {expected}")


def _route(module: nn.Module, attention: nn.Module, state: SequenceState) -> None:
    """While ``module`` runs, its processor's ``dispatch_attention_fn`` calls go to ``attention``."""
    _install_router(type(module.processor).__module__)
    module.ringdit_attention = attention
    module._ringdit_sequence = state
    module._ringdit_tokens = []
    module.register_forward_pre_hook(_enter_attention)
    module.register_forward_hook(_leave_attention, always_call=True)


def _enter_attention(module: nn.Module, args) -> None:
    module._ringdit_tokens.append(_active_module.set(module))


def _leave_attention(module: nn.Module, args, output) -> None:
    _active_module.reset(module._ringdit_tokens.pop())


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
        module = _active_module.get()
        if module is None:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale, *args, **kwargs)
        if dropout_p or is_causal:
            raise NotImplementedError("ringdit attention takes no dropout or causal masking")
        return _attend(module, query, key, value, scale, attn_mask)

    dispatch_attention_fn._ringdit_router = True
    namespace.dispatch_attention_fn = dispatch_attention_fn


def _head_dim(module: nn.Module) -> int:
    return module.to_q.out_features // module.heads


# ---- split / gather ----------------------------------------------------------------------------------------------


def _shard(value: Tensor, dim: int, state: SequenceState) -> Tensor:
    state.record(value.shape[dim])
    return shard_sequence(value, dim=dim, dims=state.dims)


def _gather(value: Tensor, dim: int, state: SequenceState) -> Tensor:
    if state.dims.sp_degree == 1:
        return value
    return gather_sequence(value, dim=dim, length=state.length, dims=state.dims)


def _input(args: tuple, kwargs: dict, key: Key):
    if isinstance(key, int):
        return args[key] if key < len(args) else None
    return kwargs.get(key)


def _record_text(key: Key, dim: int, mask: tuple[str, Key] | None, module: nn.Module, args: tuple, kwargs: dict):
    """Remember how many replicated text tokens lead the joint sequence (and which are real) in this forward."""
    state = module._ringdit_sequence
    state.text_length = _input(args, kwargs, key).shape[dim]
    state.text_mask = None
    if mask is not None and _input(args, kwargs, mask[1]) is not None:
        state.text_mask = _input(args, kwargs, mask[1]).bool()
        if bool(state.text_mask.all()):  # all real: the unmasked path needs no per-sample work
            state.text_mask = None


def _split_inputs(keys: dict[Key, int], module: nn.Module, args: tuple, kwargs: dict):
    args = list(args)
    for key, dim in keys.items():
        if isinstance(key, int) and key < len(args):
            args[key] = _shard(args[key], dim, module._ringdit_sequence)
        elif isinstance(key, str) and kwargs.get(key) is not None:
            kwargs[key] = _shard(kwargs[key], dim, module._ringdit_sequence)
    return tuple(args), kwargs


def _transform_outputs(keys: dict[Key, int], transform, module: nn.Module, args, output):
    state = module._ringdit_sequence
    if None in keys:
        return transform(output, keys[None], state)
    output = list(output)
    for key, dim in keys.items():
        output[key] = transform(output[key], dim, state)
    return tuple(output)


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
