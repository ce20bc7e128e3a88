"""Train-step and sampling-step time of a Wan-shaped diffusers transformer: one process vs ring attention over N.

    python benchmarks/wan_step.py                          # Wan 1.3B's width and heads, 2 layers, 8192 video tokens
    python benchmarks/wan_step.py --ranks 1 2 --layers 2 --frames 8 --size 64

The real head size (128) and width (12 heads = 1536) with few layers, so it runs in CPU time; latents (16, T, H, W)
with 2x2 spatial patches give T x H/2 x W/2 tokens; 512 text tokens of width 4096 (UMT5). Every rank runs one
thread (gloo), so N ranks use N cores. A train step is forward + backward of the flow-matching loss; a sampling step
is one classifier-free-guided denoiser call (conditional and unconditional halves in one batch of 2).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                eps=1e-6, rope_max_seq_len=1024)


def worker(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
    from ringdit.models.diffusers import DiffusersTransformer
    from ringdit.parallel import init_sequence_parallel

    init_sequence_parallel(ring_degree=world)
    torch.manual_seed(0)
    shape = (args.frames, args.size, args.size)
    model = DiffusersTransformer("wan", config={**WAN_1_3B, "num_layers": args.layers}, input_size=shape,
                                 in_channels=16, text_len=512, text_dim=4096, attention_backend=args.backend)
    x = torch.randn(1, 16, *shape)
    t = torch.tensor([500.0])
    text = torch.randn(1, 512, 4096)

    def train_step():
        loss = model(x, t, {"text": text}).square().mean()
        loss.backward()

    @torch.no_grad()
    def sampling_step():
        model(torch.cat([x, x]), torch.cat([t, t]), {"text": torch.cat([text, torch.zeros_like(text)])})

    timings = {}
    for name, step in (("train", train_step), ("sample", sampling_step)):
        step()  # warm-up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        dist.barrier()
        timings[name] = (time.perf_counter() - start) / args.steps
    if rank == 0:
        results.put((world, timings, model.tokens_per_sample))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--size", type=int, default=64, help="latent H = W")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--backend", default="torch_flash")
    args = parser.parse_args()

    rows = []
    for world in args.ranks:
        ctx = mp.get_context("spawn")
        results = ctx.SimpleQueue()
        from tests.distributed import free_port

        mp.start_processes(worker, args=(world, free_port(), args, results), nprocs=world, start_method="spawn")
        rows.append(results.get())
    base = rows[0][1]
    print(f"Wan-shaped transformer: 12 heads x 128, {args.layers} layers, {rows[0][2]} video tokens + 512 text "
          f"tokens, backend {args.backend}, 1 thread per rank")
    print("| ranks (ring) | train step (s) | speed-up | sampling step, CFG batch 2 (s) | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    for world, timings, _ in rows:
        print(f"| {world} | {timings['train']:.2f} | {base['train'] / timings['train']:.2f}x | "
              f"{timings['sample']:.2f} | {base['sample'] / timings['sample']:.2f}x |")


if __name__ == "__main__":
    main()
