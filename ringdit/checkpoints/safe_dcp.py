"""Reading ``torch.distributed.checkpoint`` (DCP) folders as data, never as code.

DCP unpickles two things with plain ``pickle``: the folder's ``.metadata`` index (``FileSystemReader.read_metadata``)
and every non-tensor entry of the state (``DefaultLoadPlanner.load_bytes``: ``torch.load(weights_only=False)``). A
checkpoint folder from elsewhere could run code through either. ``SafeFileSystemReader`` unpickles the index with
only DCP's own metadata classes (and torch sizes, dtypes and layouts) allowed; ``SafeLoadPlanner`` and
``SafeEmptyStateDictLoadPlanner`` load the non-tensor entries with ``torch.load(weights_only=True)``. Tensors are
already read with ``weights_only=True`` by DCP itself. Every DCP read in ringdit goes through these.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ringdit.common.errors import CheckpointError

# What a DCP .metadata legitimately refers to (torch 2.4 ... 2.13): its own dataclasses, torch.Size, dtypes, the
# layout / memory-format decoders, and the path it was saved to.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _NotMetadata(pickle.UnpicklingError):
    """The pickle names a global outside the allow-list (anything else wrong with it stays an UnpicklingError)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or module == "torch" and isinstance(getattr(torch, name, None),
                                                                                         torch.dtype):
            return super().find_class(module, name)
        raise _NotMetadata(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` can only build DCP's metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except _NotMetadata as error:
                raise CheckpointError(f"refusing to read {path}: {error}; a checkpoint's index holds only DCP "
                                      f"metadata, so this one was altered or is not a checkpoint") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not a checkpoint's metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_bytes_safely(planner: DefaultLoadPlanner, read_item, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` with ``weights_only=True``: numbers, strings, containers and tensors."""
    try:
        loaded = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as error:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(error))
        raise CheckpointError(f"refusing to load the checkpoint entry {read_item.dest_index.fqn!r}: it holds Python "
                              f"objects that would run code when unpickled"
                              + (f" ({unsafe.group(1)})" if unsafe else "")) from None
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        _load_bytes_safely(self, read_item, value)


class SafeEmptyStateDictLoadPlanner(_EmptyStateDictLoadPlanner):
    """Reads whatever the checkpoint holds (``keys``: only those) into an empty state dict, safely."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        _load_bytes_safely(self, read_item, value)


def failure_cause(error: BaseException) -> BaseException:
    """What went wrong inside DCP: it wraps each rank's exception in a ``CheckpointException`` listing the ranks."""
    if isinstance(error, CheckpointException) and error.failures:
        first = next(iter(error.failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return error
