"""Ring attention: exact attention over a sequence split across the ranks of a ring.

Each rank keeps its query block and passes its K/V block (one stacked buffer) to the next rank, N-1 times, so every
query block meets every K/V block once. Per-hop results are merged with the softmax log-sum-exp (LSE) in fp32.
The next hop's transfer is posted before the current hop is computed, so communication overlaps compute.

Backward re-rotates K/V the same way and sends an fp32 dK/dV accumulator along with it: after N hops each
accumulator has visited every rank and arrives back at the rank that owns the block. Every hop calls the backend's
``backward_ring_kv_chunk`` with the FINAL merged out and lse, which is what makes the chunk gradients add up exactly.

Padding: the global sequence may be padded at its tail (``valid_len`` real tokens). Query rows beyond it return zeros
(and get zero gradients), padded keys get no attention weight: hops whose K/V block is all padding are skipped and
partly padded blocks are cut to their real prefix (the kernels never see an empty or masked block).

Joint text-image attention (``JointRingAttentionFunction``): a replicated text prefix rides along without rotating;
its K/V are one extra local chunk merged by LSE, forward and backward (see ringdit.attention.joint).

(303 lines: the forward and backward of both autograd functions share their hop loop, and are easiest to check side
by side.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringdit.attention.backend import AttentionBackend, Tensor, accumulation_dtype
from ringdit.attention.joint import prefix_chunk_backward, prefix_chunk_forward
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


def real_tokens_in_block(block: int, block_len: int, valid_len: int | None) -> int:
    """How many of block ``block``'s ``block_len`` tokens lie before ``valid_len`` (the rest is tail padding)."""
    if valid_len is None:
        return block_len
    return max(0, min(block_len, valid_len - block * block_len))


class RingAttentionFunction(torch.autograd.Function):
    """Ring attention of this rank's block ``q, k, v: (B, L, H, D)`` -> ``out (B, L, H, D)``."""

    @staticmethod
    def forward(ctx, q, k, v, backend: AttentionBackend, softmax_scale, dims: ParallelDims, valid_len):
        # Statistics and merges in fp32 even under autocast (backward runs outside autocast and must agree).
        with torch.autocast(q.device.type, enabled=False):
            out, lse, _, _ = _ring_forward(q, k, v, None, backend, softmax_scale, dims, valid_len)
        # k and v rather than the stacked copy: the caller keeps them anyway, the copy would double them.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.softmax_scale, ctx.dims, ctx.valid_len = backend, softmax_scale, dims, valid_len
        return out

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):  # also when backward is called inside autocast
            dq, dk, dv, _ = _ring_backward(ctx, dout, *ctx.saved_tensors)
        return dq, dk, dv, None, None, None, None


@dataclass
class ReplicatedText:
    """The replicated text prefix of joint attention on this rank: ``q, k, v (B, P, h, D)``, the same on every rank
    of the ring, and ``keys``, each sample's real text positions (None: all real). See ringdit.attention.joint."""

    q: Tensor
    k: Tensor
    v: Tensor
    keys: list[Tensor] | None = None


class JointRingAttentionFunction(torch.autograd.Function):
    """Ring attention over ``[text ; image]``: the image blocks ``q, k, v (B, L, h, D)`` rotate, the replicated
    text ``q_text, k_text, v_text (B, P, h, D)`` stays local as one extra K/V chunk that every query meets once.

    Returns ``(out (B, L, h, D), out_text (B, P, h, D))``; ``out_text`` is bit-identical on every rank of the ring.
    """

    @staticmethod
    def forward(ctx, q, k, v, q_text, k_text, v_text, backend, softmax_scale, dims, valid_len, text_keys):
        text = ReplicatedText(q_text, k_text, v_text, text_keys)
        with torch.autocast(q.device.type, enabled=False):
            out, lse, text_out, text_lse = _ring_forward(q, k, v, text, backend, softmax_scale, dims, valid_len)
        ctx.save_for_backward(q, k, v, out, lse, q_text, k_text, v_text, text_out, text_lse)
        ctx.backend, ctx.softmax_scale, ctx.dims, ctx.valid_len = backend, softmax_scale, dims, valid_len
        ctx.text_keys = text_keys
        return out, text_out

    @staticmethod
    def backward(ctx, dout, dout_text):
        q, k, v, out, lse, q_text, k_text, v_text, text_out, text_lse = ctx.saved_tensors
        text = ReplicatedText(q_text, k_text, v_text, ctx.text_keys)
        with torch.autocast(dout.device.type, enabled=False):
            dq, dk, dv, text_grads = _ring_backward(
                ctx, dout, q, k, v, out, lse, text, dout_text.contiguous(), text_out, text_lse
            )
        return dq, dk, dv, *text_grads, None, None, None, None, None


