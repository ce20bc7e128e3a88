"""Step caching's speed against its quality, for a trained digits checkpoint: the class-conditional DiT of ``python
train.py``, or the text-to-video Wan of ``python train.py experiment=captioned_moving_digits``.

    python benchmarks/step_cache.py CKPT [--kinds fbcache teacache] [--thresholds 0.05 0.1 0.2] [--num-samples 500]

Samples the same labels and seeds with the cache off and at each threshold, and prints one row each: the model
evaluations that ran every block (the primary speed figure: it does not depend on what else the machine runs), the
wall clock, both speed-ups against cache off, the share of samples the digits classifier recognises as the requested
digit and the Frechet distance to the real digits on PCA features (both from benchmarks/digits_accuracy.py), with
their change against cache off. Videos are prompted with the training data's held-out captions and judged as
digits_accuracy.py judges them (the brightest 8x8 window of each frame, a vote over frames); their Frechet distance
is the same PCA one over every frame's window. TeaCache needs coefficients: ``--calibrate`` fits them first (``python -m
ringdit.caching calibrate CKPT`` writes them beside the checkpoint; this uses the same code). The issue's target: a
threshold >= 1.6x faster in model evaluations and wall clock, recognised digits at most 1 point lower, Frechet
distance at most 10% higher.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits_accuracy import diversity, image_classifier, judge_videos, video_classifier, windows  # noqa: E402

from ringdit.caching import CacheSettings, StepCache, teacache_coefficients  # noqa: E402
from ringdit.caching.calibrate import calibrate, load_for_sampling  # noqa: E402
from ringdit.checkpoints.loading import safe_torch_load  # noqa: E402
from ringdit.models.conditioning import text_conditioned  # noqa: E402
from ringdit.media.images import to_uint8  # noqa: E402


def draw(sampler, condition, count: int, batch_size: int, cache: StepCache | None, overrides: dict) -> tuple:
    """(samples (N, [T,] H, W) on the digits' 0..16 scale, seconds) for ``condition``, sample i from seed i."""
    batches = []
    start = time.perf_counter()
    for first in range(0, count, batch_size):
        seeds = list(range(first, min(first + batch_size, count)))
        with sampler.using(step_cache=cache) as cached:  # a cache per batch, as infer.py's
            batches.append(cached.generate(_rows(condition, seeds), seeds, **overrides))
    seconds = time.perf_counter() - start
    return to_uint8(torch.cat(batches)).numpy()[..., 0].astype(np.float64) / 255.0 * 16.0, seconds


def _rows(condition, rows: list[int]):
    if isinstance(condition, dict):
        return {key: value[rows] for key, value in condition.items()}
    return condition[rows]


class Digits:
    """Class-conditional 8x8 digits: labels cycle through the classes."""

    def __init__(self, data: dict, count: int):
        self.labels = torch.arange(count) % data["num_classes"]
        self.condition, self.classifier = self.labels, image_classifier()

    def judge(self, images: np.ndarray) -> tuple[float, float]:
        """(% recognised as the requested digit, Frechet distance to the real digits)."""
        predicted = self.classifier.predict(images.reshape(len(images), -1))
        return 100.0 * float((predicted == self.labels.numpy()).mean()), diversity(images)[0]


class CaptionedVideos:
    """Text-to-video moving digits: the training data's held-out captions ("a 3 moving left")."""

    def __init__(self, data: dict, count: int):
        from ringdit.data.captioned_moving_digits import parse_caption
        from ringdit.data.text_latents import TextLatentsDataModule

        source = data["source"]
        data = TextLatentsDataModule(source["path"], val_fraction=source["val_fraction"], seed=source["seed"],
                                     check_values=False)
        self.condition, captions = data.held_out(count)
        self.digits = np.array([parse_caption(c)[0] for c in captions])
        frames, height = data["image_size"][:2]
        self.classifier = video_classifier(frames, height)

    def judge(self, videos: np.ndarray) -> tuple[float, float]:
        votes, _ = judge_videos(videos, self.classifier)
        frames = windows(videos).reshape(-1, 8, 8)  # every frame's brightest 8x8 window
        return 100.0 * float((votes == self.digits).mean()), diversity(frames)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt_path")
    parser.add_argument("--kinds", nargs="+", default=["fbcache", "teacache"], choices=["fbcache", "teacache"])
    parser.add_argument("--thresholds", nargs="+", type=float, default=[0.02, 0.05, 0.1, 0.15, 0.2, 0.3])
    parser.add_argument("--scope", default="sample", choices=["sample", "batch"])
    parser.add_argument("--num-samples", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--steps", type=int, default=None, help="default: the checkpoint's")
    parser.add_argument("--cfg-scale", type=float, default=None, help="default: the checkpoint's")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings on a shared "
                                                               "machine)")
    parser.add_argument("--calibrate", action="store_true", help="fit TeaCache's coefficients on this checkpoint "
                                                                 "first (64 samples)")
    args = parser.parse_args()
    print("$ python " + " ".join(shlex.quote(a) for a in sys.argv), flush=True)
    torch.set_num_threads(args.threads)
    hparams = safe_torch_load(args.ckpt_path, mmap=True)["hyper_parameters"]
    module = load_for_sampling(args.ckpt_path, hparams=hparams)  # a ringdit.sampling.Sampler
    task = (CaptionedVideos if text_conditioned(hparams["data"]) else Digits)(hparams["data"], args.num_samples)
    overrides = {"steps": args.steps, "cfg_scale": args.cfg_scale}
    settings = {**module.pipeline.settings, **{k: v for k, v in overrides.items() if v is not None}}

    coefficients = None
    if "teacache" in args.kinds:
        if args.calibrate:
            rows = list(range(min(64, args.num_samples)))
            coefficients = calibrate(module, _rows(task.condition, rows), [10_000 + i for i in rows], **overrides)
            print(f"calibrated TeaCache coefficients (seeds apart from the benchmark's): {list(coefficients)}")
        else:
            coefficients = teacache_coefficients(CacheSettings("teacache", 0.1), module.model, args.ckpt_path)

    draw(module, task.condition, min(8, args.num_samples), args.batch_size, None, overrides)  # warm-up
    base_images, base_seconds = draw(module, task.condition, args.num_samples, args.batch_size, None, overrides)
    base_accuracy, base_frechet = task.judge(base_images)
    per_batch = None
    rows = []
    for kind in args.kinds:
        for threshold in args.thresholds:
            cache = StepCache(CacheSettings(kind, threshold, scope=args.scope),
                              coefficients if kind == "teacache" else None)
            images, seconds = draw(module, task.condition, args.num_samples, args.batch_size, cache, overrides)
            accuracy, frechet = task.judge(images)
            per_batch = cache.counts.evaluations
            rows.append((kind, threshold, cache.counts.full, cache.counts.evaluations, seconds, accuracy, frechet))

    evaluations = per_batch or 0
    print(f"\n{args.num_samples} samples in batches of {args.batch_size}; sampler {settings['sampler']}, "
          f"{settings['steps']} steps, cfg_scale {settings['cfg_scale']}; decisions per {args.scope}; "
          f"{args.threads} thread(s); wall clock on a shared machine (model evaluations are the primary figure)\n")
    header = ("cache", "threshold", "full evals", "eval speed-up", "wall s", "wall speed-up", "recognised %",
              "delta pts", "Frechet", "Frechet x")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    print(f"| off | - | {evaluations} / {evaluations} | 1.00x | {base_seconds:.1f} | 1.00x | {base_accuracy:.1f} | "
          f"0.0 | {base_frechet:.2f} | 1.00 |")
    for kind, threshold, full, total, seconds, accuracy, frechet in rows:
        print(f"| {kind} | {threshold:g} | {full} / {total} | {total / full:.2f}x | {seconds:.1f} | "
              f"{base_seconds / seconds:.2f}x | {accuracy:.1f} | {accuracy - base_accuracy:+.1f} | {frechet:.2f} | "
              f"{frechet / base_frechet:.2f} |")
    target = [r for r in rows if r[3] / r[2] >= 1.6 and base_seconds / r[4] >= 1.6
              and r[5] >= base_accuracy - 1.0 and r[6] <= 1.1 * base_frechet]
    print("\nmeets the issue's target (>= 1.6x in evaluations and wall clock, <= 1 point fewer recognised, Frechet "
          "<= +10%): " + (", ".join(f"{k} {t:g}" for k, t, *_ in target) or "none"))


if __name__ == "__main__":
    main()
