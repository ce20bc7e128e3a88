"""Checkpoint files written atomically: a kill during saving never replaces a good checkpoint with a torn one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ringdit.weights import (
    file_mode,
    is_sharded_checkpoint,
    optimizer_state_by_index,
    optimizer_state_by_name,
    read_sharded_checkpoint,
    safe_torch_load,
    sharded_to_full_checkpoint,
)

__all__ = ["AtomicCheckpointIO", "optimizer_state_by_index", "optimizer_state_by_name"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file in the same folder, fsync, then ``os.replace`` onto the final name (atomic on
    POSIX); the file gets the mode ``torch.save`` would give it (the umask's). Loading never unpickles code: ``weights_only`` loading (see ``ringdit.weights.safe_torch_load``)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a save that was killed
            stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, file_mode())  # mkstemp's 0600 would hide checkpoints from a shared group; open() wouldn't
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)

    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None):
        if is_sharded_checkpoint(path):  # saved under FSDP, resumed replicated: assemble it whole
            return sharded_to_full_checkpoint(read_sharded_checkpoint(path, keys=None))
        return safe_torch_load(path, map_location=map_location or "cpu")


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
