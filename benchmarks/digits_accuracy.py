"""How recognisable generated digits are: classify the samples of ``samples.npz`` (written by infer.py) and compare
with what they were generated for -- the labels of class-conditional models, or the captions of text-to-video ones
("a 3 moving left": the digit, and the direction of motion).

    python benchmarks/digits_accuracy.py outputs/infer/runs/<run>/samples.npz
    python benchmarks/digits_accuracy.py --real 500     # the judge itself, on real moving-digit videos

Images must be 8x8 digits, judged by an SVC trained on the real digits (~97% in cross-validation), and for
diversity by the Frechet distance between the samples and the real digits on PCA features (printed beside the
distance between two halves of the real digits: what a perfect sampler would score). Guidance buys accuracy with
diversity, so both are reported. Videos
(moving_digits, captioned_moving_digits) are judged frame by frame on the brightest 8x8 window (where the digit is),
by an SVC trained on such windows of real procedural videos (a separate seed), and by a majority vote over each
video's frames. An SVC trained on the plain 8x8 digits recognises only ~60% of real videos: the window rarely sits
exactly on the glyph's own 8x8 box, whose border columns are mostly blank. The direction of motion is the larger
component of the ink centroid's path from the first frame to the last. Image-to-video samples
(experiment=captioned_moving_digits_i2v), whose first frame is given: ``--given-first-frame`` judges the digit on
the generated frames only (the direction still from the given frame to the last).
"""

from __future__ import annotations

import argparse
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np
from scipy import linalg
from sklearn.datasets import load_digits
from sklearn.decomposition import PCA
from sklearn.svm import SVC

from ringdit.data.captioned_moving_digits import DIRECTIONS, CaptionedMovingDigits, parse_caption
from ringdit.data.moving_digits import MovingDigits

GLYPH = 8
JUDGE_SEED = 987_654  # real videos for the video judge: not the seed any training set uses by default


def image_classifier() -> SVC:
    digits = load_digits()
    return SVC(gamma=0.001, C=10).fit(digits.data, digits.target)


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Frechet distance between Gaussians fitted to feature sets a (N, F) and b (M, F)."""
    mean_a, mean_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root = linalg.sqrtm(cov_a @ cov_b).real
    return float(((mean_a - mean_b) ** 2).sum() + np.trace(cov_a + cov_b - 2 * root))


def diversity(images: np.ndarray, components: int = 16, classes: np.ndarray | None = None) -> tuple[float, float]:
    """(samples vs real, real half vs real half): Frechet distances on the real digits' top PCA components; with
    ``classes``, against the real digits of those classes only (samples of some of the digits)."""
    digits = load_digits()
    real = digits.data  # (1797, 64) on the 0..16 scale
    pca = PCA(components, random_state=0).fit(real)
    if classes is not None:
        real = real[np.isin(digits.target, classes)]
    order = np.random.default_rng(0).permutation(len(real))
    halves = real[order[: len(real) // 2]], real[order[len(real) // 2:]]
    baseline = frechet_distance(pca.transform(halves[0]), pca.transform(halves[1]))
    return frechet_distance(pca.transform(images.reshape(len(images), -1)), pca.transform(real)), baseline


def brightest_window(frame: np.ndarray) -> np.ndarray:
    """The GLYPH x GLYPH window of a (H, W) frame with the most ink."""
    sums = np.lib.stride_tricks.sliding_window_view(frame, (GLYPH, GLYPH)).sum(axis=(-1, -2))
    row, col = np.unravel_index(sums.argmax(), sums.shape)
    return frame[row : row + GLYPH, col : col + GLYPH]


def windows(videos: np.ndarray) -> np.ndarray:
    """(N, T, H, W) on the 0..16 scale -> (N, T, 64): each frame's brightest window, flattened."""
    return np.stack([[brightest_window(f).reshape(-1) for f in video] for video in videos])


def real_videos(dataset) -> tuple[np.ndarray, np.ndarray]:
    """A procedural set's videos (N, T, H, W) on the 0..16 scale and their digits (N,)."""
    videos = np.stack([(dataset[i][0][0].numpy() + 1.0) * 8.0 for i in range(len(dataset))])
    return videos, np.array([dataset.motion(i)[0] for i in range(len(dataset))])


def video_classifier(frames: int, canvas: int, count: int = 1500) -> SVC:
    """An SVC on the brightest windows of real videos of this shape: bouncing and straight-moving digits."""
    half = count // 2
    sets = [MovingDigits(half, frames, canvas, seed=JUDGE_SEED), CaptionedMovingDigits(half, frames, canvas,
                                                                                        seed=JUDGE_SEED)]
    videos, digits = zip(*(real_videos(s) for s in sets))
    videos, digits = np.concatenate(videos), np.concatenate(digits)
    return SVC(gamma=0.001, C=10).fit(windows(videos).reshape(-1, GLYPH * GLYPH), np.repeat(digits, frames))


def judge_videos(videos: np.ndarray, svc: SVC) -> tuple[np.ndarray, np.ndarray]:
    """(votes (N,), per-frame predictions (N, T)) for videos (N, T, H, W) on the 0..16 scale."""
    per_frame = svc.predict(windows(videos).reshape(-1, GLYPH * GLYPH)).reshape(videos.shape[:2])
    return np.array([np.bincount(p, minlength=10).argmax() for p in per_frame]), per_frame


