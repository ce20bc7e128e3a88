"""Reading and writing model weights safely: Lightning checkpoints, safetensors exports, original DiT ``.pt`` files.

Nothing here unpickles code: ``.ckpt``/``.pt`` files load with ``torch.load(weights_only=True)``, which only builds
tensors and plain containers, and exports are safetensors. A file that would need arbitrary Python objects is
refused with an error that says so.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

Tensor = torch.Tensor


class CheckpointError(ValueError):
    """A weights file that is missing, unreadable, unsafe or does not fit the model."""


def safe_torch_load(path: str | Path, map_location: Any = "cpu") -> Any:
    """``torch.load`` restricted to tensors and plain containers, with errors that say what is wrong."""
    path = _existing_file(path)
    try:
        # argparse.Namespace: facebookresearch/DiT's training checkpoints store their args as one; rebuilding it
        # only sets attributes.
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location=map_location, weights_only=True)
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
            f"{_first_line(error)}"
        ) from None


def _existing_file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if is_sharded_checkpoint(path):
        return path
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist" + (" (it is a folder)" if path.is_dir() else ""))
    return path


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# ---- sharded checkpoints (torch.distributed.checkpoint folders written under FSDP) ---------------------------------

SHARDED_METADATA = "meta.pt"  # Lightning's name for the non-tensor part (step, loops, hparams, ...)


def is_sharded_checkpoint(path: str | Path) -> bool:
    path = Path(path).expanduser()
    return path.is_dir() and (path / SHARDED_METADATA).is_file() and (path / ".metadata").is_file()


def recover_checkpoint(path: str | Path) -> None:
    """Finish a sharded save that was killed between its two renames (see ``ringdit.training.fsdp.replace_folder``):
    the previous complete checkpoint, set aside as ``.<name>.old``, goes back to ``path``."""
    path = Path(path).expanduser()
    aside = path.with_name(f".{path.name}.old")
    if not path.exists() and is_sharded_checkpoint(aside):
        aside.rename(path)


def read_sharded_checkpoint(path: str | Path, keys: tuple[str, ...] | None = ("state_dict",),
                            load_tensors: bool = True) -> dict[str, Any]:
    """A sharded checkpoint folder as one Lightning-style checkpoint dict, assembled on this process (no process
    group needed): ``keys`` picks what to read (``state_dict``: the weights; None: everything, optimizer state
    too); ``load_tensors=False`` gives meta tensors of the saved shapes without reading any data."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path).expanduser()
    checkpoint = safe_torch_load(path / SHARDED_METADATA)
    reader = FileSystemReader(str(path))
    if not load_tensors:
        metadata = reader.read_metadata()
        state: dict[str, Any] = {}
        for key, item in metadata.state_dict_metadata.items():
            where = metadata.planner_data.get(key, (key,))
            if isinstance(item, TensorStorageMetadata) and (keys is None or where[0] in keys):
                state.setdefault(where[0], {})[".".join(map(str, where[1:]))] = torch.empty(
                    item.size, dtype=item.properties.dtype, device="meta")
        return {**checkpoint, **state}
    state = {}
    try:
        _load_state_dict(state, storage_reader=reader, no_dist=True,
                         planner=_EmptyStateDictLoadPlanner(keys=set(keys) if keys is not None else None))
    except Exception as error:  # torch wraps a reader's failure in a CheckpointException listing every rank's
        raise CheckpointError(f"{path} is not a readable sharded checkpoint: {_first_line(error)}") from None
    return {**checkpoint, **state}


# ---- reading any supported format as a plain model state dict ------------------------------------------------------


def read_weights(path: str | Path, prefer: str = "ema", load_tensors: bool = True) -> tuple[dict[str, Tensor], dict]:
    """``(state_dict, info)`` for the DiT in ``path``; ``info`` holds what the file says about the model
    (``model``, ``data``, ``objective``, ``sampling`` configs) where it says anything.

    - ``.safetensors``: a ringdit export (EMA weights, configs in the metadata) or any plain DiT state dict;
    - a ringdit Lightning checkpoint: ``prefer="ema"`` (default) or ``"model"`` (the raw trained weights);
    - a ringdit sharded (FSDP) checkpoint folder, the same way (``load_tensors=False``: meta tensors, shapes only);
    - an original facebookresearch/DiT ``.pt``: a bare state dict, or its training checkpoint ``{"model", "ema"}``.
    """
    if prefer not in ("ema", "model"):
        raise ValueError(f"prefer must be 'ema' or 'model', got {prefer!r}")
    path = _existing_file(path)
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    content = read_sharded_checkpoint(path, load_tensors=load_tensors) if path.is_dir() else safe_torch_load(path)
    if not isinstance(content, dict):
        raise CheckpointError(f"{path} holds a {type(content).__name__}, not a state dict or checkpoint")
    if "state_dict" in content:  # Lightning checkpoint written by ringdit
        prefix = "ema.module." if prefer == "ema" else "model."
        state = _strip_prefix(content["state_dict"], prefix)
        if not state:
            raise CheckpointError(f"{path} is a Lightning checkpoint without '{prefix}*' weights: not from ringdit")
        hparams = content.get("hyper_parameters", {})
        info = {key: hparams[key] for key in ("model", "data", "objective", "sampling", "lora") if key in hparams}
        return state, info
    if prefer in content and isinstance(content[prefer], dict):  # original DiT training checkpoint
        return content[prefer], {}
    if all(isinstance(v, Tensor) for v in content.values()):
        return content, {}
    raise CheckpointError(f"{path} is neither a ringdit checkpoint nor a DiT state dict (keys: {sorted(content)[:8]})")


