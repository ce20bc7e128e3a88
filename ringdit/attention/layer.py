"""``USPAttention``: the one place where a model's attention meets sequence parallelism.

USP = Ulysses x Ring. Inside the Ulysses group an all-to-all trades the sequence shard for a head shard (each rank
then holds ``ulysses`` consecutive sequence chunks for ``H / ulysses`` heads); ring attention runs over the ring group
on that longer block; the reverse all-to-all restores the ``[B, S_local, H, D]`` layout. With both degrees 1 it is
plain local attention and communicates nothing.

Joint text-image attention (Flux, QwenImage): ``joint_prefix=P`` says the first P tokens are text, replicated on
every SP rank; only the image part is sharded. Text K/V are attended once per query as a local, non-rotated chunk
(ring) and the text is split by heads, not by sequence (Ulysses); ``prefix_mask`` removes padded text keys. The
scheme, and why the text counts exactly once, are in ``ringdit.attention.joint``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ringdit.attention.backend import AttentionBackend, Tensor
from ringdit.attention.registry import check_ring_capable, get_attn_backend
from ringdit.attention.joint import (
    check_joint_args,
    gather_text_heads,
    local_joint_attention,
    real_prefix_indices,
    text_head_slice,
)
from ringdit.attention.ring import ReplicatedText, joint_ring_attention, ring_attention
from ringdit.parallel import ParallelDims, all_to_all, check_heads_divisible


def local_attention(
    backend: AttentionBackend, q: Tensor, k: Tensor, v: Tensor, *, softmax_scale=None, valid_len=None
) -> Tensor:
    """Attention over the whole sequence held here; rows beyond ``valid_len`` are tail padding: they attend to
    nothing, are attended by nothing, and come back as zeros."""
    length = q.shape[1]
    if valid_len is None or valid_len >= length:
        return backend.forward(q, k, v, softmax_scale=softmax_scale)
    if valid_len <= 0:
        return torch.zeros_like(q)
    out = backend.forward(q[:, :valid_len], k[:, :valid_len], v[:, :valid_len], softmax_scale=softmax_scale)
    return F.pad(out, (0, 0, 0, 0, 0, length - valid_len))  # (B, S, H, D), zero rows for the padding



class LocalAttention(nn.Module):
    """Attention over the whole sequence held here, no communication: a ringdit model's ``inner_attention`` on one
    device (a parallel plan replaces it), and cross-attention to keys every rank holds whole (text)."""

    def __init__(self, backend: str | AttentionBackend | None = None):
        super().__init__()
        self.backend = backend if isinstance(backend, AttentionBackend) else get_attn_backend(backend)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: float | None = None) -> Tensor:
        return local_attention(self.backend, q, k, v, softmax_scale=softmax_scale)

class USPAttention(nn.Module):
    """Attention of this rank's sequence shard ``q, k, v: (B, S_local, H, D)`` -> ``(B, S_local, H, D)``.

    Exact: the same numbers as one device attending over the gathered sequence (up to floating-point
    reordering), forward and backward. ``valid_len`` is the global number of real tokens; the tail padding that
    makes the sequence divisible by the parallel degree never receives attention weight.

    Joint attention: with ``joint_prefix=P``, ``q, k, v: (B, P + S_local, H, D)`` are ``[text ; image shard]``, the
    text identical on every SP rank, ``valid_len`` the global number of real IMAGE tokens; every query attends to
    all real text and image keys, and the text output rows come back identical on every rank. ``prefix_mask``
    ``(B, P)`` bool, True = real text token: masked text keys get no weight (masked text query rows still attend).
    Gradients of the replicated text q/k/v are partial per rank: their sum over the SP group is the one-device one.

    ``dims``: this rank's place in the mesh; without it the layer is plain local attention. Whether the heads split
    over Ulysses and the backend can do ring is checked here, at construction, not at every call.
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
        check_heads_divisible(self.num_heads, dims.ulysses_degree)
        self.dims = dims

    def keep_communication_eager(self) -> None:
        """Before ``torch.compile``: the sharded paths break the graph and run eagerly, so point-to-point transfers
        and all-to-alls stay outside compiled graphs. Done here, when compiling, not at import: importing Dynamo costs
        every process about a second, also those that never compile."""
        for name in ("_parallel_forward", "_joint_parallel_forward"):
            setattr(self, name, torch.compiler.disable(getattr(self, name)))

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        valid_len: int | None = None,
        joint_prefix: int = 0,
        prefix_mask: Tensor | None = None,
    ) -> Tensor:
        check_joint_args(q, k, v, joint_prefix, prefix_mask)
        dims = self.dims
        if dims.sp_degree == 1:
            if joint_prefix:
                return local_joint_attention(
                    self.backend, q, k, v, joint_prefix=joint_prefix, prefix_mask=prefix_mask,
                    softmax_scale=self.softmax_scale, valid_len=valid_len,
                )
            return local_attention(self.backend, q, k, v, softmax_scale=self.softmax_scale, valid_len=valid_len)
        if joint_prefix:
            return self._joint_parallel_forward(q, k, v, valid_len, dims, joint_prefix, prefix_mask)
        return self._parallel_forward(q, k, v, valid_len, dims)

    def _parallel_forward(self, q: Tensor, k: Tensor, v: Tensor, valid_len: int | None, dims) -> Tensor:
        if dims.ulysses_degree > 1:
            q, k, v = self._sequence_to_heads(q, k, v, dims)  # (B, U*S_local, H/U, D)
        if dims.ring_degree > 1:
            out = ring_attention(
                q, k, v, self.backend, dims, softmax_scale=self.softmax_scale, valid_len=valid_len
            )
        else:
            out = local_attention(self.backend, q, k, v, softmax_scale=self.softmax_scale, valid_len=valid_len)
        if dims.ulysses_degree > 1:
            out = all_to_all(out, dims.ulysses_group, scatter_dim=1, gather_dim=2)  # (B, S_local, H, D)
        return out

    def _joint_parallel_forward(
        self, q: Tensor, k: Tensor, v: Tensor, valid_len: int | None, dims, joint_prefix: int, prefix_mask
    ) -> Tensor:
        """``[text ; image shard]`` ``(B, P + S_local, H, D)``: the image part takes the usual USP path, the
        replicated text is split by heads (Ulysses) and attended as one local K/V chunk (ring)."""
        text = [t[:, :joint_prefix] for t in (q, k, v)]  # (B, P, H, D), identical on every SP rank
        q, k, v = (t[:, joint_prefix:] for t in (q, k, v))  # (B, S_local, H, D), this rank's image shard

        if dims.ulysses_degree > 1:
            q, k, v = self._sequence_to_heads(q, k, v, dims)  # (B, U*S_local, H/U, D)
            # Text is whole on every rank already: no exchange, just this rank's heads.
            text = [text_head_slice(t, dims.ulysses_rank, dims.ulysses_degree) for t in text]  # (B, P, H/U, D)
        if dims.ring_degree > 1:
            text = ReplicatedText(*text, real_prefix_indices(prefix_mask))
            out, text_out = joint_ring_attention(
                q, k, v, text, self.backend, dims, softmax_scale=self.softmax_scale, valid_len=valid_len
            )
        else:  # Ulysses only: the whole joint sequence is here, for this rank's heads
            joint = local_joint_attention(
                self.backend, *(torch.cat([t, x], dim=1) for t, x in zip(text, (q, k, v))),
                joint_prefix=joint_prefix, prefix_mask=prefix_mask, softmax_scale=self.softmax_scale,
                valid_len=valid_len,
            )
            text_out, out = joint[:, :joint_prefix], joint[:, joint_prefix:]
        if dims.ulysses_degree > 1:
            out = all_to_all(out, dims.ulysses_group, scatter_dim=1, gather_dim=2)  # (B, S_local, H, D)
            text_out = gather_text_heads(text_out, dims.ulysses_group)  # (B, P, H, D)
        return torch.cat([text_out, out], dim=1)  # (B, P + S_local, H, D)

    @staticmethod
    def _sequence_to_heads(q: Tensor, k: Tensor, v: Tensor, dims) -> tuple[Tensor, Tensor, Tensor]:
        """Ulysses: trade the sequence shard for a head shard, ``(B, S_local, H, D) -> (B, U*S_local, H/U, D)``."""
        qkv = torch.stack([q, k, v])  # (3, B, S_local, H, D): one all-to-all for all three
        return all_to_all(qkv, dims.ulysses_group, scatter_dim=3, gather_dim=2).unbind(0)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_size={self.head_size}, backend={self.backend.name}"

