"""Your own images: ``data.root`` holds one sub-folder per class (``root/<class>/**/*.png``), as torchvision's
ImageFolder expects, so existing datasets drop in unchanged.

Files are scanned and checked (Pillow open + verify) once, in ``__init__``: train.py builds the data module before it
spawns any rank, so an empty or mistyped folder fails in seconds. Unreadable files are skipped and counted instead
of failing the run -- scraped datasets almost always hold a few. ``verify`` does not decode pixels (a full decode of
every file would make start-up as slow as an epoch), so a file whose header is fine but whose data is cut off is
only found when it is read: it is then skipped too (the next readable image takes its place) and logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset

from ringdit.data.base import ImageDataModule

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


def resize_center_crop(image: Image.Image, height: int, width: int) -> Image.Image:
    """Scale ``image`` so it just covers ``height`` x ``width`` (keeping its aspect ratio), then cut out the centre.

    For a square target this is torchvision's ``Resize(size)`` + ``CenterCrop(size)``: the shorter side becomes the
    target and the longer one is truncated as torchvision truncates it. Cropping, not squashing, keeps shapes
    undistorted, which a generative model would otherwise learn.
    """
    w, h = image.size
    if w * height >= width * h:  # relatively wider than the target: the heights match, the width is cropped
        new_h, new_w = height, max(width, int(w * height / h))
    else:
        new_w, new_h = width, max(height, int(h * width / w))
    if (new_w, new_h) != (w, h):
        image = image.resize((new_w, new_h), Image.BICUBIC)  # Pillow's resize filters antialias when shrinking
    top, left = int(round((new_h - height) / 2.0)), int(round((new_w - width) / 2.0))  # torchvision's rounding
    return image.crop((left, top, left + width, top + height))


def to_tensor(image: Image.Image) -> torch.Tensor:
    """A Pillow image in mode L or RGB -> float32 (C, H, W) in [-1, 1]."""
    pixels = np.asarray(image, dtype=np.float32)  # (H, W) or (H, W, C), 0..255
    if pixels.ndim == 2:
        pixels = pixels[..., None]
    return torch.from_numpy(pixels / 127.5 - 1.0).permute(2, 0, 1).contiguous()  # (C, H, W)


class ImageFiles(Dataset):
    """``(path, label)`` pairs decoded on access: only paths are held, so DataLoader workers pickle it cheaply and
    decode in parallel.

    A file that passed the scan but cannot be decoded (a truncated JPEG passes Pillow's ``verify``) is skipped like
    the scan's unreadable files: sample ``index`` becomes the next decodable one (``index + 1``, ...). Whether a file
    decodes does not depend on the process, so every rank of a sequence-parallel group reads the same sample."""

    def __init__(self, samples: list[tuple[str, int]], height: int, width: int, channels: int):
        self.samples, self.height, self.width = samples, height, width
        self.mode = "RGB" if channels == 3 else "L"
        self.undecodable: set[str] = set()  # found by this process while loading

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        for offset in range(len(self.samples)):
            path, label = self.samples[(index + offset) % len(self.samples)]
            if path in self.undecodable:
                continue
            try:
                image = self.decode(path)
            except Exception as error:  # Pillow raises OSError, SyntaxError, ValueError, ... for broken data
                self.undecodable.add(path)
                log.warning("data.root: could not decode %s (%s); skipped, sample %d uses the next readable image "
                            "(%d file(s) skipped while loading so far)", path, error, index, len(self.undecodable))
                continue
            x = to_tensor(resize_center_crop(image, self.height, self.width))  # (C, H, W)
            return x, torch.tensor(label, dtype=torch.int64)
        raise OSError(f"data.root: none of the {len(self.samples)} image files can be decoded (e.g. "
                      f"{', '.join(sorted(self.undecodable)[:3])}); put readable images in root/<class>/")

    def decode(self, path: str) -> Image.Image:
        with Image.open(path) as image:
            image = ImageOps.exif_transpose(image)  # phone photos store their rotation in EXIF
            image = image.convert(self.mode)
            image.load()  # decode every pixel now: a file cut off fails here, not later
        return image


class ImageFolderDataModule(ImageDataModule):
    """Class-conditional images from ``root/<class>/...``; class ids follow the sorted sub-folder names.

    Args:
        root: the folder of class sub-folders. Sub-folders are searched recursively; hidden ones (``.git``,
            ``.ipynb_checkpoints``) are not classes.
        image_size: an int (square) or ``[H, W]``: images are resized to cover it and centre-cropped.
        channels: 3 (RGB) or 1 (grayscale).
    """

    def __init__(self, root: str, image_size: int | Sequence[int] = 32, channels: int = 3, batch_size: int = 64,
                 num_workers: int = 0, val_fraction: float = 0.05, val_batches: int = 4, seed: int = 0):
        super().__init__(batch_size, num_workers, val_fraction, val_batches, seed)
        self.image_size = _image_size(image_size)
        if channels not in (1, 3):
            raise ValueError(f"data.channels must be 3 (RGB) or 1 (grayscale), got {channels!r}")
        self.channels = channels
        self.root = _class_root(root)
        self.class_names = sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not self.class_names:
            raise ValueError(f"data.root={root} has no class sub-folders; put each class's images in their own "
                             f"sub-folder (e.g. {Path(root) / 'cat' / '0001.png'})")
        self.num_classes = len(self.class_names)
        self.samples, self.skipped = self._scan()

    def _scan(self) -> tuple[list[tuple[str, int]], list[str]]:
        """(path, label) of every readable image, and the paths of the unreadable ones."""
        samples, skipped = [], []
        for label, name in enumerate(self.class_names):
            for path in _image_files(self.root / name):
                if _readable(path):
                    samples.append((str(path), label))
                else:
                    skipped.append(str(path))
        if skipped:
            log.warning("data.root=%s: skipped %d unreadable image file(s), e.g. %s", self.root, len(skipped),
                        ", ".join(skipped[:3]))
        if not samples:
            found = f"none of its {len(skipped)} image files could be read (e.g. {', '.join(skipped[:3])})" \
                if skipped else f"no image files ({', '.join(e[1:] for e in IMAGE_EXTENSIONS)})"
            raise ValueError(f"data.root={self.root}: {found} in the class sub-folders {self.class_names}; "
                             f"put readable images in root/<class>/")
        counts = np.bincount([label for _, label in samples], minlength=self.num_classes)
        empty = [name for name, count in zip(self.class_names, counts) if count == 0]
        if empty:
            log.warning("data.root=%s: classes without a readable image: %s (they are kept, so class ids stay the "
                        "sorted folder order, but the model never sees them)", self.root, empty)
        return samples, skipped

    def build_dataset(self) -> ImageFiles:
        return ImageFiles(self.samples, *self.image_size, channels=self.channels)


def _class_root(root) -> Path:
    if root is None or str(root) == "":
        raise ValueError("data.root is not set; pass data.root=/path/to/images, a folder with one sub-folder of "
                         "images per class")
    path = Path(os.path.expanduser(str(root)))
    if not path.exists():
        raise ValueError(f"data.root={root} does not exist; pass a folder with one sub-folder of images per class")
    if not path.is_dir():
        raise ValueError(f"data.root={root} is a file, not a folder; pass the folder that holds one sub-folder of "
                         f"images per class")
    return path


def _image_size(size) -> tuple[int, int]:
    """An int or [H, W] (a Hydra ListConfig too) -> (H, W) of positive ints."""
    try:
        dims = [size] if isinstance(size, int) else list(size)
    except TypeError:
        dims = []
    if len(dims) not in (1, 2) or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
        raise ValueError(f"data.image_size must be a positive int or [height, width], got {size!r}")
    return (dims[0], dims[-1])


def _image_files(folder: Path) -> list[Path]:
    """Image files under ``folder``, recursively, in a stable order (the dataset order must not depend on the
    file system's)."""
    files = []
    for directory, subdirs, names in os.walk(folder, followlinks=True):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        files += [Path(directory, n) for n in sorted(names) if n.lower().endswith(IMAGE_EXTENSIONS)]
    return files


def _readable(path: Path) -> bool:
    try:
        with Image.open(path) as image:
            image.verify()
        return True
    except Exception:  # Pillow raises many types for broken files (OSError, SyntaxError, struct.error, ...)
        return False
