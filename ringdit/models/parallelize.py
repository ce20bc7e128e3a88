"""``parallelize(model, plan, dims, backend)``: apply a ``ParallelPlan`` to a single-device model, in place.

Nothing of the model is rewritten. Its attention modules keep computing q/k/v, norms and RoPE; what they attend with
is answered by a ``PlannedAttention`` (``USPAttention`` over the sharded sequence for self- and joint attention, local
attention for cross-attention). A module reaches it in one of two ways:

- a ringdit model's attention calls its ``inner_attention`` submodule (torchtitan's name): the plan replaces it;
- a diffusers processor calls diffusers' ``dispatch_attention_fn(query, key, value, ...)``: while a planned module
  runs, that call is answered by the module's ``PlannedAttention`` instead of diffusers' kernel. Outside those
  modules the call goes to diffusers as before, so an unplanned model in the same process is unaffected.

The split/gather boundary is made of forward hooks that call ``shard_sequence`` / ``gather_sequence``, whose
autograd follows ringdit's convention (the objective is the sum of the ranks' losses): see
``ringdit.parallel.collectives``. With one process (``ParallelDims()``) the hooks pass tensors through and the
attention is the backend's local attention: a parallelized model is the same model on any layout.
"""

from __future__ import annotations

import contextvars
import sys
from fnmatch import fnmatchcase
from functools import partial

import torch
from torch import nn

from ringdit.attention import AttentionBackend, LocalAttention, Stream, TokenLayout, USPAttention, get_attn_backend
from ringdit.models.parallel_plan import TEXT, TOKENS, Key, ParallelPlan
from ringdit.parallel import ParallelDims, gather_sequence, shard_sequence
from ringdit.parallel.collectives import chunk_length

Tensor = torch.Tensor

# The planned diffusers attention module that is running now (None: let diffusers attend).
_active_module: contextvars.ContextVar[nn.Module | None] = contextvars.ContextVar("ringdit_attention", default=None)


class SequenceState:
    """The mesh the split and gather run over (``dims``), and what one forward's sequence is: the global length of
    each stream (``TOKENS``, ``TEXT``, a plan's further streams), fixed by its first split, and each stream's key mask
    where the plan records one. From them ``layout`` tells attention which tokens of every rank's chunk are real. All
    of it is reset when the model's forward starts and kept after it, because activation checkpointing recomputes
    blocks during backward."""

    def __init__(self, dims: ParallelDims, packed: tuple[str, ...] = ()):
        self.dims = dims
        self.packed = packed  # the streams in the tokens' tensors, the tokens first (a plan's ``packed``); (): none
        self.reset()

    def reset(self) -> None:
        self.lengths: dict[str, int] = {}
        self.masks: dict[str, Tensor | None] = {}  # (B, L) bool, True on real keys; None: recorded, none given
        self.packed_lengths: tuple[int, ...] | None = None  # this forward's lengths of the packed streams
        self._layouts: dict[tuple[str, ...], TokenLayout | None] = {}

    @property
    def length(self) -> int | None:
        """The global token count of the forward in flight (None before the first split)."""
        return self.lengths.get(TOKENS)

    def record(self, length: int, stream: str = TOKENS) -> None:
        if stream not in self.lengths:
            self.lengths[stream] = length
            self._layouts.clear()
        elif self.lengths[stream] != length:
            raise ValueError(f"a planned {stream} split saw {length} tokens after another saw {self.lengths[stream]}: "
                             f"the plan's {stream} split points must carry the same sequence")

    def record_packed(self, lengths: tuple[int, ...]) -> None:
        """The lengths of the streams packed in the tokens' tensors (``packed``'s order), read as the forward starts."""
        if len(lengths) != len(self.packed):
            raise ValueError(f"the plan's packed lengths gave {len(lengths)} lengths for the streams {list(self.packed)}")
        self.packed_lengths = tuple(int(length) for length in lengths)
        for stream, length in zip(self.packed, self.packed_lengths):
            self.record(length, stream)

    def record_mask(self, stream: str, mask: Tensor | None) -> None:
        """Keep a stream's whole key mask, the first time this forward sees it: attention reads every rank's part."""
        if stream not in self.masks:
            self.masks[stream] = None if mask is None else mask.bool()
            self._layouts.clear()

    def layout(self, streams: tuple[str, ...]) -> TokenLayout | None:
        """Which tokens of every rank's chunk are real, for a sequence of ``streams`` in chunk order (the tokens for
        self-attention; text and tokens for joint attention). None when every token is here and real."""
        if streams not in self._layouts:
            self._layouts[streams] = self._build_layout(streams)
        return self._layouts[streams]

    def _build_layout(self, streams: tuple[str, ...]) -> TokenLayout | None:
        ranks = self.dims.sp_degree
        if not any(stream in self.lengths for stream in streams):
            return None  # no split ran: every token is here
        for stream in streams:
            if stream not in self.lengths:
                raise ValueError(f"an attention over the streams {list(streams)} ran before any {stream} split: the "
                                 f"plan must cut the {stream} stream before its first attention module runs")
        masks = [self.masks.get(stream) for stream in streams]
        if ranks == 1 and all(mask is None for mask in masks):
            return None  # every token here and real: plain attention (no mask reading inside compiled graphs)
        return TokenLayout([Stream(self.lengths[stream], chunk_length(self.lengths[stream], ranks), mask)
                            for stream, mask in zip(streams, masks)])

    def __deepcopy__(self, memo) -> SequenceState:
        # A copy of the model (the EMA) runs its own forwards: its own counts, over the same mesh (never copied).
        copy = SequenceState(self.dims, self.packed)
        memo[id(self)] = copy
        return copy


