"""Turning sample tensors into files: uint8 arrays, grids, PNGs and animated GIFs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """(N, C, [T,] H, W) in [-1, 1] -> (N, [T,] H, W, C) uint8."""
    pixels = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.movedim(1, -1).cpu()


def make_grid(images: np.ndarray, columns: int | None = None, padding: int = 1) -> np.ndarray:
    """(N, H, W, C) uint8 -> one (rows * H, columns * W, C) image with ``padding`` pixels between tiles."""
    count, height, width, channels = images.shape
    columns = columns or math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    grid = np.zeros((rows * (height + padding) + padding, columns * (width + padding) + padding, channels), np.uint8)
    for i, image in enumerate(images):
        r, c = divmod(i, columns)
        top, left = padding + r * (height + padding), padding + c * (width + padding)
        grid[top : top + height, left : left + width] = image
    return grid


def to_image(pixels: np.ndarray) -> Image.Image:
    """(H, W, C) uint8 -> a PIL image (grey for one channel, RGB for three)."""
    return Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)


def write_gif(frames, path: Path, fps: int = 8) -> Path:
    """``frames`` ((T, H, W, C) uint8, or PIL images) -> a looping animated GIF at ``fps``; returns ``path``."""
    images = [frame if isinstance(frame, Image.Image) else to_image(frame) for frame in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)), loop=0)
    return path


def _upscaled(grid: np.ndarray, min_size: int) -> Image.Image:
    """Nearest-neighbour upscaling, so tiny samples (8x8 digits) are visible without blurring them."""
    image = to_image(grid)
    scale = max(1, math.ceil(min_size / max(grid.shape[:2])))
    return image.resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST)


def save_samples(images: np.ndarray, path: Path, columns: int | None = None, min_size: int = 256,
                 fps: int = 8) -> Path:
    """Write a grid of images ``(N, H, W, C)`` as PNG, or of videos ``(N, T, H, W, C)`` as an animated GIF.

    ``path``'s suffix is replaced accordingly; returns the path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if images.ndim == 4:
        path = path.with_suffix(".png")
        _upscaled(make_grid(images, columns), min_size).save(path)
        return path
    frames = [_upscaled(make_grid(images[:, t], columns), min_size) for t in range(images.shape[1])]
    return write_gif(frames, path.with_suffix(".gif"), fps)


def grid_image(images: np.ndarray, columns: int | None = None, min_size: int = 256) -> np.ndarray:
    """The PNG grid as an (H, W, C) array, e.g. for a logger; video shows its first frame."""
    first = images if images.ndim == 4 else images[:, 0]
    return np.asarray(_upscaled(make_grid(first, columns), min_size).convert("RGB"))
