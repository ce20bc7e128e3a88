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


def chunk_tangent(q, k, v, dq, dk, dv, lse, scale: float) -> tuple[Tensor, Tensor]:
    """One K/V chunk's share of the attention output's tangent, given the FINAL row ``lse`` (the contract of
    ``AttentionBackend.jvp_ring_kv_chunk``), in plain PyTorch: ``(P dv + (P * dS) v, rowsum(P * dS))``.

    ``P = exp(S - lse)`` is this chunk's slice of the whole row's softmax, ``dS = scale * (dq k^T + q dk^T)``.
    Written for speed, as batched matmuls over ``(B*H, S, D)``, because on CPU every elementwise pass over an
    ``(Sq, Sk)`` matrix costs about as much as a matmul: the extra columns fold ``- lse`` into the scores' matmul
    (``[scale q, -lse] . [k, 1]``) and ``rowsum`` into the value product (``(P * dS) . [v, 1]``), the two products of
    ``dS`` are one matmul over the concatenated head dims (``[dq, q] . [k, dk]``), and ``scale`` is applied to the
    ``(S, D)`` results. What is left on the ``(Sq, Sk)`` matrices is one ``exp`` and one product, in place.
    """
    acc = accumulation_dtype(q.dtype)
    batch, queries, heads, head_size = q.shape
    q, k, v, dq, dk, dv = (_by_head(t.to(acc)) for t in (q, k, v, dq, dk, dv))
    lse = lse.to(acc).reshape(batch * heads, queries, 1)
    ones = k.new_ones(k.shape[:2] + (1,))
    probs = torch.bmm(torch.cat([q * scale, -lse], dim=-1), torch.cat([k, ones], dim=-1).transpose(1, 2)).exp_()
    pds = torch.bmm(torch.cat([dq, q], dim=-1), torch.cat([k, dk], dim=-1).transpose(1, 2)).mul_(probs)  # P*dS/scale
    weighted = torch.bmm(pds, torch.cat([v, ones], dim=-1)).mul_(scale)  # [(P * dS) v, rowsum(P * dS)]
    partial = torch.bmm(probs, dv).add_(weighted[..., :head_size])  # (B*H, Sq, D)
    partial = partial.view(batch, heads, queries, head_size).transpose(1, 2)  # (B, Sq, H, D)
    return partial, weighted[..., head_size].view(batch, heads, queries)


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
