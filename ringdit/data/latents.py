"""Pre-encoded latents, for training on the output of your own VAE (or any encoder) instead of on pixels.

Encoding is the expensive, model-specific part, so it is done once, outside ringdit, and saved in one of three
layouts (``data.path``):

- a ``.safetensors`` file holding
    ``latents``  floating point, ``(N, C, H, W)`` for images or ``(N, C, T, H, W)`` for videos
    ``labels``   integer class ids ``(N,)``, 0 .. K-1
  and optionally the metadata key ``class_names``, a JSON list of the K names::

      safetensors.torch.save_file({"latents": z, "labels": y}, "train.safetensors",
                                  metadata={"class_names": json.dumps(names)})

- a folder holding ``latents.npy`` and ``labels.npy`` (the same shapes) and optionally ``class_names.json``;

- a folder of such ``.safetensors`` files (read in name order), one latent shape ``([T,] H, W)`` per file: files of
  different shapes are the set's buckets (images of several aspect ratios, clips of several lengths), and every
  training step reads one bucket (ringdit/data/steps.py). The channels and the number of latent dims must agree
  across the files, and so must ``class_names`` where given (a file may leave it out).

``data.scale`` multiplies the latents as they are read (0.18215 for Stable Diffusion's VAE, which brings its latents
to about unit variance); unlike pixels, latents are not mapped to [-1, 1]. The scale is recorded with the checkpoint
(``latent_scale`` in the data description): divide samples by it before decoding them with the same VAE.

Only shapes, dtypes and labels are read in ``__init__`` (train.py describes the data before it spawns any rank);
latents are read one sample at a time from a memory map, so a dataset larger than RAM trains.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch.utils.data import ConcatDataset, Dataset

from ringdit.data.base import ImageDataModule
from ringdit.common.errors import ConfigError
from ringdit.commands.launcher import spawned_by_launcher
from ringdit.common.safe_json import parse_json

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names (F8_* are storage formats, not for training)
INTEGER_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")
LAYOUT = ("a .safetensors file with 'latents' and 'labels', a folder of them, or a folder with latents.npy and "
          "labels.npy")


class LatentRows(Dataset):
    """Sample i = (latents[i] * scale as float32, labels[i]), read on access.

    The memory map is opened lazily in each process that reads (file handles do not pickle into DataLoader workers).
    """

    def __init__(self, path: Path, labels: torch.Tensor, scale: float):
        self.path, self.labels, self.scale = path, labels, scale
        self._handle = self._latents = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handle": None, "_latents": None}

    def _open(self) -> None:
        if self.path.suffix == ".safetensors":
            self._handle = safe_open(str(self.path), framework="pt")
            self._latents = self._handle.get_slice("latents")
        else:
            self._latents = np.load(self.path / "latents.npy", mmap_mode="r", allow_pickle=False)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._latents is None:
            self._open()
        row = self._latents[index : index + 1]  # (1, C, [T,] H, W): a torch tensor or a numpy memory-map view
        x = row if isinstance(row, torch.Tensor) else torch.from_numpy(np.array(row))
        return x[0].float() * self.scale, self.labels[index]  # (C, [T,] H, W)


class LatentsDataModule(ImageDataModule):
    """Class-conditional latents from ``data.path`` (see the module docstring for the layouts), times ``scale``.
    A folder of ``.safetensors`` files is a set of buckets (one per latent shape); ``tokens_per_batch`` then sizes
    each bucket's batch by model tokens instead of ``batch_size`` (ringdit/data/base.py)."""

    def __init__(self, path: str, scale: float = 1.0, batch_size: int = 64, num_workers: int = 0,
                 val_fraction: float = 0.05, val_batches: int = 4, seed: int = 0, tokens_per_batch: int | None = None):
        super().__init__(batch_size, num_workers, val_fraction, val_batches, seed, tokens_per_batch)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"data.scale must be a positive number (e.g. 0.18215 for the SD VAE), got {scale!r}")
        self.scale = float(scale)
        self.path = _latents_path(path)
        self.files = _safetensors_files(self.path)  # [] for the single-file and npy layouts
        if self.files:
            self._open_files(path)
            return
        shape, dtype, labels, names = _read_safetensors(self.path) if self.path.is_file() else _read_npy(self.path)
        self.labels, self.class_names = _check(self.path, shape, dtype, labels, names)
        if not spawned_by_launcher():  # the launcher checked the data before it started this rank
            _check_finite(self.path, shape[0])
        self.channels, self.image_size = shape[1], tuple(shape[2:])
        self.num_classes = len(self.class_names)

    def _open_files(self, setting) -> None:
        """A folder of ``.safetensors`` files: each checked as a single file is, then against the first (channels,
        latent dims, class names); every latent shape is a bucket, in order of first appearance."""
        headers = [_read_safetensors(file) for file in self.files]  # (shape, dtype, labels, names) each
        _check_mixable(setting, self.files, headers)
        names = next((h[3] for h in headers if h[3] is not None), None)
        checked = [_check(file, shape, dtype, labels, names) for file, (shape, dtype, labels, _) in
                   zip(self.files, headers)]
        if not spawned_by_launcher():
            for file, (shape, *_) in zip(self.files, headers):
                _check_finite(file, shape[0])
        self.file_labels = [labels for labels, _ in checked]
        self.labels = torch.cat(self.file_labels)
        self.class_names = [str(n) for n in names] if names is not None else \
            [str(i) for i in range(int(self.labels.max()) + 1)]
        self.num_classes = len(self.class_names)
        self.channels = headers[0][0][1]
        shapes = [tuple(shape[2:]) for shape, *_ in headers]
        self.bucket_shapes = list(dict.fromkeys(shapes))
        self.sample_buckets = np.concatenate([np.full(shape_n[0], self.bucket_shapes.index(shape))
                                              for (shape_n, *_), shape in zip(headers, shapes)])
        self.image_size = tuple(self.describe_buckets()[0]["shape"])  # the most frequent: previews, the default

    def describe(self) -> dict:
        return {**super().describe(), "latent_scale": self.scale}

    def build_dataset(self) -> Dataset:
        if self.files:
            return ConcatDataset([LatentRows(file, labels, self.scale)
                                  for file, labels in zip(self.files, self.file_labels)])
        return LatentRows(self.path, self.labels, self.scale)


