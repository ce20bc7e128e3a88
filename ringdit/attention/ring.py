"""Ring attention: exact attention over a sequence split across the ranks of a ring.

Each rank keeps its query block and passes its K/V block (one stacked buffer) to the next rank, N-1 times, so every
query block meets every K/V block once. Per-hop results are merged with the softmax log-sum-exp (LSE) in fp32.
The next hop's transfer is posted before the current hop is computed, so communication overlaps compute.

Backward re-rotates K/V the same way and sends an fp32 dK/dV accumulator along with it: after N hops each
accumulator has visited every rank and arrives back at the rank that owns the block. Every hop calls the backend's
``backward_ring_kv_chunk`` with the FINAL merged out and lse, which is what makes the chunk gradients add up exactly.

Which keys are real (``layout``, a ``ringdit.attention.token_layout.TokenLayout``): each stream of the sequence (the
tokens; or text and image for joint attention, each sharded) may be padded at its tail, and text may carry a key
mask. Padded and masked keys get no attention weight: hops whose K/V block has no real key are skipped, the others
are cut to their real keys (a view for one contiguous run), so the kernels never see an empty or masked block.
Padded query rows return zeros and get zero gradients.

Forward mode (``jvp``: ``torch.func.jvp``, ``torch.autograd.forward_ad``) rotates ``[k, v, dk, dv]`` the same way and
calls the backend's ``jvp_ring_kv_chunk`` with the FINAL lse: each hop's share ``(P dv + (P * dS) v, rowsum(P * dS))``
is already weighted by the log-sum-exp weight of its block (``P = exp(S - lse)``), so the shares add up, and the
tangent is ``sum(partial) - sum(rowsum) * out`` (derivation: docs/concepts.md).

(The forward, backward and jvp share their hop loop, and are easiest to check side by side.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringdit.attention.backend import (
    AttentionBackend,
    Tensor,
    accumulation_dtype,
    attention_tangent,
    check_forward_ad_capable,
    zero_tangents,
)
from ringdit.attention.token_layout import TokenLayout, add_at, is_empty, take
from ringdit.parallel.mesh import ParallelDims

# Separate tags keep the K/V and dK/dV streams apart on backends that match messages by tag (gloo).
_KV_TAG, _DKV_TAG = 0, 1


class RingExchange:
    """Hops of the ring: send a buffer to the next rank while receiving the previous rank's into a fresh one.

    ``start`` posts the transfer and returns the (not yet filled) receive buffer; ``wait`` completes it. Both
    buffers are held here while in flight: the caller may drop its references to the one it sent.
    """

    def __init__(self, dims: ParallelDims):
        self.group = dims.ring_group
        self.send_to = dims.ring_ranks[(dims.ring_rank + 1) % dims.ring_degree]
        self.recv_from = dims.ring_ranks[(dims.ring_rank - 1) % dims.ring_degree]
        self._pending: dict[int, tuple[list, Tensor, Tensor]] = {}

    def start(self, buffer: Tensor, tag: int) -> Tensor:
        received = torch.empty_like(buffer)
        ops = [
            dist.P2POp(dist.isend, buffer, self.send_to, self.group, tag),
            dist.P2POp(dist.irecv, received, self.recv_from, self.group, tag),
        ]
        self._pending[tag] = (dist.batch_isend_irecv(ops), buffer, received)
        return received

    def wait(self, tag: int) -> None:
        requests, _sent, _received = self._pending.pop(tag)
        for request in requests:
            request.wait()


def merge_attention_chunk(out: Tensor, lse: Tensor, chunk_out: Tensor, chunk_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial softmax attentions over disjoint key sets; returns the merged ``(out, lse)``.

    ``out, chunk_out: (B, S, H, D)``, ``lse, chunk_lse: (B, H, S)``, both in the accumulation dtype. Stays finite
    when an LSE is -inf (no keys seen yet): the weights are taken against a finite reference.
    """
    merged = out.clone()
    merged_lse = merge_attention_chunk_(merged, lse.clone(), chunk_out, chunk_lse)
    return merged, merged_lse


def merge_attention_chunk_(out: Tensor, lse: Tensor, chunk_out: Tensor, chunk_lse: Tensor) -> Tensor:
    """In-place ``merge_attention_chunk`` on ``out`` and ``lse`` (views allowed): no full-size temporaries."""
    new_lse = torch.logaddexp(lse, chunk_lse)
    reference = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
    weight_old = torch.exp(lse - reference).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    weight_new = torch.exp(chunk_lse - reference).transpose(1, 2).unsqueeze(-1)
    out.mul_(weight_old).addcmul_(chunk_out, weight_new)
    lse.copy_(new_lse)
    return lse


