"""Reading checkpoint files as data: a ``torch.save`` file, or a sharded (FSDP) folder assembled on one process.

Nothing here unpickles code: ``.ckpt``/``.pt`` files load with ``torch.load(weights_only=True)``, which only builds
tensors and plain containers, and sharded folders through ``ringdit.checkpoints.safe_dcp``. A file that would need
arbitrary Python objects is refused with an error that says so.
"""

from __future__ import annotations

import argparse
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from ringdit.checkpoints.location import SHARDED_METADATA, existing_checkpoint, first_line
from ringdit.checkpoints.optimizer_state import optimizer_state_by_index
from ringdit.checkpoints.safe_dcp import SafeEmptyStateDictLoadPlanner, SafeFileSystemReader, failure_cause
from ringdit.common.errors import CheckpointError


def safe_torch_load(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load`` restricted to tensors and plain containers, with errors that say what is wrong.

    ``mmap``: map tensors from the file instead of reading them (cheap inspection of a big checkpoint)."""
    path = existing_checkpoint(path)
    try:
        # argparse.Namespace: facebookresearch/DiT's training checkpoints store their args as one; rebuilding it
        # only sets attributes.
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(error))
        if unsafe is None:  # not a pickle of objects at all: garbage, text, another format
            raise CheckpointError(f"{path} is not a readable PyTorch checkpoint (not a torch.save file)") from None
        raise CheckpointError(
            f"refusing to load {path}: it contains Python objects that would run code when unpickled "
            f"({unsafe.group(1)}). ringdit loads only weights (tensors and plain containers); if you trust the "
            f"file, re-save its state_dict with torch.save, or export it to .safetensors"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as error:
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint (truncated, still being written, or another format): "
            f"{first_line(error)}"
        ) from None


# ---- sharded checkpoints (torch.distributed.checkpoint folders written under FSDP) ---------------------------------


def read_sharded_checkpoint(path: str | Path, keys: tuple[str, ...] | None = ("state_dict",),
                            load_tensors: bool = True) -> dict[str, Any]:
    """A sharded checkpoint folder as one Lightning-style checkpoint dict, assembled on this process (no process
    group needed): ``keys`` picks what to read (``state_dict``: the weights; None: everything, optimizer state
    too); ``load_tensors=False`` gives meta tensors of the saved shapes without reading any data."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path).expanduser()
    checkpoint = safe_torch_load(path / SHARDED_METADATA)
    if not load_tensors:  # shapes from the metadata; only the small non-tensor items (param groups) are read
        from torch.distributed.checkpoint._traverse import get_element, set_element

        metadata = SafeFileSystemReader(str(path)).read_metadata()
        state: dict[str, Any] = {}
        small = {}
        for key, item in metadata.state_dict_metadata.items():
            where = metadata.planner_data.get(key, (key,))
            if keys is not None and where[0] not in keys:
                continue
            if isinstance(item, TensorStorageMetadata):
                set_element(state, where, torch.empty(item.size, dtype=item.properties.dtype, device="meta"))
            else:
                small[key] = where
        if small:
            loaded: dict[str, Any] = {}
            _read_dcp(loaded, path, keys=set(small))
            for where in small.values():
                set_element(state, where, get_element(loaded, where))
        return {**checkpoint, **state}
    state = {}
    _read_dcp(state, path, keys=set(keys) if keys is not None else None)
    return {**checkpoint, **state}


def _read_dcp(state: dict, path: Path, keys: set[str] | None) -> None:
    """Read the entries ``keys`` (None: all) of a sharded checkpoint into ``state`` on this process, safely."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _load_state_dict(state, storage_reader=SafeFileSystemReader(str(path)), no_dist=True,
                         planner=SafeEmptyStateDictLoadPlanner(keys=keys))
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - a reader's failure (torch wraps it in a
        # CheckpointException, a BaseException, that lists each rank's)
        cause = failure_cause(error)
        if isinstance(cause, CheckpointError):
            raise cause from None
        raise CheckpointError(f"{path} is not a readable sharded checkpoint: {first_line(cause)}") from None


def sharded_to_full_checkpoint(checkpoint: dict) -> dict:
    """A sharded checkpoint read whole (``optimizer_0``, ... named) -> Lightning's single-file layout."""
    optimizers = sorted((key for key in checkpoint if key.startswith("optimizer_") and key[10:].isdigit()),
                        key=lambda key: int(key[10:]))
    checkpoint["optimizer_states"] = [optimizer_state_by_index(checkpoint.pop(key)) for key in optimizers]
    return checkpoint