def _latents_path(path) -> Path:
    return checked_data_path(path, LAYOUT)


def _safetensors_files(path: Path) -> list[Path]:
    """The files of the folder-of-files layout, in name order; [] for a file, or a folder with latents.npy (the npy
    layout wins, as before folders of files existed)."""
    if path.is_file() or (path / "latents.npy").exists():
        return []
    return sorted(p for p in path.glob("*.safetensors") if p.is_file())


def _check_mixable(setting, files: list[Path], headers: list[tuple]) -> None:
    """Files of different latent ``([T,] H, W)`` are buckets of one set; a difference in channels, latent dims or
    class names (where given) cannot be mixed: a one-line ``ConfigError`` naming both files and values."""
    first, shape0 = files[0], headers[0][0]
    named = next(((file, list(h[3])) for file, h in zip(files, headers) if h[3] is not None), None)
    for file, (shape, _, _, names) in zip(files[1:], headers[1:]):
        if len(shape) not in (4, 5) or len(shape0) not in (4, 5):
            continue  # _check names the file and its shape
        what = (("latent channels", first, shape0[1], shape[1], "encode every file with the same VAE")
                if shape[1] != shape0[1] else
                ("latent dims (image vs video)", first, len(shape0) - 2, len(shape) - 2,
                 "store images as 1-frame videos (N, C, 1, H, W) for a video model")
                if len(shape) != len(shape0) else
                ("class_names", *named, list(names), "give every file the same class_names metadata (or leave it out)")
                if names is not None and list(names) != named[1] else None)
        if what is not None:
            key, other, expected, found, fix = what
            raise ConfigError(f"data.path={setting}: {file.name} has {key} {found} but {other.name} has {expected}; "
                              f"files of different latent shapes are buckets of one set, but these cannot be mixed: "
                              f"{fix}")


