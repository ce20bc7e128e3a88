"""``math``: attention written out in plain PyTorch. Any device, any dtype including fp64: the reference.

It computes in the accumulation dtype (fp32, fp64 for fp64) whatever autocast says, like the fused kernels do.
"""

from __future__ import annotations

import functools

import torch

from ringdit.attention.backend import AttentionBackend, Tensor, accepts_packed_layout, accumulation_dtype


def _without_autocast(method):
    @functools.wraps(method)
    def wrapper(self, *tensors, **kwargs):
        with torch.autocast(tensors[0].device.type, enabled=False):
            return method(self, *tensors, **kwargs)

    return wrapper


def _scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Scaled attention logits in the accumulation dtype: (B, H, Sq, Sk)."""
    acc = accumulation_dtype(q.dtype)
    return torch.einsum("bqhd,bkhd->bhqk", q.to(acc), k.to(acc)) * scale


# Query rows per step of ``chunk_tangent``: its (rows, Sk) matrices stay near 2**21 elements (8 MiB in fp32) per
# batch x heads, so their elementwise passes run from cache; measured on CPU at S=2048 (and at 1024 with two ranks
# sharing the cores): about 20% faster than the whole block at once, slower again below 64 rows.
_TANGENT_TILE_ELEMENTS, _TANGENT_MIN_ROWS = 2**21, 64


def chunk_tangent(q, k, v, dq, dk, dv, lse, scale: float) -> tuple[Tensor, Tensor]:
    """One K/V chunk's share of the attention output's tangent, given the FINAL row ``lse`` (the contract of
    ``AttentionBackend.jvp_ring_kv_chunk``), in plain PyTorch: ``(P dv + (P * dS) v, rowsum(P * dS))``.

    ``P = exp(S - lse)`` is this chunk's slice of the whole row's softmax, ``dS = scale * (dq k^T + q dk^T)``.
    Written for speed, as batched matmuls over ``(B*H, S, D)``, because on CPU every elementwise pass over an
    ``(Sq, Sk)`` matrix costs about as much as a matmul: extra columns fold ``- lse`` into the scores' matmul
    (``[scale q, -lse] . [k, 1]``) and ``rowsum`` into the value product (``(P * dS) . [v, 1]``), the two products of
    ``dS`` are one matmul over the concatenated head dims (``[dq, q] . [k, dk]``), and ``scale`` is applied to the
    ``(S, D)`` results. What is left on the ``(Sq, Sk)`` matrices is one ``exp`` and one product, in place, a tile
    of query rows at a time (rows are independent).
    """
    acc = accumulation_dtype(q.dtype)
    batch, queries, heads, head_size = q.shape
    q, k, v, dq, dk, dv = (_by_head(t.to(acc)) for t in (q, k, v, dq, dk, dv))
    ones = k.new_ones(k.shape[:2] + (1,))
    keys_lse = torch.cat([k, ones], dim=-1).transpose(1, 2)  # (B*H, D+1, Sk)
    keys_ds = torch.cat([k, dk], dim=-1).transpose(1, 2)  # (B*H, 2D, Sk)
    values = torch.cat([v, ones], dim=-1)  # (B*H, Sk, D+1)
    queries_lse = torch.cat([q * scale, -lse.to(acc).reshape(batch * heads, queries, 1)], dim=-1)
    queries_ds = torch.cat([dq, q], dim=-1)
    partial = q.new_empty(q.shape)  # (B*H, Sq, D)
    rowsum = q.new_empty(q.shape[:2])
    rows = max(_TANGENT_MIN_ROWS, _TANGENT_TILE_ELEMENTS // (batch * heads * max(1, k.shape[1])))
    for start in range(0, queries, rows):
        tile = slice(start, start + rows)
        probs = torch.bmm(queries_lse[:, tile], keys_lse).exp_()
        pds = torch.bmm(queries_ds[:, tile], keys_ds).mul_(probs)  # P * dS / scale
        weighted = torch.bmm(pds, values)  # [(P * dS) v, rowsum(P * dS)] / scale
        partial[:, tile] = torch.baddbmm(weighted[..., :head_size], probs, dv, beta=scale)
        rowsum[:, tile] = weighted[..., head_size] * scale
    partial = partial.view(batch, heads, queries, head_size).transpose(1, 2)  # (B, Sq, H, D)
    return partial, rowsum.view(batch, heads, queries)


def _by_head(t: Tensor) -> Tensor:
    """``(B, S, H, D) -> (B*H, S, D)`` for batched matmuls."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


class MathBackend(AttentionBackend):
    name = "math"
    priority = 90  # correct everywhere, fast nowhere: the last automatic choice
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)

    @_without_autocast
    def forward(self, q, k, v, *, softmax_scale=None):
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        probs = _scores(q, k, scale).softmax(dim=-1)  # (B, H, Sq, Sk)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v.to(probs.dtype))
        return out.to(q.dtype)

    @accepts_packed_layout
    @_without_autocast
    def forward_ring_kv_chunk(self, q, k, v, *, softmax_scale=None):
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        scores = _scores(q, k, scale)  # (B, H, Sq, Sk)
        lse = scores.logsumexp(dim=-1)  # (B, H, Sq)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v.to(probs.dtype))
        return out.to(q.dtype), lse

    @accepts_packed_layout
    @_without_autocast
    def backward_ring_kv_chunk(self, dout, q, k, v, out, lse, *, softmax_scale=None):
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        acc = accumulation_dtype(q.dtype)
        dout, out = dout.to(acc), out.to(acc)
        # This chunk's slice of the FULL row softmax, normalised by the final lse.
        probs = torch.exp(_scores(q, k, scale) - lse.to(acc).unsqueeze(-1))  # (B, H, Sq, Sk)
        dv = torch.einsum("bhqk,bqhd->bkhd", probs, dout)
        dprobs = torch.einsum("bqhd,bkhd->bhqk", dout, v.to(acc))
        # rowsum(dout * out) over the whole row: the softmax-Jacobian correction, shared by all chunks.
        delta = (dout * out).sum(dim=-1).transpose(1, 2).unsqueeze(-1)  # (B, H, Sq, 1)
        dscores = probs * (dprobs - delta) * scale
        dq = torch.einsum("bhqk,bkhd->bqhd", dscores, k.to(acc))
        dk = torch.einsum("bhqk,bqhd->bkhd", dscores, q.to(acc))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    @accepts_packed_layout
    @_without_autocast
    def jvp_ring_kv_chunk(self, q, k, v, dq, dk, dv, lse, *, softmax_scale=None):
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return chunk_tangent(q, k, v, dq, dk, dv, lse, scale)