def parallelize(model: nn.Module, plan: ParallelPlan | None = None, dims: ParallelDims | None = None,
                backend: str | AttentionBackend | None = None) -> nn.Module:
    """Attach ``plan`` (default: ``model.parallel_plan``) to ``model`` over the mesh ``dims`` (default: one process)
    with attention ``backend``; returns ``model``. Once per model.

    The USPAttention layers are built here, with ``dims``, so their checks (a head for every Ulysses rank, a
    ring-capable backend) run now. Hooks keep no references of their own: what they need hangs on the modules they
    are registered on, so a ``copy.deepcopy`` of the model (the EMA) is parallel on its own state.
    """
    if getattr(model, "_ringdit_sequence", None) is not None:  # KindDefaults' None: not parallelized yet
        raise ValueError(f"{type(model).__name__} is parallelized already; parallelize a freshly built model")
    plan = model.parallel_plan if plan is None else plan
    backend = backend if isinstance(backend, AttentionBackend) else get_attn_backend(backend)
    state = SequenceState(dims or ParallelDims(), () if plan.packed is None else (TOKENS, *plan.packed.streams))
    model._ringdit_sequence = state
    model.register_forward_pre_hook(_start_sequence)
    streams = plan.stream_plans()
    if plan.packed is not None:  # registered after _start_sequence: the model's own lengths survive its reset
        for module in _matching(model, (plan.packed.module,), "packed").values():
            module._ringdit_sequence = state
            module.register_forward_pre_hook(partial(_record_packed, plan.packed.key, plan.packed.lengths),
                                             with_kwargs=True)

    self_attention = _matching(model, plan.self_attention, "self_attention")
    joint_attention = _matching(model, plan.joint_attention, "joint_attention")
    cross_attention = _matching(model, plan.cross_attention, "cross_attention")
    stream_cross = _matching(model, plan.stream_cross_attention, "stream_cross_attention")
    for name in (self_attention.keys() | joint_attention.keys()) & (cross_attention.keys() | stream_cross.keys()):
        raise ValueError(f"the parallel plan names {name} as both sharded and cross-attention")
    for name, module in {**self_attention, **joint_attention}.items():
        heads, head_dim = _attention_shape(module)
        usp = USPAttention(heads, head_dim, backend=backend, dims=state.dims)
        _route(module, PlannedAttention(usp, state, streams=_streams_of(plan, name, name in joint_attention,
                                                                        streams)))
    for name, module in {**cross_attention, **stream_cross}.items():  # keys replicated, or a sharded stream's
        key_stream = _stream_of(plan.stream_cross_attention, name, streams)
        _route(module, PlannedAttention(LocalAttention(backend), state, key_stream=key_stream))
    if joint_attention and not plan.text_inputs and any(
            TEXT in _streams_of(plan, name, True, streams) for name in joint_attention):
        raise ValueError("a plan with joint_attention must name the inputs that carry its text (text_inputs)")
    for stream, stream_plan in streams.items():  # registered first: a mask is read whole, before a split cuts it
        if stream_plan.mask is not None:
            name, key = stream_plan.mask
            for module in _matching(model, (name,), f"{stream} mask").values():
                module._ringdit_sequence = state
                module.register_forward_pre_hook(partial(_record_mask, stream, key), with_kwargs=True)
    for stream, stream_plan in streams.items():
        for name, module in _matching(model, stream_plan.inputs, "inputs").items():
            module._ringdit_sequence = state
            module.register_forward_pre_hook(partial(_split_inputs, _keys_of(name, stream_plan.inputs), stream),
                                             with_kwargs=True)
    for table, transform in ([(plan.outputs, partial(_shard, stream=stream)) for stream, plan in streams.items()]
                             + [(plan.gather, partial(_gather, stream=stream)) for stream, plan in streams.items()]):
        for name, module in _matching(model, table, "outputs").items():
            module._ringdit_sequence = state
            module.register_forward_hook(partial(_transform_outputs, _keys_of(name, table), transform))
    return model