def checked_data_path(path, layout: str, unset_hint: str = "") -> Path:
    """``data.path`` as an existing folder or ``.safetensors`` file; ``layout`` says what belongs there."""
    if path is None or str(path) == "":
        raise ValueError(f"data.path is not set; pass data.path=... ({layout}){unset_hint}")
    resolved = Path(os.path.expanduser(str(path)))
    if not resolved.exists():
        raise ValueError(f"data.path={path} does not exist; pass {layout}")
    if resolved.is_file() and resolved.suffix != ".safetensors":
        raise ValueError(f"data.path={path} is a {resolved.suffix or 'suffix-less'} file; pass {layout}")
    return resolved


def _read_safetensors(path: Path) -> tuple[tuple[int, ...], str, np.ndarray, list | None]:
    """Shape and dtype of ``latents`` (without reading them), ``labels``, and the class names if recorded."""
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            missing = [k for k in ("latents", "labels") if k not in keys]
            if missing:
                raise ValueError(f"data.path={path} has no tensor {' or '.join(map(repr, missing))} (it holds "
                                 f"{sorted(keys)}); save latents (N, C, [T,] H, W) as 'latents' and class ids (N,) "
                                 f"as 'labels'")
            latents = f.get_slice("latents")
            shape, dtype = tuple(latents.get_shape()), latents.get_dtype()
            label_dtype = f.get_slice("labels").get_dtype()
            labels = f.get_tensor("labels")
            metadata = f.metadata() or {}
    except SafetensorError as error:
        raise ValueError(f"data.path={path} is not a readable .safetensors file ({error})") from None
    if label_dtype not in INTEGER_DTYPES:
        raise ValueError(f"data.path={path}: labels are {label_dtype}; store integer class ids (N,), "
                         f"e.g. labels.long()")
    names = _parse_names(path, "the metadata key class_names", metadata["class_names"]) \
        if "class_names" in metadata else None
    return shape, dtype, labels.numpy(), names


def _read_npy(folder: Path) -> tuple[tuple[int, ...], str, np.ndarray, list | None]:
    arrays = {}
    for name in ("latents", "labels"):
        file = folder / f"{name}.npy"
        if not file.is_file():
            raise ValueError(f"data.path={folder} has no {name}.npy; a latents folder holds latents.npy "
                             f"(N, C, [T,] H, W), labels.npy (N,) and optionally class_names.json, or .safetensors "
                             f"files with 'latents' and 'labels' (one latent shape per file)")
        try:
            arrays[name] = np.load(file, mmap_mode="r", allow_pickle=False)  # reads the header only
        except (ValueError, OSError) as error:
            raise ValueError(f"data.path={folder}: {file.name} is not a plain .npy array ({error})") from None
    latents, labels = arrays["latents"], arrays["labels"]
    if labels.dtype.kind not in "iu":
        raise ValueError(f"data.path={folder}: labels.npy holds {labels.dtype}; store integer class ids (N,), "
                         f"e.g. labels.astype(np.int64)")
    names_file = folder / "class_names.json"
    names = _parse_names(folder, names_file.name, names_file.read_text()) if names_file.is_file() else None
    return tuple(latents.shape), str(latents.dtype), np.asarray(labels), names


def _parse_names(path: Path, where: str, text: str) -> list:
    names = parse_json(text, f"data.path={path}: {where}", fix='give a list like ["cat", "dog"]')
    if not isinstance(names, list) or not names or not all(isinstance(n, (str, int)) for n in names):
        raise ValueError(f"data.path={path}: {where} must be a non-empty JSON list of names, got {text[:100]!r}")
    return names


