"""``USPAttention``: the one place where a model's attention meets sequence parallelism.

USP = Ulysses x Ring. Inside the Ulysses group an all-to-all trades the sequence shard for a head shard (each rank
then holds ``ulysses`` consecutive sequence chunks for ``H / ulysses`` heads); ring attention runs over the ring group
on that longer block; the reverse all-to-all restores the ``[B, S_local, H, D]`` layout. With both degrees 1 it is
plain local attention and communicates nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ringdit.attention.backend import AttentionBackend, Tensor
from ringdit.attention.registry import check_ring_capable, get_attn_backend
from ringdit.attention.ring import ring_attention
from ringdit.parallel import all_to_all, check_heads_divisible, current_parallel_dims


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


class USPAttention(nn.Module):
    """Attention of this rank's sequence shard ``q, k, v: (B, S_local, H, D)`` -> ``(B, S_local, H, D)``.

    Exact: the same numbers as one device attending over the gathered sequence (up to floating-point
    reordering), forward and backward. ``valid_len`` is the global number of real tokens; the tail padding that
    makes the sequence divisible by the parallel degree never receives attention weight.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        *,
        backend: str | AttentionBackend | None = None,
        softmax_scale: float | None = None,
    ):
        super().__init__()
        self.num_heads, self.head_size = num_heads, head_size
        self.softmax_scale = head_size**-0.5 if softmax_scale is None else softmax_scale
        self.backend = backend if isinstance(backend, AttentionBackend) else get_attn_backend(backend)
        self._check_parallel_layout()
        _keep_communication_out_of_compiled_graphs()

    def _check_parallel_layout(self) -> None:
        dims = current_parallel_dims()
        if dims.ring_degree > 1:
            check_ring_capable(self.backend)
        check_heads_divisible(self.num_heads, dims.ulysses_degree)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, valid_len: int | None = None) -> Tensor:
        dims = current_parallel_dims()
        if dims.sp_degree == 1:
            return local_attention(self.backend, q, k, v, softmax_scale=self.softmax_scale, valid_len=valid_len)
        return self._parallel_forward(q, k, v, valid_len, dims)

    def _parallel_forward(self, q: Tensor, k: Tensor, v: Tensor, valid_len: int | None, dims) -> Tensor:
        self._check_parallel_layout()  # the mesh may have been built after this layer

        if dims.ulysses_degree > 1:
            qkv = torch.stack([q, k, v])  # (3, B, S_local, H, D): one all-to-all for all three
            q, k, v = all_to_all(qkv, dims.ulysses_group, scatter_dim=3, gather_dim=2).unbind(0)  # (B, U*S_local, H/U, D)
        if dims.ring_degree > 1:
            out = ring_attention(
                q, k, v, self.backend, dims, softmax_scale=self.softmax_scale, valid_len=valid_len
            )
        else:
            out = local_attention(self.backend, q, k, v, softmax_scale=self.softmax_scale, valid_len=valid_len)
        if dims.ulysses_degree > 1:
            out = all_to_all(out, dims.ulysses_group, scatter_dim=1, gather_dim=2)  # (B, S_local, H, D)
        return out

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_size={self.head_size}, backend={self.backend.name}"


def _keep_communication_out_of_compiled_graphs() -> None:
    """A torch.compile'd block breaks its graph at the sharded path and runs it eagerly: point-to-point transfers
    and all-to-alls stay outside compiled graphs. Marked at the first layer's construction, not at import, because
    importing Dynamo costs every process about a second, also those that never compile."""
    if not getattr(USPAttention._parallel_forward, "_torchdynamo_disable", False):
        USPAttention._parallel_forward = torch.compiler.disable(USPAttention._parallel_forward)