def _streams_of(plan: ParallelPlan, name: str, joint: bool, streams: dict) -> tuple[str, ...]:
    """The streams of the sequence the attention module ``name`` attends over (``plan.attention_streams``)."""
    order = next((tuple(names) for pattern, names in plan.attention_streams.items() if name_matches(name, pattern)),
                 plan.default_streams(joint))
    for stream in order:
        if stream not in streams:
            raise ValueError(f"the parallel plan's attention_streams name the stream {stream!r} for {name}, which "
                             f"it does not describe; its streams: {sorted(streams)}")
    return order


def _stream_of(table: dict[str, str], name: str, streams: dict) -> str | None:
    """The sharded stream whose keys the cross-attention module ``name`` attends to; None: replicated keys."""
    stream = next((stream for pattern, stream in table.items() if name_matches(name, pattern)), None)
    if stream is not None and stream not in streams:
        raise ValueError(f"the parallel plan's stream_cross_attention names the stream {stream!r} for {name}, which "
                         f"it does not describe; its streams: {sorted(streams)}")
    return stream


def repeated_blocks(model: nn.Module, plan: ParallelPlan | None = None) -> list[nn.Module]:
    """The transformer blocks of the plan's ``blocks`` lists (default plan: ``model.parallel_plan``), in order."""
    plan = model.parallel_plan if plan is None else plan
    lists = _matching(model, plan.blocks, "blocks")
    blocks = [block for blocks in lists.values() for block in blocks]
    if not blocks:
        raise ValueError(f"the parallel plan of {type(model).__name__} names no repeated blocks (plan.blocks)")
    return blocks


def _start_sequence(model: nn.Module, args) -> None:
    model._ringdit_sequence.reset()


# ---- attention ---------------------------------------------------------------------------------------------------


class PlannedAttention(nn.Module):
    """A planned module's attention of ``(B, S, H, D)`` tensors, the sequence dim sharded: ``USPAttention`` over the
    sequence of ``streams`` (self- and joint attention: their global lengths, padding and masks), or local attention
    to keys every rank holds whole (cross-attention to text) or gathers (``key_stream``: a sharded stream's keys)."""

    def __init__(self, attention: USPAttention | LocalAttention, state: SequenceState, *,
                 streams: tuple[str, ...] = (), key_stream: str | None = None):
        super().__init__()
        self.attention, self.streams, self.key_stream = attention, tuple(streams), key_stream
        self._ringdit_sequence = state

    def forward(self, query: Tensor, key: Tensor, value: Tensor, *, softmax_scale: float | None = None,
                attn_mask: Tensor | None = None) -> Tensor:
        attention, state = self.attention, self._ringdit_sequence
        if isinstance(attention, LocalAttention):
            if self.key_stream is not None:
                return self._attend_stream(query, key, value, softmax_scale, attn_mask)
            key_mask = None if attn_mask is None else cross_attention_key_mask(attn_mask, key.shape[1])
            return attention(query, key, value, softmax_scale=softmax_scale, key_mask=key_mask)
        if attn_mask is not None and len(self.streams) == 1:
            raise NotImplementedError("this attention passes an attention mask; ringdit takes masks only on the text "
                                      "keys of joint attention (plan it as joint_attention)")
        _check_scale(softmax_scale, attention.softmax_scale)
        layout = state.layout(self.streams)
        if attn_mask is not None:
            _check_key_mask(attn_mask, self.streams, layout, query.shape[1])
        return attention(query, key, value, layout=layout)

    def keep_communication_eager(self) -> None:
        """Before ``torch.compile``: the gather of a sharded stream's keys runs eagerly, outside compiled graphs, as
        ``USPAttention.keep_communication_eager`` keeps its transfers."""
        self._attend_stream = torch.compiler.disable(self._attend_stream)

    def _attend_stream(self, query: Tensor, key: Tensor, value: Tensor, softmax_scale: float | None,
                       attn_mask: Tensor | None) -> Tensor:
        """Cross-attention from this rank's queries to every rank's keys of ``key_stream`` (B, L_local, H, D): the
        keys and values are gathered (their gradients reduce-scattered back), the stream's padding dropped and its
        recorded mask applied."""
        if attn_mask is not None:
            raise NotImplementedError(f"this cross-attention to the sharded {self.key_stream} stream passes an "
                                      f"attention mask; name the stream's mask in the plan (StreamPlan.mask) instead")
        state = self._ringdit_sequence
        length = state.lengths.get(self.key_stream)
        if length is None:
            raise ValueError(f"a cross-attention to the {self.key_stream} stream ran before any {self.key_stream} "
                             f"split: the plan must cut that stream before the attention runs")
        key, value = (gather_sequence(x, dim=1, length=length, dims=state.dims) for x in (key, value))
        return self.attention(query, key, value, softmax_scale=softmax_scale,
                              key_mask=state.masks.get(self.key_stream))