CHUNK_BYTES = 64 * 2**20  # the finite check reads this much at a time: any dataset size in bounded memory


def count_nonfinite(rows, count: int, row_shape: tuple[int, ...]) -> tuple[int, int, int | None]:
    """NaN / Inf in ``rows[0:count]`` (a safetensors slice or a numpy memory map, rows of ``row_shape``), read about
    ``CHUNK_BYTES`` at a time: (bad values, bad rows, the first bad row or None)."""
    step = max(1, CHUNK_BYTES // (8 * max(1, math.prod(row_shape))))  # 8 bytes a value: the widest dtype, float64
    values, bad_rows, first = 0, 0, None
    for start in range(0, count, step):
        chunk = rows[start : start + step]  # (rows, ...)
        if not isinstance(chunk, torch.Tensor):
            chunk = torch.from_numpy(np.array(chunk))  # a bounded copy out of the memory map
        if chunk.element_size() == 1:
            chunk = chunk.float()  # float8 storage: isfinite is not implemented for every float8 kind
        bad = ~torch.isfinite(chunk.reshape(chunk.shape[0], -1))  # (rows, values)
        per_row = bad.sum(dim=1)
        hit = per_row.nonzero().flatten()
        if len(hit):
            first = start + int(hit[0]) if first is None else first
            values, bad_rows = values + int(per_row.sum()), bad_rows + len(hit)
    return values, bad_rows, first


def _check_finite(path: Path, count: int) -> None:
    """Every latent is finite (a NaN or Inf in the data would surface as a NaN loss much later, looking like a
    learning-rate problem); streamed in chunks, so a dataset larger than RAM is checked too."""
    with contextlib.ExitStack() as stack:
        if path.is_file():
            latents = stack.enter_context(safe_open(str(path), framework="pt")).get_slice("latents")
            row_shape = tuple(latents.get_shape()[1:])
        else:
            latents = np.load(path / "latents.npy", mmap_mode="r", allow_pickle=False)
            row_shape = latents.shape[1:]
        _, bad, first = count_nonfinite(latents, count, row_shape)
    if first is not None:
        raise ValueError(f"data.path={path}: {bad} of {count} latent samples hold NaN or Inf values, the first is "
                         f"sample {first}; re-encode or drop them (the VAE may have overflowed, e.g. in float16)")


def _check(path: Path, shape: tuple[int, ...], dtype: str, labels: np.ndarray,
           names: list | None) -> tuple[torch.Tensor, list[str]]:
    """Validate shapes and labels; return the labels (N,) int64 and the class names."""
    if len(shape) not in (4, 5):
        raise ValueError(f"data.path={path}: latents have shape {shape}; expected (N, C, H, W) for images or "
                         f"(N, C, T, H, W) for videos")
    if not (dtype in FLOAT_DTYPES or dtype.startswith("float")):  # safetensors' or numpy's names
        raise ValueError(f"data.path={path}: latents are {dtype}; store the encoder's floating-point output")
    if labels.ndim != 1:
        raise ValueError(f"data.path={path}: labels have shape {labels.shape}; expected (N,) class ids")
    if len(labels) != shape[0]:
        raise ValueError(f"data.path={path}: latents hold {shape[0]} samples (shape {shape}) but labels hold "
                         f"{len(labels)} (shape {labels.shape}); give one label per latent")
    if len(labels) == 0:
        raise ValueError(f"data.path={path}: no samples (latents shape {shape})")
    low, high = int(labels.min()), int(labels.max())
    if low < 0:
        raise ValueError(f"data.path={path}: labels include {low}; class ids must be 0 .. num_classes - 1")
    if names is not None and high >= len(names):
        raise ValueError(f"data.path={path}: labels go up to {high} but class_names lists {len(names)} names; "
                         f"give one name per class id")
    class_names = [str(n) for n in names] if names is not None else [str(i) for i in range(high + 1)]
    return torch.from_numpy(labels.astype(np.int64)), class_names
