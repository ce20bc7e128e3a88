"""Throughput of ``ringdit.media.encode_folder`` (``python -m ringdit.prepare``) with tiny random models (nothing
downloaded): files encoded per second.

    python benchmarks/prepare_throughput.py [--images 64] [--videos 16] [--size 64] [--frames 17]

Builds a tiny AutoencoderKL, a tiny Wan VAE (AutoencoderKLWan, base_dim 3 as in diffusers' tests), a one-layer T5
encoder and a word-level tokenizer, writes random PNGs and MP4s with captions, and times prepare on each set. What it
measures on tiny models is the pipeline's own overhead (decoding files, resizing, tokenizing, writing shards), the
floor under real VAE and encoder time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_models(root: Path) -> None:
    from diffusers import AutoencoderKL, AutoencoderKLWan
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    torch.manual_seed(0)
    words = ["<pad>", "</s>", "<unk>", "a", "red", "fox", "running", "blue", "cat"]
    tokenizer = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                     temperal_downsample=[False, True, True]).save_pretrained(root / "wan" / "vae")
    AutoencoderKL(block_out_channels=[8, 8], down_block_types=["DownEncoderBlock2D"] * 2,
                  up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4,
                  norm_num_groups=4).save_pretrained(root / "sd" / "vae")
    encoder = T5EncoderModel(T5Config(vocab_size=len(words), d_model=16, d_ff=32, d_kv=4, num_layers=1, num_heads=2))
    for name in ("wan", "sd"):
        encoder.save_pretrained(root / name / "text_encoder")
        fast.save_pretrained(root / name / "tokenizer")


def write_inputs(root: Path, images: int, videos: int, size: int, frames: int) -> None:
    import imageio.v3 as iio
    from PIL import Image

    rng = np.random.default_rng(0)
    (root / "images").mkdir()
    (root / "videos").mkdir()
    for i in range(images):
        picture = rng.integers(0, 256, (size, size * 3 // 2, 3), dtype=np.uint8)  # wider than the bucket: cropped
        Image.fromarray(picture).save(root / "images" / f"{i}.png")
        (root / "images" / f"{i}.txt").write_text("a red fox")
    for i in range(videos):
        clip = rng.integers(0, 256, (frames, size, size * 3 // 2, 3), dtype=np.uint8)
        iio.imwrite(root / "videos" / f"{i}.mp4", clip, plugin="pyav", codec="libx264", fps=8)
        (root / "videos" / f"{i}.txt").write_text("a blue cat running")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--videos", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--frames", type=int, default=17)
    args = parser.parse_args()
    from ringdit.media.encode_folder import encode_folder

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_models(root)
        write_inputs(root, args.images, args.videos, args.size, args.frames)
        print(f"{'set':<34} {'files':>6} {'seconds':>8} {'files/s':>8}")
        for name, folder, models, extra in (
            (f"images {args.size}x{args.size}, AutoencoderKL", "images", "sd", {}),
            (f"videos {args.frames}x{args.size}x{args.size}, Wan VAE", "videos", "wan", {"frames": args.frames}),
        ):
            if not any((root / folder).iterdir()):  # --images 0 or --videos 0: that set is not measured
                continue
            report = encode_folder(str(root / folder), str(root / f"out-{folder}"), str(root / models),
                                   str(root / models), size=args.size, max_text_len=32, shard_size=16,
                                   batch_size=8, progress=False,
                                   tiling=False,  # the tiny VAEs' tile size is 32 px; a real VAE tiles above 256-1024
                                   **extra)
            print(f"{name:<34} {report.samples:>6} {report.seconds:>8.2f} {report.samples / report.seconds:>8.2f}")


if __name__ == "__main__":
    main()
