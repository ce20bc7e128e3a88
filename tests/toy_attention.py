"""A toy attention for the plan's stream tests (``tests/test_streams.py``, ``tests/test_packed_streams.py``):
projections around ``inner_attention``, the site a plan routes through ``USPAttention``, and its unsharded math."""

from __future__ import annotations

import torch
from torch import nn

DIM, HEADS = 8, 2


class MathAttention(nn.Module):
    """The unsharded reference: softmax attention of (B, S, H, D), keys masked by an optional (B, 1, 1, keys) mask."""

    def forward(self, q, k, v, *, softmax_scale=None, attn_mask=None):
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


class Attention(nn.Module):
    """Projections around ``inner_attention`` (what a plan routes), queries of ``x``, keys of ``context``."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, DIM // HEADS
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(DIM, DIM) for _ in range(4))
        self.inner_attention = MathAttention()

    def forward(self, x, context=None, attn_mask=None):
        context = x if context is None else context
        q, k, v = (proj(y).unflatten(2, (HEADS, -1)) for proj, y in ((self.to_q, x), (self.to_k, context),
                                                                     (self.to_v, context)))
        return self.to_out(self.inner_attention(q, k, v, attn_mask=attn_mask).flatten(2))