class RingAttentionFunction(torch.autograd.Function):
    """Ring attention of this rank's block ``q, k, v: (B, L, H, D)`` -> ``(out (B, L, H, D), lse)``; ``lse`` is not
    differentiable. ``forward`` and ``setup_context`` are separate so that ``torch.func`` transforms can run it
    (``torch.func.jvp`` needs that form); call it through ``ring_attention``."""

    @staticmethod
    def forward(q, k, v, backend: AttentionBackend, softmax_scale, dims: ParallelDims, layout):
        # Statistics and merges in fp32 even under autocast (backward runs outside autocast and must agree).
        with torch.autocast(q.device.type, enabled=False):
            return _ring_forward(q, k, v, backend, softmax_scale, dims, layout)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, backend, softmax_scale, dims, layout = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        # k and v rather than the stacked copy: the caller keeps them anyway, the copy would double them.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.save_for_forward(q, k, v, out, lse)
        ctx.backend, ctx.softmax_scale, ctx.dims, ctx.layout = backend, softmax_scale, dims, layout

    @staticmethod
    def backward(ctx, dout, _dlse):
        with torch.autocast(dout.device.type, enabled=False):  # also when backward is called inside autocast
            dq, dk, dv = _ring_backward(ctx, dout, *ctx.saved_tensors)
        return dq, dk, dv, None, None, None, None

    @staticmethod
    def jvp(ctx, dq, dk, dv, *_non_tensor_tangents):
        q, k, v, out, lse = ctx.saved_tensors
        check_forward_ad_capable(ctx.backend)
        # no_grad: the tangent is a constant to reverse mode (the received K/V tangents carry no graph anyway);
        # sCM's JVP term is under a stop-gradient. See docs/concepts.md.
        with torch.autocast(q.device.type, enabled=False), torch.no_grad():
            return _ring_tangent(ctx, q, k, v, out, lse, *zero_tangents((q, k, v), (dq, dk, dv))), None


def _blocks(dims: ParallelDims, layout: TokenLayout | None, step: int):
    """The ring block held at ``step`` (ring rank ``(ring_rank - step) % R``) and its real keys: the block of ring
    rank j is the chunks of its Ulysses group, ``j * U .. j * U + U - 1`` (sp_rank = ring_rank * U + ulysses_rank)."""
    block = (dims.ring_rank - step) % dims.ring_degree
    return None if layout is None else layout.keys(block * dims.ulysses_degree, dims.ulysses_degree)


def _query_rows(dims: ParallelDims, layout: TokenLayout | None) -> Tensor | None:
    """This rank's real query rows (None: all real)."""
    if layout is None:
        return None
    return layout.real_rows(dims.ring_rank * dims.ulysses_degree, dims.ulysses_degree)


def _ring_forward(q, k, v, backend, softmax_scale, dims: ParallelDims, layout):
    """The forward hops; returns ``(out, lse)`` (padded query rows: zeros)."""
    batch, block_len, heads, head_size = q.shape
    ring_size = dims.ring_degree
    exchange = RingExchange(dims)
    acc = accumulation_dtype(q.dtype)

    out = q.new_zeros(batch, block_len, heads, head_size, dtype=acc)
    lse = q.new_full((batch, heads, block_len), float("-inf"), dtype=acc)
    kv = torch.stack([k, v])  # (2, B, L, H, D): one message per hop
    for step in range(ring_size):
        if step + 1 < ring_size:
            next_kv = exchange.start(kv, _KV_TAG)
        keys = _blocks(dims, layout, step)
        if not is_empty(keys):
            _attend_hop(backend, softmax_scale, q, kv, out, lse, keys)
        if step + 1 < ring_size:
            exchange.wait(_KV_TAG)
            kv = next_kv
    rows = _query_rows(dims, layout)
    if rows is not None:
        out[:, ~rows] = 0  # padded query rows: zeros (their lse stays: backward gives them no gradient)
    return out.to(q.dtype), lse


def _ring_backward(ctx, dout, q, k, v, out, lse):
    """The backward hops; returns ``dq, dk, dv`` of this rank's block."""
    dims, layout, backend, scale = ctx.dims, ctx.layout, ctx.backend, ctx.softmax_scale
    ring_size = dims.ring_degree
    exchange = RingExchange(dims)
    dout = dout.contiguous()
    rows = _query_rows(dims, layout)
    if rows is not None:
        dout = dout.masked_fill(~rows[None, :, None, None], 0)  # padded query rows send no gradient

    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros_like(q, dtype=acc)
    # dkv: the fp32 gradient accumulator of the K/V block held this hop; it travels with the block.
    dkv = q.new_zeros((2, *q.shape), dtype=acc)  # (2, B, L, H, D)
    kv = torch.stack([k, v])
    for step in range(ring_size):
        if step + 1 < ring_size:
            next_kv = exchange.start(kv, _KV_TAG)
        keys = _blocks(dims, layout, step)
        # the hop's kernel runs while this block's accumulator is still on its way from the previous rank
        shares = [] if is_empty(keys) else _grad_hop(backend, scale, dout, q, kv, out, lse, dq, keys)
        if step > 0:
            exchange.wait(_DKV_TAG)  # the accumulator that arrived belongs to this hop's block
        for sample, sample_keys, dk_chunk, dv_chunk in shares:
            add_at(dkv[0, sample], sample_keys, dk_chunk, 1)
            add_at(dkv[1, sample], sample_keys, dv_chunk, 1)
        if ring_size > 1:
            dkv = exchange.start(dkv, _DKV_TAG)
        if step + 1 < ring_size:
            exchange.wait(_KV_TAG)
            kv = next_kv
    if ring_size > 1:
        exchange.wait(_DKV_TAG)  # after N sends, our own block's accumulator is back
    dk, dv = dkv.to(q.dtype).unbind(0)
    return dq.to(q.dtype), dk, dv


