"""How recognisable generated digits are: an SVC trained on the real 8x8 digits classifies the samples of
``samples.npz`` (written by infer.py) and is compared with the labels they were generated for.

    python benchmarks/digits_accuracy.py outputs/infer/runs/<run>/samples.npz
"""

from __future__ import annotations

import argparse

import numpy as np
from sklearn.datasets import load_digits
from sklearn.svm import SVC


def classifier() -> SVC:
    digits = load_digits()
    return SVC(gamma=0.001, C=10).fit(digits.data, digits.target)  # ~99% on held-out real digits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples", help="samples.npz from infer.py")
    args = parser.parse_args()
    data = np.load(args.samples)
    images, labels = data["images"], data["labels"]
    if images.shape[1:] != (8, 8, 1):
        raise SystemExit(f"expected 8x8 grayscale digits, got images of shape {images.shape[1:]}")
    features = images.reshape(len(images), 64).astype(np.float64) / 255.0 * 16.0  # back to the 0..16 scale
    predicted = classifier().predict(features)
    accuracy = float((predicted == labels).mean())
    print(f"{len(labels)} samples: {accuracy:.1%} classified as the requested digit")
    for digit in range(10):
        mask = labels == digit
        if mask.any():
            print(f"  digit {digit}: {(predicted[mask] == digit).mean():.0%} of {mask.sum()}")


if __name__ == "__main__":
    main()