def _check_key_mask(attn_mask: Tensor, streams: tuple[str, ...], layout: TokenLayout | None, length: int) -> None:
    """A joint attention's own key mask ``(B, 1, 1, keys)`` (QwenImage builds one from its text mask) must mask only
    keys of streams whose mask the plan records (the text's ``text_mask``): the ring reads every rank's mask from
    there.

    A full ``(B, 1, S, S)`` mask (HunyuanVideo 1.5's) is taken when it is the key mask's outer product with itself:
    a masked token is then a masked key that also attends to nothing, and such a (text) query row's output reaches
    no other token, so letting it attend normally changes no prediction."""
    square = attn_mask.dim() == 4 and attn_mask.shape[1] == 1 and attn_mask.shape[2] > 1
    keys = _square_key_mask(attn_mask[:, 0]) if square else attn_mask.reshape(attn_mask.shape[0], -1)  # (B, keys)
    if attn_mask.dtype != torch.bool or keys.shape[1] != attn_mask.shape[-1] or keys.shape[1] != length:
        raise NotImplementedError(f"ringdit takes a joint attention mask only as a boolean key mask (B, 1, 1, keys) "
                                  f"or its square (B, 1, keys, keys), over the {length} keys; this model passes "
                                  f"{attn_mask.dtype} {tuple(attn_mask.shape)}")
    if layout is None:
        return
    start = 0
    for name, stream in zip(streams, layout.streams):
        part, start = keys[:, start : start + stream.chunk], start + stream.chunk
        if stream.mask is None and not bool(part.all()):
            if name == TOKENS:  # the patch tokens are never masked in a plan (their padding is the cut's own)
                raise NotImplementedError("ringdit takes masks on the text keys (and a plan's further streams) only; "
                                          "this model masks image keys")
            fix = "text_mask" if name == TEXT else f"the {name} stream's mask"
            raise NotImplementedError(f"this model masks {name} keys, whose mask the parallel plan does not record; "
                                      f"name the input that carries it in the plan's {fix}")


def _square_key_mask(square: Tensor) -> Tensor:
    """The key mask ``(B, S)`` whose outer product with itself is ``square`` (B, S, S); NotImplementedError if none."""
    if square.dtype != torch.bool or square.shape[1] != square.shape[2]:
        raise NotImplementedError(f"ringdit takes a (B, 1, queries, keys) attention mask only as a boolean outer "
                                  f"product of a key mask with itself; this model passes {square.dtype} "
                                  f"{tuple(square.shape)}")
    keys = square.diagonal(dim1=1, dim2=2)  # (B, S): token i is real where it may attend to itself
    if not torch.equal(square, keys[:, :, None] & keys[:, None, :]):
        raise NotImplementedError("this model's (B, 1, S, S) attention mask is not the outer product of a key mask "
                                  "with itself (mask[i, j] = real[i] & real[j]); ringdit takes masks on keys only")
    return keys