def _ring_tangent(ctx, q, k, v, out, lse, dq, dk, dv):
    """The jvp hops: ``[k, v, dk, dv]`` rotate as one message; returns the tangent of this rank's ``out``."""
    dims, layout, backend, scale = ctx.dims, ctx.layout, ctx.backend, ctx.softmax_scale
    ring_size = dims.ring_degree
    exchange = RingExchange(dims)
    acc = accumulation_dtype(q.dtype)
    partial = torch.zeros_like(q, dtype=acc)
    rowsum = q.new_zeros(lse.shape, dtype=acc)
    kv = torch.stack([k, v, dk.to(k.dtype), dv.to(v.dtype)])  # (4, B, L, H, D): one message per hop
    for step in range(ring_size):
        if step + 1 < ring_size:
            next_kv = exchange.start(kv, _KV_TAG)
        keys = _blocks(dims, layout, step)
        if not is_empty(keys):
            _tangent_hop(backend, scale, q, dq, kv, lse, partial, rowsum, keys)
        if step + 1 < ring_size:
            exchange.wait(_KV_TAG)
            kv = next_kv
    tangent = attention_tangent(partial, rowsum, out)
    rows = _query_rows(dims, layout)
    if rows is not None:
        tangent[:, ~rows] = 0  # padded query rows are zeros, so is their tangent
    return tangent.to(out.dtype)


def _tangent_hop(backend, softmax_scale, q, dq, kv, lse, partial, rowsum, keys) -> None:
    """Add one K/V block's share of the tangent into the accumulators ``partial`` and ``rowsum`` in place."""
    if isinstance(keys, list):  # samples differ (masked text): one kernel call per sample
        for b, sample_keys in enumerate(keys):
            if not is_empty(sample_keys):
                s = slice(b, b + 1)
                _tangent_hop(backend, softmax_scale, q[s], dq[s], kv[:, s], lse[s], partial[s], rowsum[s], sample_keys)
        return
    k, v, dk, dv = (take(t, keys, 1) for t in kv.unbind(0))
    chunk_partial, chunk_rowsum = backend.jvp_ring_kv_chunk(q, k, v, dq, dk, dv, lse, softmax_scale=softmax_scale)
    partial += chunk_partial
    rowsum += chunk_rowsum


def _attend_hop(backend, softmax_scale, q, kv, out, lse, keys) -> None:
    """Attend ``q`` to the real keys of one K/V block and merge into ``out``/``lse`` in place."""
    if isinstance(keys, list):  # samples differ (masked text): one kernel call per sample
        for b, sample_keys in enumerate(keys):
            if not is_empty(sample_keys):
                sample = slice(b, b + 1)
                _attend_hop(backend, softmax_scale, q[sample], kv[:, sample], out[sample], lse[sample], sample_keys)
        return
    chunk_out, chunk_lse = backend.forward_ring_kv_chunk(
        q, take(kv[0], keys, 1), take(kv[1], keys, 1), softmax_scale=softmax_scale
    )
    merge_attention_chunk_(out, lse, chunk_out, chunk_lse)


def _grad_hop(backend, softmax_scale, dout, q, kv, out, lse, dq, keys, sample=slice(None)) -> list:
    """Add one K/V block's share of dQ into the fp32 accumulator ``dq``; returns its dK/dV shares as ``[(samples,
    keys, dk_chunk, dv_chunk)]``, for the caller to add into the block's accumulator once it has arrived (masked
    and padded keys get none)."""
    if isinstance(keys, list):  # samples differ (masked text): one kernel call per sample
        shares = []
        for b, sample_keys in enumerate(keys):
            if not is_empty(sample_keys):
                s = slice(b, b + 1)
                shares += _grad_hop(backend, softmax_scale, dout[s], q[s], kv[:, s], out[s], lse[s], dq[s],
                                    sample_keys, s)
        return shares
    dq_chunk, dk_chunk, dv_chunk = backend.backward_ring_kv_chunk(
        dout, q, take(kv[0], keys, 1), take(kv[1], keys, 1), out, lse, softmax_scale=softmax_scale
    )
    dq += dq_chunk
    return [(sample, keys, dk_chunk, dv_chunk)]


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    backend: AttentionBackend,
    dims: ParallelDims,
    *,
    softmax_scale: float | None = None,
    layout: TokenLayout | None = None,
) -> Tensor:
    """Attention of this rank's query block ``(B, L, H, D)`` to the K/V blocks of every rank of its ring.

    Ring rank j holds the chunks of its Ulysses group (``L = U * chunk`` tokens); ``layout`` says which of them are
    real keys and rows (None: all of them).
    """
    return RingAttentionFunction.apply(q, k, v, backend, softmax_scale, dims, layout)[0]
