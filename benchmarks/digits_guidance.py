"""Samples of a digits DiT with a guidance input (``model.guidance_embed=true``) at chosen guidance scales, one
forward a step, written as infer.py's ``samples.npz`` for ``benchmarks/digits_accuracy.py`` to judge; or, with
``--cfg``, the same model's classifier-free guidance at those scales (two forwards a step, its guidance input at 1):
what the guidance input should reproduce.

    python benchmarks/digits_guidance.py outputs/train/runs/<run>/checkpoints/last.ckpt --scales 1 3 \\
        --labels 0 1 2 3 4 --num-samples 500 --out outputs/guidance
    python benchmarks/digits_accuracy.py outputs/guidance/scale_3.npz

    python benchmarks/digits_guidance.py --compare outputs/guidance/scale_3.npz outputs/guidance/cfg_3.npz

``--compare`` gives the Frechet distance between two sample sets on the real digits' top 16 PCA components (as
digits_accuracy.py measures samples against the real digits): how far a guidance input's samples at a scale lie from
the model's classifier-free guidance at that scale. (infer.py samples such a model at the scale its run recorded,
``model.guidance``; this script sets the model's ``guidance`` for each scale in turn.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ringdit
import ringdit  # noqa: E402


def compare(first: str, second: str) -> float:
    """Frechet distance between two samples.npz's images on the real digits' top 16 PCA components."""
    from sklearn.datasets import load_digits
    from sklearn.decomposition import PCA

    from benchmarks.digits_accuracy import frechet_distance

    pca = PCA(16, random_state=0).fit(load_digits().data)
    images = [np.load(path, allow_pickle=False)["images"][..., 0] for path in (first, second)]  # data, never code
    features = [pca.transform(x.reshape(-1, 64).astype(np.float64) / 255.0 * 16.0)  # the real digits' 0..16 scale
                for x in images]
    return frechet_distance(*features)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt", nargs="?", help="a training checkpoint of a DiT with model.guidance_embed=true")
    parser.add_argument("--compare", nargs=2, metavar="NPZ", help="the distance between two sample sets instead")
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--labels", type=int, nargs="+", default=list(range(10)), help="cycled over the samples")
    parser.add_argument("--num-samples", type=int, default=500)
    parser.add_argument("--steps", type=int, default=None, help="the sampler's steps (default: the checkpoint's)")
    parser.add_argument("--cfg", action="store_true", help="classifier-free guidance at each scale instead")
    parser.add_argument("--out", default="outputs/guidance")
    args = parser.parse_args()
    if args.compare:
        print(f"Frechet distance {compare(*args.compare):.2f}: {args.compare[0]} vs {args.compare[1]}")
        return
    pipe = ringdit.load(args.ckpt, device="cpu")
    if not getattr(pipe.model, "takes_guidance", False) and not args.cfg:
        parser.error(f"{args.ckpt} is a model without a guidance input (model.guidance_embed); sample it with --cfg")
    labels = [args.labels[i % len(args.labels)] for i in range(args.num_samples)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for scale in args.scales:
        if getattr(pipe.model, "takes_guidance", False):
            pipe.model.guidance = 1.0 if args.cfg else scale
        start = time.perf_counter()
        with torch.inference_mode():
            images = pipe(labels=labels, steps=args.steps, cfg_scale=scale if args.cfg else 1.0, output="tensor")
        name = out / f"{'cfg' if args.cfg else 'scale'}_{scale:g}.npz"
        np.savez(name, images=images.numpy(), labels=np.asarray(labels, dtype=np.int64))
        print(f"{name}: {len(labels)} samples in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
