"""``torch_sdpa``: the public ``F.scaled_dot_product_attention``.

It picks the fastest kernel for the inputs but hides the softmax LSE, so it cannot merge ring hops: it serves plain
local attention and Ulysses-only parallelism, never ring attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringdit.attention.backend import AttentionBackend


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"
    priority = 10
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)

    def forward(self, q, k, v, *, softmax_scale=None):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale)
        return out.transpose(1, 2)
