"""Checkpoint files written atomically: a kill during saving never replaces a good checkpoint with a torn one."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ringdit.common.atomic import atomic_write
from ringdit.checkpoints.location import is_sharded_checkpoint
from ringdit.checkpoints.loading import read_sharded_checkpoint, safe_torch_load, sharded_to_full_checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written through ``ringdit.common.atomic.atomic_write`` (a kill never leaves a torn one; the umask's
    mode). Loading never unpickles code: ``weights_only`` loading (see
    ``ringdit.checkpoints.loading.safe_torch_load``)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        with atomic_write(path) as tmp:
            torch.save(checkpoint, tmp)

    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None):
        if is_sharded_checkpoint(path):  # saved under FSDP, resumed replicated: assemble it whole
            return sharded_to_full_checkpoint(read_sharded_checkpoint(path, keys=None))
        return safe_torch_load(path, map_location=map_location or "cpu")
