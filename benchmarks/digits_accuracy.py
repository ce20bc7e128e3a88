"""How recognisable generated digits are: an SVC trained on the real 8x8 digits classifies the samples of
``samples.npz`` (written by infer.py) and is compared with the labels they were generated for.

    python benchmarks/digits_accuracy.py outputs/infer/runs/<run>/samples.npz

Images must be 8x8 digits. Videos (moving_digits) are judged frame by frame on the brightest 8x8 window (where the
digit is) and by a majority vote over each video's frames.
"""

from __future__ import annotations

import argparse

import numpy as np
from sklearn.datasets import load_digits
from sklearn.svm import SVC

GLYPH = 8


def classifier() -> SVC:
    digits = load_digits()
    return SVC(gamma=0.001, C=10).fit(digits.data, digits.target)  # ~97% in cross-validation on real digits


def brightest_window(frame: np.ndarray) -> np.ndarray:
    """The GLYPH x GLYPH window of a (H, W) frame with the most ink."""
    sums = np.lib.stride_tricks.sliding_window_view(frame, (GLYPH, GLYPH)).sum(axis=(-1, -2))
    row, col = np.unravel_index(sums.argmax(), sums.shape)
    return frame[row : row + GLYPH, col : col + GLYPH]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples", help="samples.npz from infer.py")
    args = parser.parse_args()
    data = np.load(args.samples)
    images, labels = data["images"][..., 0].astype(np.float64) / 255.0 * 16.0, data["labels"]  # the 0..16 scale
    svc = classifier()
    if images.ndim == 3:  # (N, 8, 8) images
        if images.shape[1:] != (GLYPH, GLYPH):
            raise SystemExit(f"expected 8x8 digits, got images of shape {images.shape[1:]}")
        predicted = svc.predict(images.reshape(len(images), -1))
        print(f"{len(labels)} samples: {(predicted == labels).mean():.1%} classified as the requested digit")
        for digit in range(10):
            if (mask := labels == digit).any():
                print(f"  digit {digit}: {(predicted[mask] == digit).mean():.0%} of {mask.sum()}")
        return
    frames = np.stack([[brightest_window(f) for f in video] for video in images])  # (N, T, 8, 8)
    per_frame = svc.predict(frames.reshape(-1, GLYPH * GLYPH)).reshape(frames.shape[:2])
    votes = np.array([np.bincount(p, minlength=10).argmax() for p in per_frame])
    print(f"{len(labels)} videos: {(votes == labels).mean():.1%} classified as the requested digit (vote over "
          f"frames), {(per_frame == labels[:, None]).mean():.1%} of frames")


if __name__ == "__main__":
    main()
