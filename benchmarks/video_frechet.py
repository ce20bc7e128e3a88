"""How diverse sampled moving-digit videos are: the Frechet distance between the videos of ``samples.npz`` (written
by infer.py for experiment=captioned_moving_digits) and real procedural videos of the same shape, on the real
videos' top PCA components, of two features: the whole video (glyph, position and motion at once) and each frame's
brightest 8x8 window (the glyph alone, as ``digits_accuracy.py`` judges it); each printed beside the distance between
two halves of the real videos (what a perfect sampler would score). The video counterpart of
``digits_accuracy.py``'s Frechet distance for 8x8 digits: recognition alone does not see a sampler that collapses
onto a few videos per caption.

    python benchmarks/video_frechet.py outputs/infer/runs/<run>/samples.npz
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from sklearn.decomposition import PCA

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.digits_accuracy import (  # noqa: E402
    GLYPH, JUDGE_SEED, frechet_distance, load_samples, real_videos, windows)
from ringdit.data.captioned_moving_digits import CaptionedMovingDigits  # noqa: E402


def frechet_to_real(samples: np.ndarray, real: np.ndarray, components: int = 16) -> tuple[float, float]:
    """(samples vs real, real half vs real half) for feature rows (N, F), on the real rows' top PCA components."""
    pca = PCA(components, random_state=0).fit(real)
    half = len(real) // 2
    baseline = frechet_distance(pca.transform(real[:half]), pca.transform(real[half:]))
    return frechet_distance(pca.transform(samples), pca.transform(real)), baseline


def video_frechet(videos: np.ndarray, real_count: int = 2000) -> dict[str, tuple[float, float]]:
    """Per feature (``video``, ``windows``): (samples vs real, real half vs real half) for videos (N, T, H, W) on the
    0..16 scale."""
    frames, canvas = videos.shape[1], videos.shape[2]
    # real videos of a seed no training set uses by default (the judge's), captioned like the training data's
    real = real_videos(CaptionedMovingDigits(real_count, frames, canvas, seed=JUDGE_SEED))[0]
    return {"video": frechet_to_real(videos.reshape(len(videos), -1), real.reshape(real_count, -1)),
            "windows": frechet_to_real(windows(videos).reshape(-1, GLYPH * GLYPH),
                                       windows(real).reshape(-1, GLYPH * GLYPH))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples", help="samples.npz from infer.py (videos)")
    parser.add_argument("--real", type=int, default=2000, help="real videos to compare with (default 2000)")
    args = parser.parse_args()
    images = load_samples(args.samples)["images"]
    if images.ndim != 5:
        raise SystemExit(f"expected videos (N, T, H, W, C), got images of shape {images.shape}")
    videos = images[..., 0].astype(np.float64) / 255.0 * 16.0  # (N, T, H, W) on the 0..16 scale of the real ones
    for feature, (distance, baseline) in video_frechet(videos, args.real).items():
        what = "whole videos" if feature == "video" else "frames' brightest 8x8 windows"
        print(f"{len(videos)} videos, Frechet distance to real ones on {what} (PCA features): {distance:.2f} "
              f"(real half vs half: {baseline:.2f}; ratio {distance / baseline:.1f}x)")


if __name__ == "__main__":
    main()
