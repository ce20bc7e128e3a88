"""Model-state memory per rank (parameters + gradients + AdamW state) and train-step time: DDP vs FSDP vs LoRA, for
a Wan-1.3B-shaped transformer (width 1536 = 12 heads x 128, FFN 8960, text width 4096; a few layers) on CPU ranks.

    python benchmarks/fsdp_memory.py                 # worlds 1, 2, 4; 2 layers
    python benchmarks/fsdp_memory.py --layers 4 --worlds 1 2 --steps 3

Model-state bytes are counted from this rank's tensors (an FSDP parameter's local shard), so they are exact and
machine-independent. "peak" is the process's RSS high-water mark during the steps minus before building the model
(CPU has no allocator statistics; on GPU read torch.cuda.max_memory_allocated instead). Times are wall-clock medians
and only mean something on a quiet machine. The last lines extrapolate, from the measured bytes per parameter, the
largest Wan width x depth that fits a per-process budget at world 4.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ringdit, also in spawned ranks
from benchmarks.cpu_ranks import free_port  # noqa: E402

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                eps=1e-6, rope_max_seq_len=1024)
LATENTS = (2, 8, 8)  # (T, H, W) default: 32 tokens; memory here is about model state, not activations
TEXT_LEN = 16


def local_bytes(tensor: torch.Tensor) -> int:
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.numel() * tensor.element_size()


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optim": states}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(rank: int, world: int, port: int, mode: str, layers: int, steps: int, latents: tuple, results
            ) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1200))
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel

        from ringdit.models.build import build_model
        from ringdit.parallel import init_sequence_parallel
        from ringdit.models import repeated_blocks

        dims = init_sequence_parallel(ring_degree=world)  # the sequence over all ranks: the layout FSDP shards across
        before = rss_mb()
        torch.manual_seed(0)
        mesh = dims.mesh._flatten("world") if mode.endswith("fsdp") else None  # every rank of (dp, ring, ulysses)

        def shard(model):
            for block in repeated_blocks(model):
                fully_shard(block, mesh=mesh)
            return fully_shard(model, mesh=mesh)

        model, _ = build_model(
            {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "wan",
             "config": {**WAN_1_3B, "num_layers": layers}, "input_size": latents, "in_channels": 16,
             "text_len": TEXT_LEN, "text_dim": 4096},
            dims=dims, lora={"rank": 64} if mode.startswith("lora") else None, shard=shard if mesh is not None else None)
        train = model if mesh is not None or world == 1 else DistributedDataParallel(model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(1, 16, *latents, generator=g)
        cond = {"text": torch.randn(1, TEXT_LEN, 4096, generator=g)}
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            loss = train(x, torch.tensor([500.0]), cond).square().mean()
            loss.backward()
            optimizer.step()
            if _ < steps - 1:
                optimizer.zero_grad(set_to_none=False)
            times.append(time.perf_counter() - start)
        memory = model_state_bytes(model, optimizer)
        parameters = sum(p.numel() for p in model.parameters())
        if rank == 0:
            results.put({"mode": mode, "world": world, **memory, "peak_mb": rss_mb() - before,
                         "step_s": statistics.median(times[1:] or times), "parameters": parameters})
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["ddp", "fsdp", "lora_ddp", "lora_fsdp"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--latents", type=int, nargs=3, default=list(LATENTS), metavar=("T", "H", "W"),
                        help="latent size: more tokens make the step compute-bound, as on a real model")
    parser.add_argument("--budget_gb", type=float, default=80.0, help="per-process memory for the extrapolation")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for world in args.worlds:
        for mode in args.modes:
            results = ctx.SimpleQueue()
            mp.start_processes(measure, args=(world, free_port(), mode, args.layers, args.steps, tuple(args.latents),
                                              results),
                               nprocs=world, start_method="spawn")
            rows.append(results.get())
    mib = 2**20
    print(f"Wan-1.3B-shaped transformer, {args.layers} layers, {rows[0]['parameters'] / 1e6:.1f} M parameters, "
          f"AdamW, fp32, latents {tuple(args.latents)}")
    print(f"{'mode':<10}{'world':>6}{'params MiB':>12}{'grads MiB':>11}{'optim MiB':>11}{'state MiB':>11}"
          f"{'vs DDP x world':>16}{'peak RSS MiB':>14}{'step s':>8}")
    ddp = {r["world"]: r["params"] + r["grads"] + r["optim"] for r in rows if r["mode"] == "ddp"}
    for r in rows:
        state = r["params"] + r["grads"] + r["optim"]
        ratio = f"{state * r['world'] / ddp[r['world']]:.3f}" if r["world"] in ddp else "-"
        print(f"{r['mode']:<10}{r['world']:>6}{r['params'] / mib:>12.1f}{r['grads'] / mib:>11.1f}"
              f"{r['optim'] / mib:>11.1f}{state / mib:>11.1f}{ratio:>16}{r['peak_mb']:>14.0f}{r['step_s']:>8.2f}")
    # Extrapolation: bytes per parameter of model state (fp32 weights + grads + 2 AdamW moments = 16 B replicated).
    per_param = {m: next((r["params"] + r["grads"] + r["optim"]) * r["world"] / r["parameters"]
                         for r in rows if r["mode"] == m and r["world"] == max(args.worlds)) for m in ("ddp", "fsdp")
                 if any(r["mode"] == m for r in rows)}
    world = max(args.worlds)
    budget = args.budget_gb * 2**30 * 0.7  # 30% kept for activations, buffers, fragmentation
    for mode, bytes_per in per_param.items():
        largest = budget / (bytes_per / world)  # bytes_per sums all ranks: each holds bytes_per / world
        print(f"{mode}: {bytes_per:.1f} B of model state per parameter over all {world} ranks -> at world {world} "
              f"with {args.budget_gb:.0f} GB per process (70% for model state) up to {largest / 1e9:.1f} B parameters "
              f"(Wan 1.3B: 1.4 B; Wan 14B: 14.3 B)")


if __name__ == "__main__":
    main()
