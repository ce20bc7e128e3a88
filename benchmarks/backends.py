"""Forward speed of each available attention backend on this machine (GFLOP/s), e.g.

    python benchmarks/backends.py --seq 4096 --heads 8 --head-size 64 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

from ringdit.attention import get_attn_backend, list_backends
from ringdit.attention.registry import backend_class


def time_forward(backend, q, k, v, repeat: int) -> float:
    def sync():
        if q.is_cuda:
            torch.cuda.synchronize()

    with torch.no_grad():
        backend.forward(q, k, v)  # warm-up
        best = float("inf")
        for _ in range(repeat):
            sync()
            start = time.perf_counter()
            backend.forward(q, k, v)
            sync()
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = (args.batch, args.seq, args.heads, args.head_size)
    q, k, v = (torch.randn(shape, device=args.device).to(dtype) for _ in range(3))
    flops = 4 * args.batch * args.heads * args.seq**2 * args.head_size  # two matmuls of 2*S*S*D each

    print(f"attention forward, B={args.batch} S={args.seq} H={args.heads} D={args.head_size} {args.dtype} "
          f"on {args.device}, {torch.get_num_threads()} thread(s), best of {args.repeat}\n")
    print("| backend | time (ms) | GFLOP/s |")
    print("|---|---:|---:|")
    for name in list_backends():
        cls = backend_class(name)
        if not cls.is_available(args.device.split(":")[0]) or dtype not in cls.dtypes:
            continue
        seconds = time_forward(get_attn_backend(name, device_type=args.device.split(":")[0]), q, k, v, args.repeat)
        print(f"| {name} | {seconds * 1e3:.1f} | {flops / seconds / 1e9:.1f} |")


if __name__ == "__main__":
    main()