def _ring_forward(q, k, v, text: ReplicatedText | None, backend, softmax_scale, dims: ParallelDims, valid_len):
    """The forward hops; returns ``(out, lse)`` of the image rows and ``(text_out, text_lse)`` (None without text)."""
    batch, block_len, heads, head_size = q.shape
    ring_size, ring_rank = dims.ring_degree, dims.ring_rank
    exchange = RingExchange(dims)
    acc = accumulation_dtype(q.dtype)
    n_q = real_tokens_in_block(ring_rank, block_len, valid_len)

    out = q.new_zeros(batch, block_len, heads, head_size, dtype=acc)
    lse = q.new_full((batch, heads, block_len), float("-inf"), dtype=acc)
    text_hops = {}  # image block index -> (out, lse) of the text queries against that block
    kv = torch.stack([k, v])  # (2, B, L, H, D): one message per hop
    for step in range(ring_size):
        if step + 1 < ring_size:
            next_kv = exchange.start(kv, _KV_TAG)
        block = (ring_rank - step) % ring_size
        n_k = real_tokens_in_block(block, block_len, valid_len)
        if n_q and n_k:
            _attend_hop(backend, softmax_scale, q[:, :n_q], kv[:, :, :n_k], out[:, :n_q], lse[:, :, :n_q])
        if text is not None and n_k:
            text_hops[block] = backend.forward_ring_kv_chunk(
                text.q, kv[0, :, :n_k], kv[1, :, :n_k], softmax_scale=softmax_scale
            )
        if step + 1 < ring_size:
            exchange.wait(_KV_TAG)
            kv = next_kv
    if text is None:
        return out.to(q.dtype), lse, None, None

    # The text K/V: a local chunk that never rotates, so every query meets it exactly once.
    if n_q:
        text_chunk = prefix_chunk_forward(backend, softmax_scale, q[:, :n_q], text.k, text.v, text.keys)
        merge_attention_chunk_(out[:, :n_q], lse[:, :, :n_q], *text_chunk)
    text_out = torch.zeros_like(text.q, dtype=acc)
    text_lse = q.new_full((batch, heads, text.q.shape[1]), float("-inf"), dtype=acc)
    merge_attention_chunk_(
        text_out, text_lse, *prefix_chunk_forward(backend, softmax_scale, text.q, text.k, text.v, text.keys)
    )
    # A fixed merge order (not the hop order, which differs per rank) gives the same bits on every rank.
    for block in sorted(text_hops):
        merge_attention_chunk_(text_out, text_lse, *text_hops[block])
    return out.to(q.dtype), lse, text_out.to(q.dtype), text_lse


