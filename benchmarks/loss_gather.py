"""What computing the loss on the gathered prediction costs, against a DiT train step at 4096 tokens per sample.

    python benchmarks/loss_gather.py                       # ring 4 on 4 CPU ranks (gloo), DiT-S width, 4 blocks
    python benchmarks/loss_gather.py --ring 2 --depth 12 --steps 5

Every model ringdit trains returns its whole prediction, gathered over the sequence-parallel group, and the loss is
the same code for all of them (``DiffusionModule.diffusion_loss``). The alternative that the DiT used before is a loss
on each rank's own tokens (``sharded_mean``), which needs no gather but a second, DiT-only loss path. This measures,
side by side in one run on the same ranks:

- **step**: forward + backward of the parallelized DiT, loss on the gathered prediction (what training does);
- **gathered loss**: the gather (all-gather), unpatchify and loss over the whole sample, forward + backward (the
  gather's backward is a reduce-scatter), on a tensor of the prediction's shape;
- **local loss**: the loss on this rank's tokens only, forward + backward (what the sharded loss cost).

The gathering's cost is ``gathered - local``; the table gives it as a share of the step. Times are medians over the
steps, the maximum over ranks; they only mean something on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ringdit, also in spawned ranks
from benchmarks.cpu_ranks import free_port  # noqa: E402


def timed(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
    try:
        from ringdit.models.build import build_model
        from ringdit.parallel import gather_sequence, init_sequence_parallel, shard_sequence

        dims = init_sequence_parallel(ring_degree=args.ring, ulysses_degree=args.ulysses)
        side = int(args.tokens**0.5) * args.patch  # a square image of `tokens` patches
        config = {"_target_": "ringdit.models.DiT", "input_size": side, "patch_size": args.patch, "in_channels": 4,
                  "hidden_size": args.hidden, "depth": args.depth, "num_heads": args.heads, "num_classes": 1000,
                  "learn_sigma": True}
        torch.manual_seed(0)
        model, _ = build_model(config, dims=dims)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch, 4, side, side, generator=g)
        t, y = torch.rand(args.batch, generator=g) * 1000, torch.randint(0, 1000, (args.batch,), generator=g)
        target = torch.randn(args.batch, 8, side, side, generator=g)

        def step():
            model.zero_grad(set_to_none=True)
            (model(x, t, y) - target).square().mean().backward()

        tokens = (side // args.patch) ** 2
        width = args.patch**2 * 8  # patch_volume x out_channels
        full = torch.randn(args.batch, tokens, width, generator=g)  # (B, N, P * C_out), as the final layer's output
        local = shard_sequence(full, dims=dims).clone().requires_grad_()  # (B, N_local, P * C_out)
        target_tokens = shard_sequence(torch.randn_like(full), dims=dims)  # this rank's target tokens
        grid = (side // args.patch, side // args.patch)

        def gathered_loss():
            local.grad = None
            whole = gather_sequence(local, length=tokens, dims=dims)  # (B, N, P * C_out)
            (model.unpatchify(whole, grid) - target).square().mean().backward()

        def local_loss():
            local.grad = None
            ((local - target_tokens).square().sum() / full.numel()).backward()

        step()  # warm-up: first-call allocations
        rows = {name: timed(function, args.steps) for name, function in
                (("step", step), ("gathered loss", gathered_loss), ("local loss", local_loss))}
        slowest = [None] * world
        dist.all_gather_object(slowest, rows)
        if rank == 0:
            results.put({name: max(r[name] for r in slowest) for name in rows})
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ring", type=int, default=4)
    parser.add_argument("--ulysses", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per sample (a square grid)")
    parser.add_argument("--patch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    world = args.ring * args.ulysses
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(measure, args=(world, free_port(), args, results), nprocs=world, start_method="spawn")
    row = results.get()
    cost = row["gathered loss"] - row["local loss"]
    print(f"DiT width {args.hidden}, {args.depth} blocks, {args.tokens} tokens x batch {args.batch}, ring {args.ring} x "
          f"ulysses {args.ulysses} on {world} CPU ranks (gloo), {args.threads} thread(s) each")
    print("| step (ms) | gathered loss (ms) | local loss (ms) | gathering's cost | share of the step |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {row['step'] * 1e3:.1f} | {row['gathered loss'] * 1e3:.2f} | {row['local loss'] * 1e3:.2f} | "
          f"{cost * 1e3:.2f} ms | {cost / row['step']:.2%} |")


if __name__ == "__main__":
    main()