def _read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            state = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path} is not a readable safetensors file: {_first_line(error)}") from None
    info = {key: json.loads(value) for key, value in metadata.items() if key in ("model", "data", "objective", "sampling")}
    return state, info


def _strip_prefix(state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}


# ---- loading into a model ------------------------------------------------------------------------------------------


def check_compatible(model: nn.Module, state: dict[str, Tensor], source: str = "checkpoint") -> None:
    """Raise one error listing the missing keys, unexpected keys and shape mismatches (the first 10 of each)."""
    expected = model.state_dict()

    def ordered(keys):  # embedders and final layer first: they tell the model size; the repeated blocks after
        return sorted(keys, key=lambda key: (key.startswith("blocks."), key))

    missing = ordered(set(expected) - set(state))
    unexpected = ordered(set(state) - set(expected))
    mismatched = [
        f"{key} {tuple(state[key].shape)} vs {tuple(expected[key].shape)}"
        for key in ordered(set(expected) & set(state))
        if state[key].shape != expected[key].shape
    ]
    parts = [
        f"{what} ({len(items)}): " + ", ".join(items[:10]) + (", ..." if len(items) > 10 else "")
        for what, items in (("shape mismatches, file vs model", mismatched), ("missing keys", missing),
                            ("unexpected keys", unexpected))
        if items
    ]
    if parts:
        raise CheckpointError(f"{source} does not fit this model (another model size or layout?) -- " + "; ".join(parts))


LABEL_TABLE = "y_embedder.embedding_table.weight"


def resize_label_embedding(state: dict[str, Tensor], rows: int, generator: torch.Generator | None = None) -> dict:
    """Fit a label table of another class count to ``rows`` rows (classes + the null row of CFG).

    Kept: the first classes both tables share, and the null (last) row, which carries what the model learned about
    unconditional generation. New classes start like the original's init (N(0, 0.02)).
    """
    table = state.get(LABEL_TABLE)
    if table is None or table.shape[0] == rows:
        return state
    old_classes, new_classes = table.shape[0] - 1, rows - 1
    resized = torch.randn(rows, table.shape[1], generator=generator, dtype=torch.float32).to(table.dtype) * 0.02
    shared = min(old_classes, new_classes)
    resized[:shared] = table[:shared]
    resized[-1] = table[-1]
    return {**state, LABEL_TABLE: resized}


def load_model_weights(model: nn.Module, path: str | Path, prefer: str = "ema", resize_labels: bool = False) -> dict:
    """Load ``path``'s weights into ``model`` with strict key and shape checks; returns the file's info.

    ``resize_labels``: accept a label embedder trained for another number of classes (see
    ``resize_label_embedding``), for fine-tuning on new classes.
    """
    state, info = read_weights(path, prefer)
    if resize_labels:
        state = resize_label_embedding(state, model.state_dict()[LABEL_TABLE].shape[0])
    check_compatible(model, state, source=str(path))
    model.load_state_dict(state, strict=True)
    return info


def export_safetensors(ckpt_path: str | Path, out: str | Path, prefer: str = "ema") -> Path:
    """Write a checkpoint's weights (EMA by default) and its configs (as metadata) to a safetensors file that
    ``infer.py ckpt_path=`` and ``train.py init_from=`` read without Lightning."""
    from safetensors.torch import save_file

    state, info = read_weights(ckpt_path, prefer)
    if "model" not in info:
        raise CheckpointError(f"{ckpt_path} carries no model config: only ringdit checkpoints can be exported")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {key: json.dumps(value) for key, value in info.items()}
    metadata["format"] = "ringdit"
    tensors = {key: value.detach().contiguous().clone() for key, value in state.items()}  # no shared storage
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(out)
    return out
