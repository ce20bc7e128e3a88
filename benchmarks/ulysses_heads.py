"""Ulysses over a head count the degree does not divide: the cost of the uneven split, side by side with even head
counts and with the alternative of padding the heads to a multiple of the degree (zero heads, an even exchange).

Each row runs ``U`` spawned CPU processes (gloo, one torch thread each) of Ulysses ``U`` on a sequence of S tokens:
``USPAttention`` forward + backward (fp32, torch_flash), and the exchange alone (the all-to-all of q, k, v to heads and
of the output back, with their backward). ``padded`` puts ``ceil(H / U) * U - H`` zero heads on q, k, v, attends
over all of them with the even exchange and drops them from the output: what a padding implementation would do.

    python benchmarks/ulysses_heads.py --seq 2048 --ulysses 2 --heads 8 7 6

Columns: the best wall time per step (slowest rank) over every round and repeat, that time per real head, and the imbalance
``ringdit.parallel.head_imbalance`` predicts (the busiest rank's heads over the mean).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ringdit.attention import USPAttention
from ringdit.parallel import all_to_all, head_counts, head_imbalance, init_sequence_parallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_ranks import free_port  # noqa: E402


def run_rank(rank, world, port, heads, method, seq, head_size, repeat, queue):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dims = init_sequence_parallel(1, world)
    placed = -(-heads // world) * world if method == "padded" else heads  # the heads the layer sees
    attn = USPAttention(placed, head_size, backend="torch_flash", dims=dims)
    g = torch.Generator().manual_seed(rank)
    q, k, v, dout = (torch.randn(1, seq // world, heads, head_size, generator=g) for _ in range(4))

    def pad(t):  # zero heads at the end of dim 2
        return F.pad(t, (0, 0, 0, placed - heads)) if placed > heads else t

    def attention_step():
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attn(*(pad(t) for t in inputs))[:, :, :heads]
        out.backward(dout)

    def exchange_step():
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        held = attn._sequence_to_heads(*(pad(t) for t in inputs), dims)[0]
        back = all_to_all(held, dims.ulysses_group, scatter_dim=1, gather_dim=2, gather_sizes=attn.head_counts)
        back[:, :, :heads].backward(dout)

    results = []
    for step in (attention_step, exchange_step):
        step()  # warm-up
        best = float("inf")
        for _ in range(repeat):
            dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            best = min(best, elapsed.item())
        results.append(best)
    if rank == 0:
        queue.put(tuple(results))
    dist.destroy_process_group()


def measure(heads, method, ulysses, seq, head_size, repeat):
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(run_rank, args=(ulysses, free_port(), heads, method, seq, head_size, repeat, queue),
                       nprocs=ulysses, start_method="spawn")
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--ulysses", type=int, default=2)
    parser.add_argument("--heads", type=int, nargs="+", default=[8, 7, 6])
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3,
                        help="measure every row this many times, interleaved, and keep its best (a shared machine)")
    args = parser.parse_args()
    U = args.ulysses
    cases = [(heads, method) for heads in args.heads for method in (["split"] if heads % U == 0 else
                                                                      ["split", "padded"])]
    best = {case: (float("inf"), float("inf")) for case in cases}
    load = os.getloadavg()[0]
    for _ in range(args.rounds):  # interleaved: a burst of another process's load hits every row alike
        for case in cases:
            measured = measure(*case, U, args.seq, args.head_size, args.repeat)
            best[case] = tuple(min(a, b) for a, b in zip(best[case], measured))
    print(f"Ulysses {U}: USPAttention forward + backward and the exchange alone, S={args.seq} D={args.head_size} "
          f"fp32, torch_flash, 1 thread per rank, {os.cpu_count()} CPU cores, load {load:.1f} to "
          f"{os.getloadavg()[0]:.1f}, best of {args.rounds} x {args.repeat}\n")
    print("| heads | split over the ranks | method | attention fwd+bwd (s) | per real head (ms) | exchange fwd+bwd "
          "(ms) | predicted imbalance |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for heads, method in cases:
        attention, exchange = best[heads, method]
        placed = -(-heads // U) * U if method == "padded" else heads
        split = " + ".join(map(str, head_counts(placed, U)))
        kind = "even" if heads % U == 0 else ("uneven (all-to-all-v)" if method == "split" else
                                              f"padded to {placed} (zero heads)")
        print(f"| {heads} | {split} | {kind} | {attention:.3f} | {attention / heads * 1e3:.1f} | "
              f"{exchange * 1e3:.1f} | {head_imbalance(heads, U):.3f} |")


if __name__ == "__main__":
    main()
