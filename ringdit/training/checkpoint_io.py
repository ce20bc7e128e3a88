"""Checkpoint files written atomically: a kill during saving never replaces a good checkpoint with a torn one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ringdit.weights import is_sharded_checkpoint, read_sharded_checkpoint, safe_torch_load


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file in the same folder, fsync, then ``os.replace`` onto the final name (atomic on
    POSIX). Loading never unpickles code: ``weights_only`` loading (see ``ringdit.weights.safe_torch_load``)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a save that was killed
            stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
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


# Optimizer state keyed two ways: torch's ``Optimizer.state_dict`` numbers the parameters in param_groups order
# (0, 1, ...); ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (FSDP checkpoints) names them
# by their module path. The param_groups' ``params`` lists give the order either way.


def optimizer_state_by_name(state: dict, names: list[str]) -> dict:
    """torch's numbered optimizer state -> named; ``names[i]`` is the module path of the optimizer's i-th parameter."""
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                         for group in state["param_groups"]],
    }


def optimizer_state_by_index(state: dict) -> dict:
    """Named optimizer state -> torch's numbered one (parameters numbered in param_groups order)."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                         for group in state["param_groups"]],
    }


def sharded_to_full_checkpoint(checkpoint: dict) -> dict:
    """A sharded checkpoint read whole (``optimizer_0``, ... named) -> Lightning's single-file layout."""
    optimizers = sorted((key for key in checkpoint if key.startswith("optimizer_") and key[10:].isdigit()),
                        key=lambda key: int(key[10:]))
    checkpoint["optimizer_states"] = [optimizer_state_by_index(checkpoint.pop(key)) for key in optimizers]
    return checkpoint


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
