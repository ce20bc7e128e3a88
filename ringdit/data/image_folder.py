"""Your own images: ``data.root`` holds one sub-folder per class (``root/<class>/**/*.png``), as torchvision's
ImageFolder expects, so existing datasets drop in unchanged.

Files are scanned and checked (Pillow open + verify) once, in ``__init__``: train.py builds the data module before it
spawns any rank, so an empty or mistyped folder fails in seconds. Unreadable files are skipped and counted instead
of failing the run -- scraped datasets almost always hold a few. ``verify`` does not decode pixels (a full decode of
every file would make start-up as slow as an epoch), so a file whose header is fine but whose data is cut off is
only found when it is read: it is then skipped too (the next readable image takes its place) and logged.

Buckets (``data.buckets``): images of several aspect ratios train at their own shape instead of all being cropped
to one. ``auto`` makes the sizes as ``python -m ringdit.prepare buckets=auto`` does (ringdit/media/buckets.py: the
largest square, and for each width a multiple of ``data.bucket_step`` the largest height, with height x width at
most the area of ``data.image_size``, aspect ratios 1:4 .. 4:1); a list gives the ``[H, W]`` pixel sizes (those
larger in area than ``image_size`` are left out). Each image goes to the size of nearest aspect ratio, probed from
its header in the scan (no pixel is decoded; an EXIF rotation is taken into account), and is resized to cover it
and centre-cropped there. Every used size is one bucket; each training step reads one bucket (ringdit/data/steps.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from omegaconf import ListConfig, OmegaConf
from PIL import Image, ImageOps
from torch.utils.data import Dataset

from ringdit.data.base import ImageDataModule
from ringdit.common.errors import ConfigError, require_count
from ringdit.media.buckets import BUCKETS_HINT as PREPARE_HINT
from ringdit.media.buckets import Buckets, auto_sizes, parse_buckets
from ringdit.media.frames import open_image, upright_size

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
BUCKET_STEP = 8  # px: auto buckets' sizes are multiples of it (the model's patch is unknown here; 8 suits 1, 2, 4, 8)


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
    decodes does not depend on the process, so every rank of a sequence-parallel group reads the same sample.

    ``shapes`` (buckets): each sample's (H, W), instead of ``height`` x ``width`` for all. A skipped sample's stand-in
    is then the next decodable one of the same shape (of any shape if none of its bucket decodes), cropped to the
    skipped sample's shape, so a batch of one bucket stays one shape."""

    def __init__(self, samples: list[tuple[str, int]], height: int, width: int, channels: int,
                 shapes: list[tuple[int, int]] | None = None):
        self.samples, self.height, self.width, self.shapes = samples, height, width, shapes
        self.mode = "RGB" if channels == 3 else "L"
        self.undecodable: set[str] = set()  # found by this process while loading

    def __len__(self) -> int:
        return len(self.samples)

    def _candidates(self, index: int):
        """``index``, then the samples after it (cyclically) that may stand in for it."""
        order = ((index + offset) % len(self.samples) for offset in range(len(self.samples)))
        if self.shapes is None:
            yield from order
            return
        shape = self.shapes[index]
        yield from (i for i in order if self.shapes[i] == shape)
        yield from (i for i in ((index + o) % len(self.samples) for o in range(len(self.samples)))
                    if self.shapes[i] != shape)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        height, width = self.shapes[index] if self.shapes is not None else (self.height, self.width)
        for candidate in self._candidates(index):
            path, label = self.samples[candidate]
            if path in self.undecodable:
                continue
            try:
                image = self.decode(path)
            except Exception as error:  # Pillow raises OSError, SyntaxError, ValueError, ... for broken data
                self.undecodable.add(path)
                log.warning("data.root: could not decode %s (%s); skipped, sample %d uses the next readable image "
                            "(%d file(s) skipped while loading so far)", path, error, index, len(self.undecodable))
                continue
            x = to_tensor(resize_center_crop(image, height, width))  # (C, H, W)
            return x, torch.tensor(label, dtype=torch.int64)
        raise OSError(f"data.root: none of the {len(self.samples)} image files can be decoded (e.g. "
                      f"{', '.join(sorted(self.undecodable)[:3])}); put readable images in root/<class>/")

    def decode(self, path: str) -> Image.Image:
        with open_image(path) as image:
            image = ImageOps.exif_transpose(image)  # phone photos store their rotation in EXIF
            image = image.convert(self.mode)
            image.load()  # decode every pixel now: a file cut off fails here, not later
        return image