def direction_of(video: np.ndarray) -> str:
    """The caption word for the way the ink's centroid goes from the first frame to the last."""
    rows, cols = np.indices(video.shape[1:])
    ink = video.sum(axis=(1, 2)) + 1e-9  # (T,)
    centroid = np.stack([(video * rows).sum(axis=(1, 2)) / ink, (video * cols).sum(axis=(1, 2)) / ink], 1)  # (T, 2)
    path = centroid[-1] - centroid[0]
    axis = int(np.abs(path).argmax())
    step = [0, 0]
    step[axis] = int(np.sign(path[axis])) or 1
    return next(name for name, delta in DIRECTIONS.items() if list(delta) == step)


def report_videos(videos: np.ndarray, digits: np.ndarray, directions: list[str] | None, generated_from: int = 0
                  ) -> None:
    """``generated_from``: the first frame the model generated (1 for image-to-video, whose first frame is given):
    the digit is judged on the generated frames only; the direction on the whole path, from the given frame on."""
    votes, per_frame = judge_videos(videos[:, generated_from:], video_classifier(videos.shape[1], videos.shape[2]))
    print(f"{len(digits)} videos: {(votes == digits).mean():.1%} classified as the requested digit (vote over "
          f"frames), {(per_frame == digits[:, None]).mean():.1%} of frames")
    if directions is not None:
        moved = np.array([direction_of(v) == d for v, d in zip(videos, directions)])
        both = moved & (votes == digits)
        print(f"  moving the requested way: {moved.mean():.1%}; right digit and right way: {both.mean():.1%}")
    for digit in range(10):
        if (mask := digits == digit).any():
            print(f"  digit {digit}: {(votes[mask] == digit).mean():.0%} of {mask.sum()}")


def fail(message: str) -> None:
    print(f"Error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def load_samples(path: str) -> dict[str, np.ndarray]:
    """``images`` (N, [T,] H, W, C) and ``labels`` or ``captions`` from a samples.npz infer.py wrote; anything else
    is one line and exit code 2 (no pickles: ``allow_pickle=False``)."""
    expected = ("pass the samples.npz infer.py wrote for a pixel-space digits model: it holds 'images' and "
                "'labels' or 'captions'")
    file = Path(path).expanduser()
    if not file.is_file():
        fail(f"{path} {'is a folder' if file.is_dir() else 'does not exist'}; {expected}")
    try:
        stored = np.load(file, allow_pickle=False)
        if not isinstance(stored, np.lib.npyio.NpzFile):
            fail(f"{path} is a single .npy array, not an .npz archive; {expected}")
        with stored:
            contents = {key: stored[key] for key in stored.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:
        detail = "neither a zip archive nor a .npy array" if "pickled" in str(error) else \
            f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        fail(f"{path} is not a readable .npz archive ({detail}); {expected}")
    if "images" not in contents:
        fail(f"{path} holds {sorted(contents)}, no 'images'; {expected}")
    if "labels" not in contents and "captions" not in contents:
        fail(f"{path} holds {sorted(contents)}: neither 'labels' nor 'captions' say what was asked for; {expected}")
    if contents["images"].ndim not in (4, 5) or contents["images"].dtype != np.uint8:
        fail(f"{path}: images are {contents['images'].dtype} {contents['images'].shape}; expected uint8 "
             f"(N, [T,] H, W, C) pixels; {expected}")
    return contents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples", nargs="?", help="samples.npz from infer.py")
    parser.add_argument("--real", type=int, metavar="N", help="judge N real captioned moving-digit videos instead")
    parser.add_argument("--given-first-frame", action="store_true",
                        help="image-to-video samples: judge the digit on the generated frames (after the given first)")
    args = parser.parse_args()
    if args.real:
        real = CaptionedMovingDigits(args.real, seed=0)
        videos, digits = real_videos(real)
        report_videos(videos, digits, [real.described_motion(i)[2] for i in range(args.real)])
        return
    if not args.samples:
        parser.error("give samples.npz (or --real N)")
    data = load_samples(args.samples)
    images = data["images"][..., 0].astype(np.float64) / 255.0 * 16.0  # the 0..16 scale of the real digits
    directions = None
    if "labels" in data:
        labels = data["labels"]
    else:  # a text-to-video model: its captions say the digit and the direction
        parsed = [parse_caption(c) for c in data["captions"]]
        if any(p is None for p in parsed):
            raise SystemExit("the samples' captions are not of the form 'a 3 moving left'")
        labels, directions = np.array([p[0] for p in parsed]), [p[1] for p in parsed]
    if images.ndim == 3:  # (N, 8, 8) images
        if images.shape[1:] != (GLYPH, GLYPH):
            raise SystemExit(f"expected 8x8 digits, got images of shape {images.shape[1:]}")
        predicted = image_classifier().predict(images.reshape(len(images), -1))
        print(f"{len(labels)} samples: {(predicted == labels).mean():.1%} classified as the requested digit")
        sampled = np.unique(labels)
        subset = sampled if len(sampled) < 10 else None  # samples of some digits: against those digits' images
        distance, baseline = diversity(images, classes=subset)
        which = "" if subset is None else f" of the sampled digits {','.join(map(str, sampled))}"
        print(f"  Frechet distance to the real digits{which} (PCA features): {distance:.2f} (real half vs half: "
              f"{baseline:.2f}; ratio {distance / baseline:.1f}x)")
        for digit in range(10):
            if (mask := labels == digit).any():
                print(f"  digit {digit}: {(predicted[mask] == digit).mean():.0%} of {mask.sum()}")
        return
    report_videos(images, labels, directions, generated_from=1 if args.given_first_frame else 0)


if __name__ == "__main__":
    main()
