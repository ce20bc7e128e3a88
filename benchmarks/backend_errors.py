"""Max absolute error of every available backend against the math backend in fp64, per dtype: forward output, LSE,
and the chunk backward (dq, dk, dv) on the full K/V. N(0, 1) inputs, B=2, Sq=200, Sk=333, H=4, D=64.

    python benchmarks/backend_errors.py
"""

from __future__ import annotations

import torch

from ringdit.attention import get_attn_backend, list_backends
from ringdit.attention.registry import backend_class


def main() -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 200, 4, 64), (2, 333, 4, 64), (2, 333, 4, 64), (2, 200, 4, 64)]
    base = [torch.randn(s, generator=g) for s in shapes]
    print("| backend | dtype | out | lse | dq | dk | dv |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in list_backends():
        cls = backend_class(name)
        if not cls.is_available("cpu"):
            continue
        backend = get_attn_backend(name, device_type="cpu")
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            q, k, v, dout = (t.to(dtype) for t in base)
            qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))  # reference on the rounded inputs
            scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * 64**-0.5
            ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vd)
            ref.backward(dout.double())
            row = [(backend.forward(q, k, v).double() - ref.detach()).abs().max().item()]
            if cls.supports_ring_rotation():
                out, lse = backend.forward_ring_kv_chunk(q, k, v)
                row.append((lse.double() - scores.logsumexp(-1).detach()).abs().max().item())
                grads = backend.backward_ring_kv_chunk(dout, q, k, v, out, lse)
                row += [(gr.double() - r).abs().max().item() for gr, r in zip(grads, (qd.grad, kd.grad, vd.grad))]
            cells = " | ".join(f"{e:.1e}" for e in row) + " | -" * (5 - len(row))
            print(f"| {name} | {str(dtype).replace('torch.', '')} | {cells} |")


if __name__ == "__main__":
    main()
