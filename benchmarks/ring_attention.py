"""Context-parallel attention speed and memory per rank, against one process doing the whole sequence.

Each layout (ring x ulysses) runs in its own group of spawned CPU processes (gloo), one torch thread per rank, on a
sequence of S tokens split evenly over the ranks. ``all-gather`` is the naive baseline: every rank gathers the whole
K/V and attends its queries to it (backward: reduce-scatter of dK/dV).

    python benchmarks/ring_attention.py --seq 4096 8192 --layouts 1x1 2x1 4x1 2x2

Columns: best-of-N wall time per step (slowest rank), speedup and parallel efficiency (speedup / ranks) against the
single-process 1x1 run, and the peak memory of live tensors per rank during one step, inputs included (max over
ranks; see tensor_memory.py for what is counted).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ringdit.attention import USPAttention, get_attn_backend, local_attention
from ringdit.parallel import gather_sequence, init_sequence_parallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_ranks import free_port  # noqa: E402
from tensor_memory import PeakTensorMemory  # noqa: E402


def run_rank(rank, world, port, layout, mode, seq, heads, head_size, repeat, queue):
    ring, ulysses, method = layout
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    dims = init_sequence_parallel(ring, ulysses)
    backend = get_attn_backend("torch_flash")
    attn = USPAttention(heads, head_size, backend=backend, dims=dims)
    local_len = seq // (ring * ulysses)
    q, k, v, dout = (torch.randn(1, local_len, heads, head_size) for _ in range(4))  # this rank's shards

    def attention(*qkv):
        if method == "all-gather":  # every rank holds the whole K/V
            k, v = (gather_sequence(t, dims=dims) for t in qkv[1:])
            return local_attention(backend, qkv[0], k, v)
        return attn(*qkv)

    def step(mode):
        inputs = [t.clone().requires_grad_(mode == "fwd+bwd") for t in (q, k, v)]
        dout_ = dout.clone()  # cloned so that the memory tracker counts it too
        with torch.set_grad_enabled(mode == "fwd+bwd"):
            out = attention(*inputs)
            if mode == "fwd+bwd":
                out.backward(dout_)

    step(mode)  # warm-up
    best = float("inf")
    for _ in range(repeat):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        step(mode)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        best = min(best, elapsed.item())
    with PeakTensorMemory() as memory:  # one more step, untimed: the tracker's bookkeeping costs Python time
        step(mode)
    peak = torch.tensor([memory.peak_bytes / 2**20], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put((best, peak.item()))
    if world > 1:
        dist.destroy_process_group()


def measure(layout, seq, heads, head_size, repeat):
    """{mode: (seconds, peak MiB growth)} for one layout, each mode in a fresh process group."""
    world = layout[0] * layout[1]
    queue = mp.get_context("spawn").SimpleQueue()
    results = {}
    for mode in ("fwd", "fwd+bwd"):
        mp.start_processes(
            run_rank, args=(world, free_port(), layout, mode, seq, heads, head_size, repeat, queue), nprocs=world,
            start_method="spawn",
        )
        results[mode] = queue.get()
    return results


def parse_layout(text: str) -> tuple[int, int]:
    ring, ulysses = (int(x) for x in text.lower().split("x"))
    return ring, ulysses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "4x1", "2x2"], help="ring x ulysses")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-allgather", action="store_true", help="skip the all-gather K/V baseline")
    args = parser.parse_args()

    print(f"attention per step, H={args.heads} D={args.head_size} fp32, torch_flash, 1 thread per rank, "
          f"{os.cpu_count()} CPU cores, best of {args.repeat}\n")
    print("| S | layout (ring x ulysses) | method | mode | time (s) | speedup | efficiency | peak tensor memory / rank (MiB) |")
    print("|---:|---|---|---|---:|---:|---:|---:|")
    for seq in args.seq:
        base = measure((1, 1, "ring"), seq, args.heads, args.head_size, args.repeat)
        rows = [((1, 1), "single process", base)]
        for text in args.layouts:
            ring, ulysses = parse_layout(text)
            if ring * ulysses == 1:
                continue
            rows.append(((ring, ulysses), "usp", measure((ring, ulysses, "usp"), seq, args.heads, args.head_size, args.repeat)))
            if not args.no_allgather and ulysses == 1:
                rows.append(((ring, 1), "all-gather K/V",
                             measure((ring, 1, "all-gather"), seq, args.heads, args.head_size, args.repeat)))
        for (ring, ulysses), method, result in rows:
            for mode, (seconds, mib) in result.items():
                speedup = base[mode][0] / seconds
                print(f"| {seq} | {ring}x{ulysses} | {method} | {mode} | {seconds:.3f} | {speedup:.2f} | "
                      f"{speedup / (ring * ulysses):.0%} | {mib:.0f} |", flush=True)


if __name__ == "__main__":
    main()