# an additive bias at or below this is a masked key: its softmax weight exp(bias + logit - max) is 0 in fp32 / fp64
# for any logits models produce (LTX: -10000; bf16 rounds that to -9984)
MASKED_BIAS = -1000.0


def cross_attention_key_mask(attn_mask: Tensor, keys: int) -> Tensor:
    """A cross-attention's mask ``(B or 1, [heads, queries,] keys)`` as the per-sample key mask ``(B or 1, keys)``
    bool (True: attend) that ``LocalAttention`` takes. Boolean masks, and float additive biases that are 0 or a large
    negative per key (LTX's -10000 on padded text keys, ``(B, heads, 1, L)``), are key masks when they are the same
    for every head and query: then dropping the masked keys is what the mask does, without a dense ``(S, L)`` bias.
    A sample whose keys are all masked attends to all of them: a bias that is the same on every key does not change
    a softmax (diffusers' kernels do the same)."""
    if attn_mask.dim() < 2 or attn_mask.shape[-1] != keys:
        raise NotImplementedError(f"a cross-attention mask of shape {tuple(attn_mask.shape)} is not a key mask "
                                  f"(B, ..., {keys}); ringdit takes masks over the text keys only")
    rows = attn_mask.reshape(attn_mask.shape[0], -1, keys)  # (B, heads x queries, L)
    real = rows if attn_mask.dtype == torch.bool else rows == 0
    if attn_mask.dtype != torch.bool and not bool((real | (rows <= MASKED_BIAS)).all()):
        raise NotImplementedError(f"this cross-attention passes a float bias with values other than 0 and "
                                  f"<= {MASKED_BIAS:g} (min {rows.min().item():g}, max {rows.max().item():g}): a "
                                  f"soft bias, not a key mask; ringdit takes key masks only")
    if not bool((real == real[:, :1]).all()):
        raise NotImplementedError("this cross-attention's mask differs between heads or queries: ringdit takes a "
                                  "mask only as a per-sample key mask, the same for every head and query")
    mask = real[:, 0]  # (B or 1, L)
    return mask | ~mask.any(dim=1, keepdim=True)  # a sample with no real key: all of them


def _check_scale(scale: float | None, expected: float) -> None:
    if scale is not None and abs(scale - expected) > 1e-12 * expected:
        raise ValueError(f"the model asks for softmax scale {scale}, the USPAttention layer was built for {expected}")


def _attention_shape(module: nn.Module) -> tuple[int, int]:
    """(heads, head size) of a ringdit attention module (``num_heads``, ``head_dim``) or a diffusers one."""
    if hasattr(module, "num_heads") and hasattr(module, "head_dim"):
        return module.num_heads, module.head_dim
    if not hasattr(module, "to_q"):  # q, k, v in one fused projection (Flux.2's single-stream to_qkv_mlp_proj)
        return module.heads, module.head_dim
    return module.heads, module.to_q.out_features // module.heads


def _route(module: nn.Module, attention: PlannedAttention) -> None:
    """Make ``attention`` what ``module`` attends with."""
    if isinstance(getattr(module, "inner_attention", None), nn.Module):  # a ringdit model: swap the kernel module
        module.inner_attention = attention
        return
    if not hasattr(module, "processor"):
        raise TypeError(f"{type(module).__name__} has neither an inner_attention module nor a diffusers processor: "
                        f"the plan cannot route its attention")
    _install_router(type(module.processor).__module__)
    module.ringdit_attention = attention
    module._ringdit_tokens = []
    module.register_forward_pre_hook(_enter_attention)
    module.register_forward_hook(_leave_attention, always_call=True)


def _enter_attention(module: nn.Module, args) -> None:
    module._ringdit_tokens.append(_active_module.set(module))


def _leave_attention(module: nn.Module, args, output) -> None:
    _active_module.reset(module._ringdit_tokens.pop())


def _install_router(processor_module: str) -> None:
    """Point a diffusers processor module's ``dispatch_attention_fn`` at the router (once per module)."""
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
        return module.ringdit_attention(query, key, value, softmax_scale=scale, attn_mask=attn_mask)

    dispatch_attention_fn._ringdit_router = True
    namespace.dispatch_attention_fn = dispatch_attention_fn


# ---- split / gather ----------------------------------------------------------------------------------------------


