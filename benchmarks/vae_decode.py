"""Peak memory of decoding a long video with a Wan VAE: whole frames vs spatial tiles (ringdit.media.VAE).

    python benchmarks/vae_decode.py                          # CPU: a small random Wan VAE, 33 frames at 256x256
    python benchmarks/vae_decode.py --device cuda --real     # GPU: Wan 2.1's VAE shape (random weights), 81 x 480x832
    python benchmarks/vae_decode.py --ranks 1 2              # wall time, tiles split over 1 vs 2 gloo CPU ranks
    python benchmarks/vae_decode.py --encode --ranks 1 2     # the same for encoding the clip (what prepare does)

The VAE is built from a config with random weights (nothing is downloaded): the memory depends on the shapes, not
on the weights. Peak = the largest total size of live tensors during ``VAE.decode`` beyond what was live before
(``PeakTensorMemory``, any device), and on CUDA also the allocator's peak (``max_memory_allocated``). The untiled
decode already works one latent frame at a time (the VAE is causal with a feature cache), so what tiling bounds
is the per-frame activation size; the output itself (3 x T x H x W floats) is the floor either way.

``--ranks R1 R2 ...``: the tile-parallel decode (``VAE.decode(group=)``, ``ringdit.media.parallel_vae``) on R spawned
CPU processes joined by gloo, one thread each, the first ``--tiles`` size; wall time on rank 0 (which receives and
blends every tile) from a barrier to the finished video, its speed-up over the first rank count, and the largest
difference from its pixels (0 expected: the same kernels, the same blending). On an idle 2-core machine (load 0.7
at the start, nothing else running), 33 x 256x256, base_dim 16, 9 tiles of 128 px: 1 rank 41.6 s, 2 ranks 20.9 s
(1.99x), max |diff| 0.

``--encode``: the same measurements for ``VAE.encode`` of the clip's pixels (uniform noise in [-1, 1], as large as
the video above) instead of decoding its latents: what ``python -m ringdit.prepare`` runs per clip, and with
``--ranks``, what ``parallel_vae=true`` splits over the ranks (``VAE.encode(group=, dst=0)``). Peak memory of
the encode is measured the same way; max |diff| is then in normalised latents.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensor_memory import PeakTensorMemory  # noqa: E402

from ringdit.media.vae import VAE  # noqa: E402

MiB = 2**20


def build(folder: Path, real: bool, base_dim: int) -> None:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    config = {} if real else dict(base_dim=base_dim, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                  temperal_downsample=[False, True, True])
    AutoencoderKLWan(**config).save_pretrained(folder)  # no arguments: Wan 2.1's VAE shape


def code(vae: VAE, x: torch.Tensor, encode: bool, group=None) -> torch.Tensor | None:
    """``vae.encode(pixels)`` or ``vae.decode(latents)``, the result on rank 0 of ``group`` (None: this process)."""
    return vae.encode(x, group=group, dst=0) if encode else vae.decode(x, group=group)


def measure(vae: VAE, latents: torch.Tensor, encode: bool = False) -> dict:
    if vae.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with PeakTensorMemory() as memory:
        pixels = code(vae, latents, encode)
    result = {"seconds": time.perf_counter() - start, "tensor_peak": memory.peak_bytes, "pixels": pixels}
    if vae.device.type == "cuda":
        torch.cuda.synchronize()
        result["allocator_peak"] = torch.cuda.max_memory_allocated() - before
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--real", action="store_true", help="Wan 2.1's VAE shape (base_dim 96), 81 x 480x832")
    parser.add_argument("--base-dim", type=int, default=16)
    parser.add_argument("--size", type=int, nargs=2, default=None, help="pixel height and width")
    parser.add_argument("--frames", type=int, default=None, help="pixel frames (1 + 4k)")
    parser.add_argument("--tiles", type=int, nargs="+", default=[128], help="tile sizes (pixels) to compare")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--encode", action="store_true", help="time VAE.encode of the video instead of decode")
    parser.add_argument("--ranks", type=int, nargs="+", default=None,
                        help="compare the tile-parallel decode over these CPU rank counts (e.g. --ranks 1 2)")
    args = parser.parse_args()
    height, width = args.size or ((480, 832) if args.real else (256, 256))
    frames = args.frames or (81 if args.real else 33)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 1 + (frames - 1) // 4, height // 8, width // 8, generator=generator)  # (1, C, T, H, W)
    if args.encode:  # the input is the video itself, (1, 3, T, H, W) in [-1, 1] (named latents below all the same)
        latents = torch.rand(1, 3, frames, height, width, generator=generator) * 2 - 1
    warm = latents[:, :, :1] if args.encode else latents[:, :, :2]  # one pixel frame / two latent frames

    if args.ranks:
        return compare_ranks(args, latents)
    with tempfile.TemporaryDirectory() as folder:
        build(Path(folder), args.real, args.base_dim)
        rows = []
        for tile in [None, *args.tiles]:
            vae = VAE(folder, None, device=args.device, dtype=dtype, tiling=tile is not None, tile=tile)
            measure(vae, warm, args.encode)  # warm-up: kernels, allocator
            result = measure(vae, latents.to(args.device), args.encode)
            rows.append((f"tiles {tile}px" if tile else "whole frames", result))
            del vae
    reference = rows[0][1]["pixels"]
    output_mib = reference.numel() * 4 / MiB
    what, given, made = ("encode", "video", "latents") if args.encode else ("decode", "latents", "video")
    print(f"Wan VAE {what}, {'real shape' if args.real else f'base_dim {args.base_dim}'}, {args.dtype}, "
          f"{args.device}: {given} {tuple(latents.shape)} -> {made} {tuple(reference.shape)} "
          f"(the float32 output alone: {output_mib:.0f} MiB)")
    header = f"{what:<16} {'peak tensors MiB':>17} {'allocator MiB':>14} {'seconds':>8} {'max |diff|':>11}"
    print(header + "\n" + "-" * len(header))
    for name, result in rows:
        allocator = f"{result['allocator_peak'] / MiB:.0f}" if "allocator_peak" in result else "-"
        diff = (result["pixels"] - reference).abs().max().item()
        peak, seconds = result["tensor_peak"] / MiB, result["seconds"]
        print(f"{name:<16} {peak:>17.0f} {allocator:>14} {seconds:>8.2f} {diff:>11.3f}")


def _rank(rank: int, world: int, port: int, folder: str, tile: int, latents: torch.Tensor, result: str,
          encode: bool) -> None:
    import datetime
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
    try:
        vae = VAE(folder, None, tile=tile)
        group = dist.group.WORLD if world > 1 else None
        code(vae, latents[:, :, :1] if encode else latents[:, :, :2], encode, group)  # warm-up
        dist.barrier()
        start = time.perf_counter()
        pixels = code(vae, latents, encode, group)
        seconds = time.perf_counter() - start
        if rank == 0:
            from ringdit.media.parallel_vae import decode_grid, encode_grid

            grid = encode_grid if encode else decode_grid
            tiles = len(grid(vae.model, latents).tiles())
            torch.save({"seconds": seconds, "pixels": pixels, "tiles": tiles},
                       result)
    finally:
        dist.destroy_process_group()


def compare_ranks(args, latents: torch.Tensor) -> None:
    """The tile-parallel decode on each of ``args.ranks`` CPU rank counts (one thread per rank)."""
    import socket

    import torch.multiprocessing as mp

    tile = args.tiles[0]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        build(Path(folder), args.real, args.base_dim)
        for world in args.ranks:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            result = str(Path(folder) / f"result-{world}.pt")
            mp.start_processes(_rank, args=(world, port, folder, tile, latents, result, args.encode), nprocs=world,
                               start_method="spawn")
            rows.append((world, torch.load(result)))
    first_seconds, reference = rows[0][1]["seconds"], rows[0][1]["pixels"]
    what = f"encode, {rows[0][1]['tiles']} pixel tiles of {tile}px: video {tuple(latents.shape)} -> latents" \
        if args.encode else f"decode, {rows[0][1]['tiles']} tiles of {tile}px: latents {tuple(latents.shape)} -> video"
    print(f"Wan VAE tile-parallel {what} {tuple(reference.shape)}, base_dim {args.base_dim}, float32, CPU (gloo, "
          f"1 thread per rank)")
    header = f"{'ranks':>5} {'seconds':>8} {'speed-up':>9} {'max |diff|':>11}"
    print(header + "\n" + "-" * len(header))
    for world, result in rows:
        diff = (result["pixels"] - reference).abs().max().item()
        print(f"{world:>5} {result['seconds']:>8.2f} {first_seconds / result['seconds']:>8.2f}x {diff:>11.2e}")


if __name__ == "__main__":
    main()
