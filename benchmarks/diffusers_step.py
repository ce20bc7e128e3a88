"""Train-step and sampling-step time of a Wan- or Flux-shaped diffusers transformer: one process vs ring over N.

    python benchmarks/diffusers_step.py --family wan     # Wan 1.3B's width and heads, 2 layers, 8192 video tokens
    python benchmarks/diffusers_step.py --family flux    # Flux's width and heads, 1 dual + 1 single block, 8192 image
                                                         # tokens + 512 text tokens
    python benchmarks/diffusers_step.py --family flux --cfg-parallel   # one image's sampling step: CFG on 2 ranks
    python benchmarks/diffusers_step.py --family hunyuan_video15   # HunyuanVideo 1.5's width and heads, 2 layers,
                                                  # 8192 video tokens (1x1 patches of 8 x 32 x 32) + 514 text tokens

The real head size (128) and widths (Wan: 12 heads = 1536; Flux: 24 heads = 3072) with few layers, so it runs in
CPU time; 512 text tokens of width 4096 (UMT5 / T5). Every rank runs one thread (gloo), so N ranks use N cores. A
train step is forward + backward of the flow-matching loss; a sampling step is one classifier-free-guided denoiser
call (conditional and unconditional halves in one batch of 2, or, with --cfg-parallel at 2 ranks, one half each).
`--only sample` times the sampling step alone (the untimed --warmup steps fault the heap in).

Every rank keeps freed activations in its heap (glibc's mmap and trim thresholds, set before the ranks are spawned),
as PyTorch's CUDA caching allocator does on a GPU. Without it each large activation is a fresh mmap whose pages are
faulted in on first touch, and on this VM the page faults of concurrent ranks serialize: an elementwise op such as
GELU then took as long at 2 ranks on half the tokens as at 1 rank on all of them. One and N ranks run alike.
The heap reaches its steady layout only after two steps (the second still faults in about 1.5 GiB at 2 ranks, whose
page faults serialize, the third almost none), so two untimed steps come first; the table's last column counts the
page faults of the timed steps on rank 0, near 0 in a steady state.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
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
HUNYUAN_VIDEO15 = dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128,
                       num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm",
                       text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0,
                       rope_axes_dim=(16, 56, 56), target_size=640, task_type="t2v")
FLUX_DEV = dict(patch_size=1, in_channels=64, attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 56, 56])


def build(args, dims):
    """(model, latents x, conditioning) of the benchmarked shape, the same on every rank."""
    from ringdit.models.build import build_model

    torch.manual_seed(0)
    target = {"_target_": "ringdit.models.diffusers.DiffusersTransformer"}
    if args.family == "wan":
        shape = (args.frames, args.size, args.size)
        model, _ = build_model({**target, "family": "wan", "config": {**WAN_1_3B, "num_layers": args.layers},
                                "input_size": shape, "in_channels": 16, "text_len": 512, "text_dim": 4096},
                               dims=dims, backend=args.backend)
        return model, torch.randn(1, 16, *shape), {"text": torch.randn(1, 512, 4096)}
    if args.family == "hunyuan_video15":  # 1x1 patches: half Wan's latent size gives Wan's token count
        shape = (args.frames, args.size // 2, args.size // 2)
        model, _ = build_model({**target, "family": "hunyuan_video15",
                                "config": {**HUNYUAN_VIDEO15, "num_layers": args.layers}, "input_size": shape,
                                "in_channels": 32, "text_len": 512, "text_dim": 3584}, dims=dims, backend=args.backend)
        mask = torch.arange(512)[None] < 384  # (1, 512) Qwen2.5-VL states of a 384-token prompt, padded
        return model, torch.randn(1, 32, *shape), {"text": torch.randn(1, 512, 3584) * mask[..., None],
                                                   "text_mask": mask}
    shape = (args.size, 2 * args.size)  # 16-channel latents, 2x2-packed: size/2 x size tokens
    config = {**FLUX_DEV, "num_layers": args.layers // 2, "num_single_layers": args.layers - args.layers // 2}
    model, _ = build_model({**target, "family": "flux", "config": config, "input_size": shape, "in_channels": 16,
                            "text_len": 512, "text_dim": 4096, "pooled_dim": 768, "guidance": 3.5},
                           dims=dims, backend=args.backend)
    return model, torch.randn(1, 16, *shape), {"text": torch.randn(1, 512, 4096), "pooled": torch.randn(1, 768)}


def worker(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
    from ringdit.parallel import exchange_guidance_halves, init_sequence_parallel

    cfg_parallel = args.cfg_parallel and world == 2
    dims = init_sequence_parallel(ring_degree=1 if cfg_parallel else world, cfg_parallel=cfg_parallel)
    model, x, cond = build(args, dims)
    t = torch.tensor([500.0])
    null = {key: torch.zeros_like(value) for key, value in cond.items()}

    def train_step():
        loss = model(x, t, cond).square().mean()
        loss.backward()

    @torch.no_grad()
    def sampling_step():
        if cfg_parallel:  # this rank's half of guidance, then the exchange
            exchange_guidance_halves(model(x, t, null if dims.cfg_rank else cond), dims)
        else:
            model(torch.cat([x, x]), torch.cat([t, t]), {k: torch.cat([cond[k], null[k]]) for k in cond})

    timings, faults = {}, 0
    steps = (("sample", sampling_step),) if cfg_parallel else (("train", train_step), ("sample", sampling_step))
    steps = tuple(step for step in steps if args.only in (None, step[0]))
    for name, step in steps:
        for _ in range(args.warmup):
            step()
        dist.barrier()
        faults -= resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        dist.barrier()
        timings[name] = (time.perf_counter() - start) / args.steps
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    if rank == 0:
        results.put((world, timings, model.tokens_per_sample, faults))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("wan", "flux", "hunyuan_video15"), default="wan")
    parser.add_argument("--cfg-parallel", action="store_true", help="at 2 ranks: the guidance halves on 2 ranks")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--size", type=int, default=64, help="Wan: latent H = W; Flux: latent H (W = 2 H)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the heap settles in two)")
    parser.add_argument("--backend", default="torch_flash")
    parser.add_argument("--only", choices=("train", "sample"), help="time one of the two steps")
    args = parser.parse_args()
    # keep freed activations in each rank's heap (read by glibc when a rank starts; see the docstring)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 34))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 34))

    # Wan's text is cross-attention keys, not tokens of the sequence; HunyuanVideo 1.5 joins a masked ByT5 and image
    # token to its 512 text tokens
    text = {"wan": 0, "flux": 512, "hunyuan_video15": 514}[args.family]
    width = {"wan": "12 heads x 128", "flux": "24 heads x 128", "hunyuan_video15": "16 heads x 128"}[args.family]
    base = None
    for world in args.ranks:  # each row printed as it is measured: a later rank count that fails loses no row
        ctx = mp.get_context("spawn")
        results = ctx.SimpleQueue()
        mp.start_processes(worker, args=(world, free_port(), args, results), nprocs=world, start_method="spawn")
        world, timings, tokens, faults = results.get()
        if base is None:
            base = timings
            print(f"{args.family}-shaped transformer: {width}, {args.layers} layers, {tokens} image/video tokens + "
                  f"{text or 512} text tokens, backend {args.backend}, 1 thread per rank"
                  f"{', CFG parallel at 2 ranks' if args.cfg_parallel else ''}")
            print("| ranks | tokens per rank | train step (s) | speed-up | sampling step, CFG (s) | speed-up | page faults |")
            print("|---:|---:|---:|---:|---:|---:|---:|")
        train, sample = timings.get("train"), timings.get("sample")
        train_cells = f"{train:.2f} | {base['train'] / train:.2f}x" if train and "train" in base else "- | -"
        sample_cells = f"{sample:.2f} | {base['sample'] / sample:.2f}x" if sample and "sample" in base else "- | -"
        sp = 1 if args.cfg_parallel else world
        print(f"| {world} | {tokens_per_rank(tokens, text, sp)} | {train_cells} | {sample_cells} | {faults} |", flush=True)
    if args.family == "flux":
        print("\nTokens each rank computes per step, Flux at 1024x1024 (4096 image + 512 text tokens):")
        print("| ring | text sharded with the image | text replicated (before) |")
        print("|---:|---:|---:|")
        for ring in (1, 2, 4, 8):
            print(f"| {ring} | {tokens_per_rank(4096, 512, ring)} | {-(-4096 // ring) + 512} |")


def tokens_per_rank(tokens: int, text: int, ranks: int) -> int:
    """Image and text tokens one rank holds: each stream split into equal chunks, padded at its tail."""
    return -(-tokens // ranks) + -(-text // ranks)

if __name__ == "__main__":
    main()