def _shard(value: Tensor, dim: int, state: SequenceState, stream: str = TOKENS) -> Tensor:
    if stream == TOKENS and state.packed:
        parts = value.split(_packed_lengths(value, dim, state), dim=dim)
        return torch.cat([shard_sequence(part, dim=dim, dims=state.dims) for part in parts], dim=dim)
    state.record(value.shape[dim], stream)
    return shard_sequence(value, dim=dim, dims=state.dims)


def _gather(value: Tensor, dim: int, state: SequenceState, stream: str = TOKENS) -> Tensor:
    if state.dims.sp_degree == 1:
        return value
    if stream == TOKENS and state.packed:  # (.., [tokens chunk ; each packed stream's chunk], ..): each on its own
        lengths = state.packed_lengths
        parts = value.split([chunk_length(length, state.dims.sp_degree) for length in lengths], dim=dim)
        return torch.cat([gather_sequence(part, dim=dim, length=length, dims=state.dims)
                          for part, length in zip(parts, lengths)], dim=dim)
    return gather_sequence(value, dim=dim, length=state.lengths.get(stream), dims=state.dims)


def _packed_lengths(value: Tensor, dim: int, state: SequenceState) -> tuple[int, ...]:
    """The lengths of the packed streams in ``value``'s dim ``dim``, checked against its size."""
    lengths = state.packed_lengths
    if lengths is None:
        raise ValueError(f"a planned tokens split ran before the lengths of the streams packed with the tokens "
                         f"({list(state.packed)}) were read: the plan's packed module must run first")
    if value.shape[dim] != sum(lengths):
        raise ValueError(f"a planned tokens split saw {value.shape[dim]} tokens, but the streams packed there "
                         f"({list(state.packed)}) hold {list(lengths)} = {sum(lengths)}: the plan's packed lengths "
                         f"do not describe this input")
    return lengths


def _record_packed(key: Key, lengths, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Read the lengths of the streams packed with the tokens from the module's input ``key``."""
    module._ringdit_sequence.record_packed(lengths(_input(args, kwargs, key)))


def _input(args: tuple, kwargs: dict, key: Key):
    if isinstance(key, int):
        return args[key] if key < len(args) else None
    return kwargs.get(key)


def _record_mask(stream: str, key: Key, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Keep the whole key mask of ``stream`` in this forward (the first time it is seen)."""
    module._ringdit_sequence.record_mask(stream, _input(args, kwargs, key))


def _split_inputs(keys: dict[Key, int], stream: str, module: nn.Module, args: tuple, kwargs: dict):
    """Cut the planned inputs to this rank's chunk. An input without the sequence dim in this forward stays whole:
    a per-sample value (Wan's timestep (B,)) where the model also takes a per-token one (Wan 2.2's (B, S))."""
    args = list(args)
    for key, dim in keys.items():
        if isinstance(key, int) and key < len(args) and _has_dim(args[key], dim):
            args[key] = _shard(args[key], dim, module._ringdit_sequence, stream)
        elif isinstance(key, str) and _has_dim(kwargs.get(key), dim):
            kwargs[key] = _shard(kwargs[key], dim, module._ringdit_sequence, stream)
    return tuple(args), kwargs


def _has_dim(value, dim: int) -> bool:
    """``value`` is a tensor with dim ``dim`` (a negative one counts from the end: ``-2`` is the token dim of both
    ``(S, 4)`` and ``(B, S, 4)`` position ids)."""
    return isinstance(value, Tensor) and (value.dim() > dim if dim >= 0 else value.dim() >= -dim)


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
        hits = {name: module for name, module in modules.items() if name_matches(name, pattern)}
        if not hits:
            raise ValueError(f"the parallel plan's {what} pattern {pattern!r} matches no module of "
                             f"{type(model).__name__}: the plan does not fit this model")
        found.update(hits)
    return found


def _keys_of(name: str, table: dict[str, dict[Key, int]]) -> dict[Key, int]:
    """The keys of every pattern of ``table`` that matches ``name``, merged."""
    return {key: dim for pattern, keys in table.items() if name_matches(name, pattern) for key, dim in keys.items()}


def name_matches(name: str, pattern: str) -> bool:
    """``fnmatch`` per dotted part: ``*`` stands for one name (``blocks.*`` is every block, not their submodules)."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatchcase(part, want) for part, want in zip(parts, wanted))
