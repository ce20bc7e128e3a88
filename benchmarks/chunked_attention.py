"""The compute side of ring attention on one device: attention over K/V cut into N chunks (chunk kernels + LSE
merge, and the chunk backwards) against one call over the whole K/V. It isolates what a ring of N ranks pays in
kernel efficiency for smaller blocks, without communication -- useful on a single GPU.

    python benchmarks/chunked_attention.py --device cuda --dtype bfloat16 --seq 16384 --chunks 1 2 4 8
"""

from __future__ import annotations

import argparse
import time

import torch

from ringdit.attention import get_attn_backend
from ringdit.attention.backend import accumulation_dtype
from ringdit.attention.ring import merge_attention_chunk_


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def chunked_step(backend, q, k, v, dout, chunks: int) -> None:
    acc = accumulation_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
    k_chunks, v_chunks = k.chunk(chunks, dim=1), v.chunk(chunks, dim=1)
    for kc, vc in zip(k_chunks, v_chunks):
        merge_attention_chunk_(out, lse, *backend.forward_ring_kv_chunk(q, kc, vc))
    out = out.to(q.dtype)
    dq = torch.zeros_like(q, dtype=acc)
    for kc, vc in zip(k_chunks, v_chunks):
        dq += backend.backward_ring_kv_chunk(dout, q, kc, vc, out, lse)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="torch_flash")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    backend = get_attn_backend(args.backend, device_type=args.device.split(":")[0])
    shape = (1, args.seq, args.heads, args.head_size)
    q, k, v, dout = (torch.randn(shape, device=args.device).to(dtype) for _ in range(4))
    flops = 4 * args.heads * args.seq**2 * args.head_size * 3.5  # forward 1x + backward 2.5x (recompute)
    print(f"{args.backend} forward+backward over K/V in N chunks, S={args.seq} H={args.heads} D={args.head_size} "
          f"{args.dtype} on {args.device}, best of {args.repeat}\n")
    print("| chunks | time (ms) | TFLOP/s | vs 1 chunk |")
    print("|---:|---:|---:|---:|")
    base = None
    for chunks in args.chunks:
        chunked_step(backend, q, k, v, dout, chunks)  # warm-up
        best = float("inf")
        for _ in range(args.repeat):
            synchronize(args.device)
            start = time.perf_counter()
            chunked_step(backend, q, k, v, dout, chunks)
            synchronize(args.device)
            best = min(best, time.perf_counter() - start)
        base = base or best
        print(f"| {chunks} | {best * 1e3:.2f} | {flops / best / 1e12:.2f} | {base / best:.2f} |", flush=True)


if __name__ == "__main__":
    main()