class ImageFolderDataModule(ImageDataModule):
    """Class-conditional images from ``root/<class>/...``; class ids follow the sorted sub-folder names.

    Args:
        root: the folder of class sub-folders. Sub-folders are searched recursively; hidden ones (``.git``,
            ``.ipynb_checkpoints``) are not classes.
        image_size: an int (square) or ``[H, W]``: images are resized to cover it and centre-cropped. With
            ``buckets``, the area bound: every bucket's H x W is at most ``image_size ** 2`` (or H x W).
        channels: 3 (RGB) or 1 (grayscale).
        buckets: None (one shape, ``image_size``), ``"auto"`` or a list of ``[H, W]`` pixel sizes (see the module
            docstring); ``image_size`` in ``describe()`` is then the most frequent bucket's shape.
        bucket_step: auto buckets' sizes are multiples of it, in pixels (default 8); the model's patch must divide
            it (a bucket the patch does not divide is refused before training starts).
        tokens_per_batch: size each bucket's batch by model tokens instead of ``batch_size`` (ringdit/data/base.py).
    """

    def __init__(self, root: str, image_size: int | Sequence[int] = 32, channels: int = 3, batch_size: int = 64,
                 num_workers: int = 0, val_fraction: float = 0.05, val_batches: int = 4, seed: int = 0,
                 buckets=None, bucket_step: int = BUCKET_STEP, tokens_per_batch: int | None = None):
        super().__init__(batch_size, num_workers, val_fraction, val_batches, seed, tokens_per_batch)
        self.image_size = _image_size(image_size)
        chooser = _bucket_rule(buckets, bucket_step, self.image_size)  # settings first: before the scan
        if channels not in (1, 3):
            raise ValueError(f"data.channels must be 3 (RGB) or 1 (grayscale), got {channels!r}")
        self.channels = channels
        self.root = _class_root(root)
        self.class_names = sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not self.class_names:
            raise ValueError(f"data.root={root} has no class sub-folders; put each class's images in their own "
                             f"sub-folder (e.g. {Path(root) / 'cat' / '0001.png'})")
        self.num_classes = len(self.class_names)
        self.samples, self.skipped, sizes = self._scan()
        self.sample_shapes: list[tuple[int, int]] | None = None
        if chooser is not None:
            self._place(chooser, sizes)

    def _place(self, chooser: Buckets, sizes: list[tuple[int, int]]) -> None:
        """Each image's bucket from its (upright) size: ``bucket_shapes`` (the sizes used, sorted),
        ``sample_buckets``, and ``image_size`` = the most frequent bucket's shape."""
        self.sample_shapes = [(b.height, b.width) for b in (chooser.choose(h, w) for h, w in sizes)]
        self.bucket_shapes = sorted(set(self.sample_shapes))
        index = {shape: b for b, shape in enumerate(self.bucket_shapes)}
        self.sample_buckets = np.array([index[shape] for shape in self.sample_shapes], dtype=np.int64)
        self.image_size = tuple(self.describe_buckets()[0]["shape"])
        log.info("data.root=%s: %d images in %d buckets: %s", self.root, len(self.samples), len(self.bucket_shapes),
                 ", ".join(f"{b['shape'][0]}x{b['shape'][1]} ({b['samples']})" for b in self.describe_buckets()))

    def _scan(self) -> tuple[list[tuple[str, int]], list[str], list[tuple[int, int]]]:
        """(path, label) of every readable image, the paths of the unreadable ones, and each readable image's
        upright (height, width)."""
        samples, skipped, sizes = [], [], []
        for label, name in enumerate(self.class_names):
            for path in _image_files(self.root / name):
                size = _probe(path)
                if size is not None:
                    samples.append((str(path), label))
                    sizes.append(size)
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
        return samples, skipped, sizes

    def build_dataset(self) -> ImageFiles:
        return ImageFiles(self.samples, *self.image_size, channels=self.channels, shapes=self.sample_shapes)


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


BUCKETS_HINT = ("pass data.buckets=null (one shape, data.image_size), data.buckets=auto, or a list of [H, W] pixel "
                "sizes, e.g. data.buckets=[[32,32],[24,40],[40,24]]")


def _bucket_rule(buckets, step, image_size: tuple[int, int]) -> Buckets | None:
    """``data.buckets`` / ``data.bucket_step`` -> the rule placing each image (prepare's, ringdit/media/buckets.py),
    or None without buckets; every mistake a one-line ``ConfigError`` naming the setting."""
    if isinstance(buckets, ListConfig):
        buckets = OmegaConf.to_container(buckets)
    try:
        form = parse_buckets(buckets)
    except ConfigError as error:
        raise ConfigError(f"data.{error}".replace(PREPARE_HINT, BUCKETS_HINT)) from None  # prepare's wording
    if form is None:
        return None
    height, width = image_size
    area = height * width
    if form == "auto":
        require_count("data.bucket_step", step, hint="auto buckets' sizes are multiples of it, in pixels; a multiple "
                                                     "of the model's patch, e.g. data.bucket_step=8")
        sizes = auto_sizes(area, step)
        if not sizes:
            raise ConfigError(f"data.image_size={list(image_size)} ({area} px) is smaller than the smallest bucket "
                              f"data.buckets=auto can make, {step}x{step} (data.bucket_step={step}); pass a larger "
                              f"data.image_size or a smaller data.bucket_step")
    else:
        sizes = sorted(size for size in form if size[0] * size[1] <= area)
        dropped = [f"{h}x{w}" for h, w in form if h * w > area]
        if not sizes:
            raise ConfigError(f"data.buckets: every size ({', '.join(dropped)}) is larger in area than "
                              f"data.image_size={list(image_size)} ({area} px), the area bound of buckets; pass a "
                              f"larger data.image_size or smaller sizes")
        if dropped:
            log.warning("data.buckets: leaving out %s, larger in area than data.image_size=%s (%d px)",
                        ", ".join(dropped), list(image_size), area)
    return Buckets(tuple(sizes), None)


def _image_files(folder: Path) -> list[Path]:
    """Image files under ``folder``, recursively, in a stable order (the dataset order must not depend on the
    file system's)."""
    files = []
    for directory, subdirs, names in os.walk(folder, followlinks=True):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        files += [Path(directory, n) for n in sorted(names) if n.lower().endswith(IMAGE_EXTENSIONS)]
    return files


def _probe(path: Path) -> tuple[int, int] | None:
    """The (height, width) an image has once decoded and turned upright (``ImageOps.exif_transpose``), from its
    header (Pillow's open + verify: no pixel decoded); None when the file is unreadable."""
    try:
        with open_image(path) as image:
            size = upright_size(image)
            image.verify()
    except Exception:  # Pillow raises many types for broken files (OSError, SyntaxError, struct.error, ...)
        return None
    return size