def _ring_backward(ctx, dout, q, k, v, out, lse, text=None, dout_text=None, text_out=None, text_lse=None):
    """The backward hops; returns ``dq, dk, dv`` of the image block and the text's ``(dq, dk, dv)`` (or None)."""
    dims, valid_len, backend, scale = ctx.dims, ctx.valid_len, ctx.backend, ctx.softmax_scale
    ring_size, ring_rank = dims.ring_degree, dims.ring_rank
    block_len = q.shape[1]
    exchange = RingExchange(dims)
    n_q = real_tokens_in_block(ring_rank, block_len, valid_len)
    dout = dout.contiguous()

    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros_like(q, dtype=acc)
    # dkv: the fp32 gradient accumulator of the K/V block held this hop; it travels with the block.
    dkv = q.new_zeros((2, *q.shape), dtype=acc)  # (2, B, L, H, D)
    kv = torch.stack([k, v])
    if text is not None:
        dq_text = torch.zeros_like(text.q, dtype=acc)
        dkv_text = q.new_zeros((2, *text.k.shape), dtype=acc)  # (2, B, P, h, D): stays here, like the text K/V
    for step in range(ring_size):
        if step + 1 < ring_size:
            next_kv = exchange.start(kv, _KV_TAG)
        if step > 0:
            exchange.wait(_DKV_TAG)  # the accumulator that arrived belongs to this hop's block
        n_k = real_tokens_in_block((ring_rank - step) % ring_size, block_len, valid_len)
        if n_q and n_k:
            _grad_hop(
                backend, scale, dout[:, :n_q], q[:, :n_q], kv[:, :, :n_k], out[:, :n_q],
                lse[:, :, :n_q], dq[:, :n_q], dkv[:, :, :n_k],
            )
        if text is not None and n_k:
            _grad_hop(backend, scale, dout_text, text.q, kv[:, :, :n_k], text_out, text_lse, dq_text, dkv[:, :, :n_k])
        if ring_size > 1:
            dkv = exchange.start(dkv, _DKV_TAG)
        if step + 1 < ring_size:
            exchange.wait(_KV_TAG)
            kv = next_kv
    if ring_size > 1:
        exchange.wait(_DKV_TAG)  # after N sends, our own block's accumulator is back
    dk, dv = dkv.to(q.dtype).unbind(0)
    if text is None:
        return dq.to(q.dtype), dk, dv, None

    # The local text chunk, met once by this rank's image queries and once by its text queries.
    if n_q:
        _grad_text_chunk(
            backend, scale, dout[:, :n_q], q[:, :n_q], text, out[:, :n_q], lse[:, :, :n_q], dq[:, :n_q], dkv_text
        )
    _grad_text_chunk(backend, scale, dout_text, text.q, text, text_out, text_lse, dq_text, dkv_text)
    dk_text, dv_text = dkv_text.to(q.dtype).unbind(0)
    return dq.to(q.dtype), dk, dv, (dq_text.to(q.dtype), dk_text, dv_text)


def _attend_hop(backend, softmax_scale, q, kv, out, lse) -> None:
    """Attend ``q`` to one K/V block and merge into ``out``/``lse`` in place (temporaries die on return)."""
    chunk_out, chunk_lse = backend.forward_ring_kv_chunk(q, kv[0], kv[1], softmax_scale=softmax_scale)
    merge_attention_chunk_(out, lse, chunk_out, chunk_lse)


def _grad_hop(backend, softmax_scale, dout, q, kv, out, lse, dq, dkv) -> None:
    """Add one K/V block's share of the gradient into the fp32 accumulators ``dq`` and ``dkv``."""
    dq_chunk, dk_chunk, dv_chunk = backend.backward_ring_kv_chunk(
        dout, q, kv[0], kv[1], out, lse, softmax_scale=softmax_scale
    )
    dq += dq_chunk
    dkv[0] += dk_chunk
    dkv[1] += dv_chunk


def _grad_text_chunk(backend, softmax_scale, dout, q, text: ReplicatedText, out, lse, dq, dkv_text) -> None:
    """Add the text K/V chunk's share of the gradient (masked keys get none) into ``dq`` and ``dkv_text``."""
    dq_chunk, dk_chunk, dv_chunk = prefix_chunk_backward(
        backend, softmax_scale, dout, q, text.k, text.v, out, lse, text.keys
    )
    dq += dq_chunk
    dkv_text[0] += dk_chunk
    dkv_text[1] += dv_chunk


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    backend: AttentionBackend,
    dims: ParallelDims,
    *,
    softmax_scale: float | None = None,
    valid_len: int | None = None,
) -> Tensor:
    """Attention of this rank's query block ``(B, L, H, D)`` to the K/V blocks of every rank of its ring.

    Ring rank j holds tokens ``[j * L, (j + 1) * L)`` of the sequence; ``valid_len`` counts the real ones.
    """
    return RingAttentionFunction.apply(q, k, v, backend, softmax_scale, dims, valid_len)


def joint_ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    text: ReplicatedText,
    backend: AttentionBackend,
    dims: ParallelDims,
    *,
    softmax_scale: float | None = None,
    valid_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``ring_attention`` of the image block ``(B, L, h, D)`` plus a replicated text prefix ``text`` (``(B, P, h, D)``
    on every rank) that every query attends once; returns ``(out (B, L, h, D), text_out (B, P, h, D))``."""
    return JointRingAttentionFunction.apply(
        q, k, v, text.q, text.k, text.v, backend, softmax_scale, dims, valid_len, text.keys
    )
