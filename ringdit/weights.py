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

from ringdit.atomic import atomic_write
from ringdit.errors import CheckpointError
from ringdit.safe_config import check_file_config, check_file_configs

Tensor = torch.Tensor

FILE_CONFIGS = ("model", "data", "objective", "sampling")  # what a ringdit file says about its model
WEIGHT_CHOICES = ("ema", "model")


def safe_torch_load(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load`` restricted to tensors and plain containers, with errors that say what is wrong.

    ``mmap``: map tensors from the file instead of reading them (cheap inspection of a big checkpoint)."""
    path = _existing_file(path)
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
            f"{_first_line(error)}"
        ) from None


def _existing_file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if is_sharded_checkpoint(path):
        check_sharded_files(path)
        return path
    if path.is_dir() and any(path.glob("*.distcp")):  # the start of a sharded checkpoint, without its index
        missing = [name for name in (".metadata", SHARDED_METADATA) if not (path / name).is_file()]
        raise CheckpointError(f"{path} is an incomplete sharded checkpoint: {' and '.join(missing)} missing (copied "
                              f"or synced only in part?); copy the whole folder again, or use an earlier checkpoint")
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


def check_sharded_files(path: Path) -> None:
    """Every shard file the folder's ``.metadata`` indexes is there and long enough: a folder copied or synced in
    part is refused by name here, in the launching process, instead of failing in a rank after the run started.
    Reads only the index; no tensor data."""
    from ringdit.safe_dcp import SafeFileSystemReader

    try:
        metadata = SafeFileSystemReader(str(path)).read_metadata()
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - a torn or foreign .metadata: whatever unpickling it raised
        raise CheckpointError(f"{path}: its .metadata is not readable ({_first_line(error)}); the checkpoint is "
                              f"damaged: copy it again, or use an earlier checkpoint") from None
    needed: dict[str, int] = {}  # shard file -> bytes its entries reach
    for item in (metadata.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    problems = []
    for name, end in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            problems.append(f"{name} is missing")
        elif shard.stat().st_size < end:
            problems.append(f"{name} is truncated ({shard.stat().st_size} of {end} bytes)")
    if problems:
        shown = ", ".join(problems[:5]) + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"{path} is an incomplete sharded checkpoint: {shown} (of the {len(needed)} shard "
                              f"files its .metadata lists); copy the whole folder again, or use an earlier checkpoint")


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
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ringdit.safe_dcp import SafeFileSystemReader

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

    from ringdit.safe_dcp import SafeEmptyStateDictLoadPlanner, SafeFileSystemReader, failure_cause

    try:
        _load_state_dict(state, storage_reader=SafeFileSystemReader(str(path)), no_dist=True,
                         planner=SafeEmptyStateDictLoadPlanner(keys=keys))
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - a reader's failure (torch wraps it in a
        # CheckpointException, a BaseException, that lists each rank's)
        cause = failure_cause(error)
        if isinstance(cause, CheckpointError):
            raise cause from None
        raise CheckpointError(f"{path} is not a readable sharded checkpoint: {_first_line(cause)}") from None


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
        "state": {index[name]: value for name, value in state.get("state", {}).items()},  # none saved: no state
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                         for group in state["param_groups"]],
    }


def sharded_to_full_checkpoint(checkpoint: dict) -> dict:
    """A sharded checkpoint read whole (``optimizer_0``, ... named) -> Lightning's single-file layout."""
    optimizers = sorted((key for key in checkpoint if key.startswith("optimizer_") and key[10:].isdigit()),
                        key=lambda key: int(key[10:]))
    checkpoint["optimizer_states"] = [optimizer_state_by_index(checkpoint.pop(key)) for key in optimizers]
    return checkpoint


# ---- reading any supported format as a plain model state dict ------------------------------------------------------


def read_weights(path: str | Path, prefer: str = "ema", load_tensors: bool = True) -> tuple[dict[str, Tensor], dict]:
    """``(state_dict, info)`` for the DiT in ``path``; ``info`` holds what the file says about the model
    (``model``, ``data``, ``objective``, ``sampling`` configs) where it says anything.

    - ``.safetensors``: a ringdit export (EMA weights, configs in the metadata) or any plain DiT state dict;
    - a ringdit Lightning checkpoint: ``prefer="ema"`` (default) or ``"model"`` (the raw trained weights);
    - a ringdit sharded (FSDP) checkpoint folder, the same way (``load_tensors=False``: meta tensors, shapes only);
    - an original facebookresearch/DiT ``.pt``: a bare state dict, or its training checkpoint ``{"model", "ema"}``.
    """
    if prefer not in WEIGHT_CHOICES:
        raise ValueError(f"the weights to read must be one of {' | '.join(WEIGHT_CHOICES)} (infer.py weights=, "
                         f"train.py init_weights=, export weights=), got {prefer!r}")
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
        if not isinstance(hparams, dict):
            raise CheckpointError(f"{path}: its hyper_parameters are a {type(hparams).__name__}, not a dict of configs")
        check_file_configs(str(path), hparams)  # every config the file carries, used here or not
        info = {key: hparams[key] for key in FILE_CONFIGS if key in hparams}
        if hparams.get("lora"):  # a LoRA run: its adapter settings (rank, alpha, targets)
            info["lora"] = hparams["lora"]
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
    info = {}
    for key in FILE_CONFIGS:
        if key in metadata:
            try:
                info[key] = json.loads(metadata[key])
            except json.JSONDecodeError as error:
                raise CheckpointError(f"{path}: its metadata entry {key!r} is not valid JSON ({error}); re-export the "
                                      f"file with python -m ringdit.export") from None
            check_file_config(str(path), key, info[key])
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

    if Path(out).expanduser().resolve() == Path(ckpt_path).expanduser().resolve():
        raise CheckpointError(f"out={out} is the checkpoint itself: exporting would replace it; choose another out")
    state, info = read_weights(ckpt_path, prefer)
    if "model" not in info:
        raise CheckpointError(f"{ckpt_path} carries no model config: only ringdit checkpoints can be exported")
    out = Path(out).expanduser()
    if out.is_dir():
        raise CheckpointError(f"out={out} is a folder; give the file to write, e.g. out={out / 'weights.safetensors'}")
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
        raise CheckpointError(f"cannot write out={out} ({error.strerror or _first_line(error)}); choose a writable "
                              f"file path") from None
    return out
