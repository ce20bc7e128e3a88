"""``USPAttention``: the one place where a model's attention meets sequence parallelism.

USP = Ulysses x Ring. Inside the Ulysses group an all-to-all trades the sequence shard for a head shard (each rank
then holds ``ulysses`` consecutive sequence chunks for its share of the heads: ``H / ulysses`` of them, or, where the
degree does not divide the heads, ``ceil`` or ``floor`` of it, ``ringdit.parallel.heads``); ring attention runs over
the ring group on that longer block (a ring group's ranks share a Ulysses rank, so they hold the same heads); the
reverse all-to-all restores the ``[B, S_local, H, D]`` layout. With both degrees 1 it is
plain local attention and communicates nothing.

Which tokens are real is a ``TokenLayout`` (``ringdit.attention.token_layout``): ``valid_len`` for one tail-padded
sequence, or the layout of joint text-image attention (Flux, QwenImage), where every rank's chunk is
``[its text shard ; its image shard]``, each stream padded at its own tail and the text optionally masked. One
mechanism serves both: padded and masked keys get no weight, padded query rows return zeros.
"""

from __future__ import annotations

import torch
from torch import nn

from ringdit.attention.backend import AttentionBackend, Tensor
from ringdit.attention.registry import check_ring_capable, get_attn_backend
from ringdit.attention.token_layout import Stream, TokenLayout, is_empty, take
from ringdit.attention.ring import ring_attention
from ringdit.parallel import ParallelDims, all_to_all, check_heads_placeable, head_counts


def local_attention(
    backend: AttentionBackend, q: Tensor, k: Tensor, v: Tensor, *, softmax_scale=None, valid_len=None,
    layout: TokenLayout | None = None, first: int = 0, count: int = 1,
) -> Tensor:
    """Attention over the whole sequence held here, through the backend's differentiable ``forward`` (any backend,
    also those without the ring hooks). The real keys and rows are those of the layout's chunks ``first ..
    first + count - 1`` (``valid_len``: one tail-padded sequence); padded rows come back as zeros."""
    if layout is None and valid_len is not None:
        layout = TokenLayout.tail_padded(valid_len, q.shape[1])
    if layout is None:
        return backend.forward(q, k, v, softmax_scale=softmax_scale)
    keys, rows = layout.keys(first, count), layout.real_rows(first, count)
    if isinstance(keys, list):  # samples differ (masked text): one call per sample
        out = torch.cat([_attend_keys(backend, q[b : b + 1], k[b : b + 1], v[b : b + 1], sample_keys, softmax_scale)
                         for b, sample_keys in enumerate(keys)])
    else:
        out = _attend_keys(backend, q, k, v, keys, softmax_scale)
    if rows is not None:
        out = out.masked_fill(~rows[None, :, None, None], 0)  # (B, S, H, D), zero rows for the padding
    return out


def _attend_keys(backend: AttentionBackend, q: Tensor, k: Tensor, v: Tensor, keys, softmax_scale) -> Tensor:
    if is_empty(keys):  # nothing to attend to
        return torch.zeros_like(q)
    return backend.forward(q, take(k, keys, 1), take(v, keys, 1), softmax_scale=softmax_scale)


class LocalAttention(nn.Module):
    """Attention over the whole sequence held here, no communication: a ringdit model's ``inner_attention`` on one
    device (a parallel plan replaces it), and cross-attention to keys every rank holds whole (text)."""

    def __init__(self, backend: str | AttentionBackend | None = None):
        super().__init__()
        self.backend = backend if isinstance(backend, AttentionBackend) else get_attn_backend(backend)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: float | None = None,
                key_mask: Tensor | None = None) -> Tensor:
        """``key_mask`` (B, L) bool, True on the keys each sample attends to (LTX's padded prompts): the others get
        no weight. It is a layout of one stream that every rank holds whole, so the keys are cut per sample as for
        joint attention's text (a view where the real keys are one run); a sample with no real key gets zeros."""
        if key_mask is None:
            return local_attention(self.backend, q, k, v, softmax_scale=softmax_scale)
        keys = k.shape[1]
        if key_mask.shape[-1] != keys:
            raise ValueError(f"the key mask covers {key_mask.shape[-1]} keys, k has {keys} (dim 1)")
        layout = TokenLayout([Stream(keys, keys, key_mask)])
        return local_attention(self.backend, q, k, v, softmax_scale=softmax_scale, layout=layout)

