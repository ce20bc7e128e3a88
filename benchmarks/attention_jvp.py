"""What a forward-mode derivative costs: ``torch.func.jvp`` (output and tangent) against a plain forward, side by side
in one run, on CPU. Three rows per backend:

- attention alone, one process (``USPAttention`` without a mesh);
- ring attention on ``--ranks`` gloo CPU ranks (each rank one thread): the tangent pass rotates ``[k, v, dk, dv]``;
- a whole DiT (``--depth`` blocks, width ``--hidden``) on one process, the JVP in the input and the time as sCM
  takes it (``torch.autograd.forward_ad`` under ``linear_tangents``), and the same without ``linear_tangents``;
- one linear layer of the DiT's MLP shape, through PyTorch's own forward-AD formula and under ``linear_tangents``:
  what the rest of a model pays.

Timings alternate plain / JVP in each repeat and keep the best of ``--repeat``, so a burst of load elsewhere hits
both alike; the load average before and after is printed: the machine should be otherwise idle.

    python benchmarks/attention_jvp.py --seq 2048 --heads 8 --head-size 64 --repeat 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import time

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.multiprocessing as mp

from ringdit.attention import USPAttention
from ringdit.common.linear_tangents import linear_tangents


def best_pair(plain, jvp, repeat: int) -> tuple[float, float]:
    plain(), jvp()  # warm-up
    times = [[], []]
    for _ in range(repeat):
        for index, fn in enumerate((plain, jvp)):
            start = time.perf_counter()
            fn()
            times[index].append(time.perf_counter() - start)
    return min(times[0]), min(times[1])


def attention_case(backend: str, shape, dims=None):
    g = torch.Generator().manual_seed(0)
    q, k, v, dq, dk, dv = (torch.randn(shape, generator=g) for _ in range(6))
    attn = USPAttention(shape[2], shape[3], backend=backend, dims=dims)
    plain = lambda: attn(q, k, v)  # noqa: E731
    jvp = lambda: torch.func.jvp(attn, (q, k, v), (dq, dk, dv))  # noqa: E731
    return torch.no_grad()(plain), torch.no_grad()(jvp)


def _ring_rank(rank, world, port, backend, shape, repeat, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ringdit.parallel import init_sequence_parallel

    dims = init_sequence_parallel(world, 1)
    plain, jvp = attention_case(backend, shape, dims)
    # every rank runs the same number of calls in the same order: the ring's transfers pair up
    pair = best_pair(plain, jvp, repeat)
    if rank == 0:
        results.put(pair)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ring_pair(backend: str, shape, ranks: int, repeat: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_ring_rank, args=(ranks, free_port(), backend, shape, repeat, results), nprocs=ranks,
                       start_method="spawn")
    return results.get()


def forward_ad(fn, primals, tangents, fast_linears: bool):
    """``fn``'s output and tangent by ``torch.autograd.forward_ad`` (sCM's pass), with or without ``linear_tangents``."""
    with fwAD.dual_level(), linear_tangents() if fast_linears else contextlib.nullcontext():
        return fwAD.unpack_dual(fn(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangents))))


def dit_case(backend: str, depth: int, hidden: int, heads: int, size: int, fast_linears: bool):
    from ringdit.models import DiT, parallelize

    torch.manual_seed(0)
    model = DiT(input_size=size, patch_size=2, in_channels=4, hidden_size=hidden, depth=depth, num_heads=heads,
                num_classes=10, learn_sigma=False)
    for weight in (p for p in model.parameters() if p.dim() > 1):  # a trained model's tangent is not zero (adaLN-zero)
        torch.nn.init.normal_(weight, std=0.02)
    parallelize(model, backend=backend)
    g = torch.Generator().manual_seed(1)
    x, dx = (torch.randn(2, 4, size, size, generator=g) for _ in range(2))
    t, dt, y = torch.tensor([300.0, 700.0]), torch.tensor([1.0, 1.0]), torch.tensor([1, 2])
    plain = lambda: model(x, t, y)  # noqa: E731
    jvp = lambda: forward_ad(lambda x, t: model(x, t, y), (x, t), (dx, dt), fast_linears)  # noqa: E731
    return torch.no_grad()(plain), torch.no_grad()(jvp)


def linear_case(hidden: int, tokens: int, fast_linears: bool):
    g = torch.Generator().manual_seed(0)
    x, dx = (torch.randn(2 * tokens, hidden, generator=g) for _ in range(2))
    layer = torch.nn.Linear(hidden, 4 * hidden)
    jvp = lambda: forward_ad(layer, (x,), (dx,), fast_linears)  # noqa: E731
    return torch.no_grad()(lambda: layer(x)), torch.no_grad()(jvp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--image", type=int, default=32, help="DiT latent size (patch 2: (image/2)^2 tokens)")
    parser.add_argument("--backends", nargs="+", default=["torch_flash", "math"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    shape = (1, args.seq, args.heads, args.head_size)
    print(f"torch {torch.__version__}, fp32 CPU, {args.threads} thread(s) per process, best of {args.repeat}; "
          f"attention S={args.seq} H={args.heads} D={args.head_size}; DiT depth {args.depth} width {args.hidden} "
          f"{(args.image // 2) ** 2} tokens\n")
    print("| case | backend | forward (ms) | JVP: output + tangent (ms) | JVP / forward |")
    print("|---|---|---:|---:|---:|")
    for backend in args.backends:
        cases = [("attention, one process", lambda: best_pair(*attention_case(backend, shape), args.repeat)),
                 (f"ring attention, {args.ranks} ranks (S/{args.ranks} per rank)",
                  lambda: ring_pair(backend, (1, args.seq // args.ranks, args.heads, args.head_size), args.ranks,
                                    args.repeat)),
                 ("DiT, one process (sCM's pass)",
                  lambda: best_pair(*dit_case(backend, args.depth, args.hidden, args.heads, args.image, True),
                                    args.repeat)),
                 ("DiT, one process, PyTorch's linear formula",
                  lambda: best_pair(*dit_case(backend, args.depth, args.hidden, args.heads, args.image, False),
                                    args.repeat))]
        if backend == args.backends[0]:
            tokens = (args.image // 2) ** 2
            cases += [("one linear layer, PyTorch's formula",
                       lambda: best_pair(*linear_case(args.hidden, tokens, False), args.repeat)),
                      ("one linear layer, `linear_tangents`",
                       lambda: best_pair(*linear_case(args.hidden, tokens, True), args.repeat))]
        for name, measure in cases:
            plain, jvp = measure()
            shown = "-" if name.startswith("one linear") else backend
            print(f"| {name} | {shown} | {plain * 1e3:.1f} | {jvp * 1e3:.1f} | {jvp / plain:.2f}x |", flush=True)
    load_after = os.getloadavg()
    print(f"\nload average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; "
          f"after: {', '.join(f'{x:.2f}' for x in load_after)} (on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
