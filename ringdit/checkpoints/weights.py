"""A model's weights from any supported format, as a plain state dict plus what the file says about the model.

The formats: ringdit's safetensors exports, ringdit Lightning checkpoints (a file, or a sharded FSDP folder; the EMA
weights or the raw trained ones), and original facebookresearch/DiT ``.pt`` files. The configs a file carries are
data, checked against an allow-list of targets (``ringdit.common.safe_config``) before anything instantiates them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ringdit.checkpoints.location import existing_checkpoint, first_line
from ringdit.checkpoints.loading import read_sharded_checkpoint, safe_torch_load
from ringdit.common.errors import CheckpointError
from ringdit.common.safe_config import check_file_config, check_file_configs

Tensor = torch.Tensor

FILE_CONFIGS = ("model", "data", "objective", "sampling")  # what a ringdit file says about its model
WEIGHT_CHOICES = ("ema", "model")


def read_weights(path: str | Path, prefer: str = "ema", load_tensors: bool = True,
                 mmap: bool = False) -> tuple[dict[str, Tensor], dict]:
    """``(state_dict, info)`` for the DiT in ``path``; ``info`` holds what the file says about the model
    (``model``, ``data``, ``objective``, ``sampling`` configs) where it says anything.

    - ``.safetensors``: a ringdit export (EMA weights, configs in the metadata) or any plain DiT state dict;
    - a ringdit Lightning checkpoint: ``prefer="ema"`` (default) or ``"model"`` (the raw trained weights);
    - a ringdit sharded (FSDP) checkpoint folder, the same way;
    - an original facebookresearch/DiT ``.pt``: a bare state dict, or its training checkpoint ``{"model", "ema"}``.

    ``load_tensors=False``: meta tensors of the saved shapes (folders and safetensors: nothing else is read; a
    ``torch.save`` file is memory-mapped, its tensors unread);
    ``mmap``: a ``torch.save`` file's tensors are mapped, read only where they are used.
    """
    if prefer not in WEIGHT_CHOICES:
        raise ValueError(f"the weights to read must be one of {' | '.join(WEIGHT_CHOICES)} (infer.py weights=, "
                         f"train.py init_weights=, export weights=), got {prefer!r}")
    path = existing_checkpoint(path)
    if path.suffix == ".safetensors":
        return _read_safetensors(path, load_tensors)
    content = read_sharded_checkpoint(path, load_tensors=load_tensors) if path.is_dir() else \
        safe_torch_load(path, mmap=mmap or not load_tensors)  # shapes only: map the file, read nothing
    if not isinstance(content, dict):
        raise CheckpointError(f"{path} holds a {type(content).__name__}, not a state dict or checkpoint")
    if "state_dict" in content:  # Lightning checkpoint written by ringdit
        prefix = weights_prefix(content, prefer)
        state = _strip_prefix(content["state_dict"], prefix)
        if not state:
            raise CheckpointError(f"{path} is a Lightning checkpoint without '{prefix}*' weights: not from ringdit")
        hparams = content.get("hyper_parameters", {})
        if not isinstance(hparams, dict):
            raise CheckpointError(f"{path}: its hyper_parameters are a {type(hparams).__name__}, not a dict of configs")
        check_file_configs(str(path), hparams)  # every config the file carries, used here or not
        info = {key: hparams[key] for key in FILE_CONFIGS if key in hparams}
        info["weights"] = prefix.split(".")[0]  # ema | model: what was read
        if hparams.get("lora"):  # a LoRA run: its adapter settings (rank, alpha, targets)
            info["lora"] = hparams["lora"]
        return state, info
    if prefer in content and isinstance(content[prefer], dict):  # original DiT training checkpoint
        return content[prefer], {}
    if all(isinstance(v, Tensor) for v in content.values()):
        return content, {}
    raise CheckpointError(f"{path} is neither a ringdit checkpoint nor a DiT state dict (keys: {sorted(content)[:8]})")


def weights_prefix(content: dict, prefer: str) -> str:
    """The keys of a ringdit checkpoint's weights: ``ema.module.`` (prefer="ema") or ``model.``; a run trained
    without an EMA (``ema_decay`` null or 0) has only its raw weights, which are then what "ema" reads."""
    if prefer == "ema" and not content.get("hyper_parameters", {}).get("ema_decay", 1) \
            and not any(key.startswith("ema.module.") for key in content["state_dict"]):
        return "model."
    return "ema.module." if prefer == "ema" else "model."


def _read_safetensors(path: Path, load_tensors: bool = True) -> tuple[dict[str, Tensor], dict]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            state = {key: f.get_tensor(key) if load_tensors else _shape_only(f.get_slice(key)) for key in f.keys()}
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path} is not a readable safetensors file: {first_line(error)}") from None
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


def _shape_only(piece) -> Tensor:
    """A meta tensor of a safetensors entry's shape and dtype (read from the header)."""
    from safetensors.torch import _getdtype

    return torch.empty(piece.get_shape(), dtype=_getdtype(piece.get_dtype()), device="meta")