class USPAttention(nn.Module):
    """Attention of this rank's sequence shard ``q, k, v: (B, S_local, H, D)`` -> ``(B, S_local, H, D)``.

    Exact: the same numbers as one device attending over the gathered sequence (up to floating-point
    reordering), forward and backward. ``valid_len`` is the global number of real tokens; the tail padding that
    makes the sequence divisible by the parallel degree never receives attention weight.

    ``layout`` (instead of ``valid_len``): which tokens of every rank's chunk are real, for sequences of several
    streams (joint attention: ``[text shard ; image shard]``, text keys optionally masked per sample); see
    ``ringdit.attention.token_layout``. Every query attends to every real key of every rank.

    ``dims``: this rank's place in the mesh; without it the layer is plain local attention. Whether every Ulysses rank
    gets a head and the backend can do ring is checked here, at construction, not at every call.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        *,
        backend: str | AttentionBackend | None = None,
        softmax_scale: float | None = None,
        dims: ParallelDims | None = None,
    ):
        super().__init__()
        self.num_heads, self.head_size = num_heads, head_size
        self.softmax_scale = head_size**-0.5 if softmax_scale is None else softmax_scale
        self.backend = backend if isinstance(backend, AttentionBackend) else get_attn_backend(backend)
        dims = dims or ParallelDims()
        if dims.ring_degree > 1:
            check_ring_capable(self.backend)
        check_heads_placeable(self.num_heads, dims.ulysses_degree)
        self.dims = dims
        self.head_counts = head_counts(num_heads, dims.ulysses_degree)  # each Ulysses rank's heads

    def keep_communication_eager(self) -> None:
        """Before ``torch.compile``: the sharded paths break the graph and run eagerly, so point-to-point transfers
        and all-to-alls stay outside compiled graphs. Done here, when compiling, not at import: importing Dynamo costs
        every process about a second, also those that never compile."""
        self._parallel_forward = torch.compiler.disable(self._parallel_forward)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, valid_len: int | None = None, layout: TokenLayout | None = None
    ) -> Tensor:
        if layout is None and valid_len is not None:
            layout = TokenLayout.tail_padded(valid_len, q.shape[1])
        if layout is not None and layout.chunk != q.shape[1]:
            raise ValueError(f"the token layout has {layout.chunk} tokens per rank, q has {q.shape[1]} (dim 1)")
        dims = self.dims
        if dims.sp_degree == 1:
            return local_attention(self.backend, q, k, v, softmax_scale=self.softmax_scale, layout=layout)
        return self._parallel_forward(q, k, v, layout, dims)

    def _parallel_forward(self, q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout | None, dims) -> Tensor:
        if dims.ulysses_degree > 1:
            q, k, v = self._sequence_to_heads(q, k, v, dims)  # (B, U*S_local, this rank's heads, D)
        if dims.ring_degree > 1:
            out = ring_attention(q, k, v, self.backend, dims, softmax_scale=self.softmax_scale, layout=layout)
        else:  # Ulysses only: the chunks of the whole group are here, for this rank's heads
            out = local_attention(self.backend, q, k, v, softmax_scale=self.softmax_scale, layout=layout,
                                  count=dims.ulysses_degree)
        if dims.ulysses_degree > 1:  # (B, S_local, H, D): every rank's heads come back
            out = all_to_all(out, dims.ulysses_group, scatter_dim=1, gather_dim=2, gather_sizes=self.head_counts)
        return out

    def _sequence_to_heads(self, q: Tensor, k: Tensor, v: Tensor, dims) -> tuple[Tensor, Tensor, Tensor]:
        """Ulysses: trade the sequence shard for a head shard, ``(B, S_local, H, D) -> (B, U*S_local, H_u, D)``
        with ``H_u = self.head_counts[ulysses_rank]``."""
        if q.shape[2] != self.num_heads:
            raise ValueError(f"q has {q.shape[2]} heads (dim 2), the attention layer was built for {self.num_heads}")
        qkv = torch.stack([q, k, v])  # (3, B, S_local, H, D): one all-to-all for all three
        heads = all_to_all(qkv, dims.ulysses_group, scatter_dim=3, gather_dim=2, scatter_sizes=self.head_counts)
        return heads.unbind(0)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_size={self.head_size}, backend={self.backend.name}"

