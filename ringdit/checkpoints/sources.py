"""Weights files read a piece at a time: each rank reads the tensors, or the slices of them, that it holds.

``weights_source(path, ...)`` opens what ``init_from`` / ``model.pretrained`` name -- a diffusers folder (one
``*.safetensors`` or the shards its index lists), a ringdit export (``.safetensors``), a ringdit checkpoint file
(``.ckpt``, memory-mapped) or an FSDP run's sharded checkpoint folder -- without reading any tensor data. Its
``shapes`` (from the headers) are checked against the model before anything loads, and ``fill(targets)`` copies
into each target tensor the part of the file's tensor it covers: a DTensor shard's rows, a plain tensor whole.
safetensors reads only those bytes (``get_slice``); a sharded checkpoint is read by ``torch.distributed.checkpoint``,
which reads the saved chunks that overlap each rank's shards.

Keys are the model's names: a source drops the file's own prefix (``ema.module.``, ``model.``) or adds the model's
(``transformer.`` for a diffusers folder), and ``scope`` says which of the model's names the file is expected to hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from ringdit.checkpoints.loading import _read_dcp
from ringdit.checkpoints.location import existing_checkpoint, first_line, is_sharded_checkpoint
from ringdit.checkpoints.safe_dcp import SafeFileSystemReader, SafeLoadPlanner, failure_cause
from ringdit.checkpoints.weights import read_weights
from ringdit.common.errors import CheckpointError

Tensor = torch.Tensor


def local_index(tensor: Tensor) -> tuple[slice, ...]:
    """The part of the full tensor that ``tensor`` holds on this rank: a DTensor's local shard (any mesh and
    placements, FSDP's uneven last shard included), or all of a plain tensor."""
    if not hasattr(tensor, "device_mesh"):
        return tuple(slice(0, n) for n in tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(start, start + n) for start, n in zip(offset, shape))


def local_part(tensor: Tensor) -> Tensor:
    """The storage of this rank's part of ``tensor``, to write in place."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class WeightSource:
    """A weights file's tensors by the model's names; ``shapes`` come from its header, nothing else is read yet."""

    path: str
    scope: str | tuple[str, ...] = ""  # the model names this file holds all of: those starting with (one of) scope
    shapes: dict[str, torch.Size]

    def read(self, name: str, index: tuple[slice, ...]) -> Tensor:
        """The part ``index`` of tensor ``name`` (a CPU tensor in the file's dtype)."""
        raise NotImplementedError

    @torch.no_grad()
    def fill(self, targets: dict[str, Tensor]) -> None:
        """Copy into each target (by model name) the part of the file's tensor that it holds."""
        for name, target in targets.items():
            local_part(target).copy_(self.read(name, local_index(target)))


class SafetensorsSource(WeightSource):
    """One or more safetensors files (a diffusers folder's shards, a ringdit export); ``prefix`` is prepended to the
    file's keys to give the model's names. ``files`` may also be ``{prefix: files}``: a folder whose parts are
    different modules of the model (a two-expert model's ``transformer/`` and ``transformer_2/``)."""

    def __init__(self, path: str, files: Iterable[Path] | dict[str, Iterable[Path]], prefix: str = ""):
        from safetensors import SafetensorError, safe_open

        parts = files if isinstance(files, dict) else {prefix: files}
        self.path, self.scope, self.shapes, self._where = path, tuple(parts), {}, {}
        self._files = {}
        for key_prefix, file in ((key_prefix, file) for key_prefix, part in parts.items() for file in part):
            try:
                handle = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as error:
                raise CheckpointError(f"{file} is not a readable safetensors file: {first_line(error)}") from None
            self._files[file] = handle
            for key in handle.keys():
                self.shapes[key_prefix + key] = torch.Size(handle.get_slice(key).get_shape())
                self._where[key_prefix + key] = (file, key)

    def read(self, name: str, index: tuple[slice, ...]) -> Tensor:
        file, key = self._where[name]
        try:
            return self._files[file].get_slice(key)[index] if index else self._files[file].get_tensor(key)
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
            raise CheckpointError(f"{file}: cannot read {key!r} ({first_line(error)}): the file is damaged or was "
                                  f"changed while the run started; re-save or re-download it") from None


class TensorsSource(WeightSource):
    """A state dict already opened (a memory-mapped ``torch.save`` file: only the pages read are loaded)."""

    def __init__(self, path: str, state: dict[str, Tensor]):
        self.path, self._state = path, state
        self.shapes = {name: value.shape for name, value in state.items() if isinstance(value, Tensor)}

    def read(self, name: str, index: tuple[slice, ...]) -> Tensor:
        return self._state[name][index]


class ShardedCheckpointSource(WeightSource):
    """An FSDP run's ``torch.distributed.checkpoint`` folder: ``prefix`` (``ema.module.`` or ``model.``) picks the
    weights; ``fill`` is collective when a process group exists (every rank calls it with its own shards)."""

    def __init__(self, path: Path, prefix: str):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path, self._folder, self._prefix = str(path), path, prefix
        saved = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
        head = f"state_dict.{prefix}"
        self.shapes = {key[len(head):]: item.size for key, item in saved.items()
                       if key.startswith(head) and isinstance(item, TensorStorageMetadata)}
        if not self.shapes:
            raise CheckpointError(f"{path} is a sharded checkpoint without '{prefix}*' weights: not from ringdit")

    @torch.no_grad()
    def fill(self, targets: dict[str, Tensor]) -> None:
        import torch.distributed.checkpoint as dcp

        state = {"state_dict": {self._prefix + name: target for name, target in targets.items()}}
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(str(self._folder)), planner=SafeLoadPlanner())
        except BaseException as error:  # a reader's failure, wrapped by torch in a CheckpointException per rank
            cause = failure_cause(error)
            if isinstance(cause, (KeyboardInterrupt, SystemExit)):
                raise
            if isinstance(cause, CheckpointError):
                raise cause from None
            raise CheckpointError(f"{self._folder} is not a readable sharded checkpoint: {first_line(cause)}") \
                from None

    def read(self, name: str, index: tuple[slice, ...]) -> Tensor:
        """One tensor read whole on this process (only for a table that is resized before loading)."""
        from torch.distributed.checkpoint._traverse import set_element

        state: dict = {}
        set_element(state, ("state_dict", self._prefix + name), torch.empty(self.shapes[name]))
        _read_dcp(state, self._folder, keys={"state_dict"})
        return state["state_dict"][self._prefix + name][index]


def weights_source(path: str, prefer: str = "ema", model=None) -> WeightSource:
    """The source for ``init_from`` / ``model.pretrained``: a diffusers folder (read through ``model``'s
    ``pretrained_files``), a sharded checkpoint folder, a ``.safetensors`` export or a ``torch.save`` file."""
    where = Path(path).expanduser()
    if where.is_dir() and not is_sharded_checkpoint(where):  # a diffusers folder: the model knows its layout
        return SafetensorsSource(str(where), model.pretrained_files(str(where)))
    where = existing_checkpoint(where)
    if where.is_dir():
        _, info = read_weights(where, prefer, load_tensors=False)  # the configs it carries are checked; shapes only
        return ShardedCheckpointSource(where, "ema.module." if info["weights"] == "ema" else "model.")
    if where.suffix == ".safetensors":
        read_weights(where, prefer, load_tensors=False)  # its metadata's configs are checked
        return SafetensorsSource(str(where), [where])
    state, _ = read_weights(where, prefer, mmap=True)
    return TensorsSource(str(where), state)
