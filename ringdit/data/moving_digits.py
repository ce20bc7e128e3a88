"""Moving digits: small videos of one handwritten digit gliding across a square canvas and bouncing off its walls.

A video dataset that needs no download (the glyphs are scikit-learn's bundled 8x8 digits) and gives video models a
long token sequence -- 8 frames of 16 x 16 are 256 tokens of 2 x 2 x 2 patches, where sharding it over ranks starts to
matter -- while a tiny model still learns it in minutes on a CPU. The label is the digit, so class-conditional
samples are easy to judge: the right digit, intact, moving in a straight line between bounces.

Video i depends only on (seed, i): its digit, glyph, start and velocity are drawn from a generator seeded by both,
and its frames are drawn when it is read, so the dataset holds only the glyphs however many videos it has.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from ringdit.data.base import ImageDataModule
from ringdit.common.errors import require_count

GLYPH = 8  # scikit-learn's digits are 8 x 8, pixel values 0..16


def bounce(start: np.ndarray, velocity: np.ndarray, frames: int, limit: int) -> np.ndarray:
    """Positions (frames, 2) of a point moving from ``start`` at ``velocity`` (pixels per frame) inside [0, limit],
    reflected at both ends: a triangle wave of period 2 * limit, so no step-by-step simulation is needed."""
    if limit == 0:
        return np.zeros((frames, 2))
    unfolded = start + velocity * np.arange(frames)[:, None]  # (T, 2), as if there were no walls
    folded = np.mod(unfolded, 2 * limit)
    return np.where(folded > limit, 2 * limit - folded, folded)


class MovingDigits(Dataset):
    """``num_videos`` videos ``(1, frames, canvas, canvas)`` in [-1, 1] (background -1) and their digit labels.

    ``digit_scale`` enlarges the 8 x 8 glyphs by pixel repetition (a 2 gives 16 x 16 digits, crisp on a 32 canvas).
    """

    def __init__(self, num_videos: int, frames: int = 8, canvas: int = 16, digit_scale: int = 1, seed: int = 0):
        from sklearn.datasets import load_digits

        self.num_videos, self.frames, self.canvas, self.seed = num_videos, frames, canvas, seed
        self.glyph_size = GLYPH * digit_scale
        digits = load_digits()
        glyphs = digits.images.astype(np.float32) / 16.0  # (1797, 8, 8) in [0, 1]
        self.glyphs = glyphs.repeat(digit_scale, axis=1).repeat(digit_scale, axis=2)  # (1797, g, g)
        self.glyphs_of = [np.flatnonzero(digits.target == d) for d in range(10)]  # glyph indices of each digit
        self.speed = (1.0 * digit_scale, 2.0 * digit_scale)  # pixels per frame: a bounce or two in 8 frames

    def __len__(self) -> int:
        return self.num_videos

    def motion(self, index: int) -> tuple[int, int, np.ndarray]:
        """(digit, glyph index, top-left corners (frames, 2) as (row, col) integer pixels) of video ``index``."""
        if not 0 <= index < self.num_videos:
            raise IndexError(f"video {index} out of range for {self.num_videos} videos")
        rng = np.random.default_rng([self.seed, index])
        digit = int(rng.integers(10))
        glyph = int(rng.choice(self.glyphs_of[digit]))
        limit = self.canvas - self.glyph_size
        start = rng.uniform(0, limit, size=2)
        angle, speed = rng.uniform(0, 2 * np.pi), rng.uniform(*self.speed)
        velocity = speed * np.array([np.sin(angle), np.cos(angle)])
        corners = np.rint(bounce(start, velocity, self.frames, limit)).astype(np.int64)  # (T, 2)
        return digit, glyph, corners

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        digit, glyph, corners = self.motion(index)
        g = self.glyph_size
        video = np.zeros((self.frames, self.canvas, self.canvas), np.float32)  # (T, H, W) in [0, 1]
        for frame, (row, col) in zip(video, corners):
            frame[row : row + g, col : col + g] = self.glyphs[glyph]
        x = torch.from_numpy(video * 2.0 - 1.0).unsqueeze(0)  # (1, T, H, W) in [-1, 1]
        return x, torch.tensor(digit, dtype=torch.int64)


class MovingDigitsDataModule(ImageDataModule):
    """Procedural moving-digit videos; ``image_size`` is (frames, canvas, canvas), 10 classes."""

    def __init__(self, frames: int = 8, canvas: int = 16, num_videos: int = 4096, digit_scale: int = 1,
                 batch_size: int = 32, num_workers: int = 0, val_fraction: float = 0.05, val_batches: int = 4,
                 seed: int = 0):
        super().__init__(batch_size, num_workers, val_fraction, val_batches, seed)
        for setting, value in (("frames", frames), ("canvas", canvas), ("num_videos", num_videos),
                               ("digit_scale", digit_scale)):
            require_count(f"data.{setting}", value)
        if canvas < GLYPH * digit_scale:
            raise ValueError(f"data.canvas={canvas} is smaller than the digit ({GLYPH} x data.digit_scale="
                             f"{digit_scale} = {GLYPH * digit_scale} pixels); use data.canvas >= "
                             f"{GLYPH * digit_scale} (2x the digit leaves room to move) or a smaller data.digit_scale")
        self.frames, self.canvas, self.num_videos, self.digit_scale = frames, canvas, num_videos, digit_scale
        self.channels, self.image_size = 1, (frames, canvas, canvas)
        self.num_classes, self.class_names = 10, [str(d) for d in range(10)]

    def build_dataset(self) -> MovingDigits:
        return MovingDigits(self.num_videos, self.frames, self.canvas, self.digit_scale, self.seed)
