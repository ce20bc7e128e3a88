"""A checkpoint's weights (EMA by default) and its configs written as one ``.safetensors`` file, which
``infer.py ckpt_path=`` and ``train.py init_from=`` read without Lightning (``ringdit.checkpoints.weights``
reads it back: the configs are JSON in the file's metadata)."""

from __future__ import annotations

import json
from pathlib import Path

from ringdit.common.atomic import atomic_write
from ringdit.checkpoints.location import checked_output, first_line
from ringdit.checkpoints.weights import read_weights
from ringdit.common.errors import CheckpointError


def export_safetensors(ckpt_path: str | Path, out: str | Path, prefer: str = "ema") -> Path:
    """Write a checkpoint's weights (EMA by default) and its configs (as metadata) to a safetensors file that
    ``infer.py ckpt_path=`` and ``train.py init_from=`` read without Lightning."""
    if Path(out).expanduser().resolve() == Path(ckpt_path).expanduser().resolve():
        raise CheckpointError(f"out={out} is the checkpoint itself: exporting would replace it; choose another out")
    state, info = read_weights(ckpt_path, prefer)
    if "model" not in info:
        raise CheckpointError(f"{ckpt_path} carries no model config: only ringdit checkpoints can be exported")
    return write_safetensors(state, info, out)


def write_safetensors(state: dict, info: dict, out: str | Path, what: str = "format=ringdit") -> Path:
    """Write the weights ``state`` with the configs ``info`` (as JSON metadata) to the ``.safetensors`` file
    ``out``, atomically (a kill leaves no half-written file)."""
    from safetensors.torch import save_file

    out = checked_output(out, folder=False, what=what)
    if out.suffix != ".safetensors":
        raise CheckpointError(f"out={out} must end in .safetensors (infer.py and init_from recognise exports by it)")
    metadata = {key: json.dumps(value) for key, value in info.items()}
    metadata["format"] = "ringdit"
    tensors = {key: value.detach().contiguous().clone() for key, value in state.items()}  # no shared storage
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(out) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)
    except OSError as error:
        raise CheckpointError(f"cannot write out={out} ({error.strerror or first_line(error)}); choose a writable "
                              f"file path") from None
    return out
