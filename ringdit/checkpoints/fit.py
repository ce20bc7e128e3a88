"""Loading weights into a model: one error that lists every key and shape that does not fit, and label tables
trained for another number of classes fitted to this model's (fine-tuning on new classes)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from ringdit.checkpoints.weights import read_weights
from ringdit.common.errors import CheckpointError

Tensor = torch.Tensor

LABEL_TABLE = "y_embedder.embedding_table.weight"
# parameters a file may lack: a guidance embedder given to a DiT trained without one (model.guidance_embed) starts
# at its initial value, whose zero output layer leaves the model as the file holds it
OPTIONAL_KEYS = ("g_embedder.",)


def check_compatible(model: nn.Module | Mapping[str, Tensor | torch.Size], state: Mapping[str, Tensor | torch.Size],
                     source: str = "checkpoint") -> None:
    """Raise one error listing the missing keys, unexpected keys and shape mismatches (the first 10 of each) of
    ``state`` (tensors, or their shapes) against ``model`` (a module, or the tensors / shapes it expects)."""
    expected = model.state_dict() if isinstance(model, nn.Module) else model

    def shape(value) -> tuple[int, ...]:
        return tuple(value.shape if isinstance(value, Tensor) else value)

    def ordered(keys):  # embedders and final layer first: they tell the model size; the repeated blocks after
        return sorted(keys, key=lambda key: (key.startswith("blocks."), key))

    missing = ordered({key for key in set(expected) - set(state) if not key.startswith(OPTIONAL_KEYS)})
    unexpected = ordered(set(state) - set(expected))
    mismatched = [
        f"{key} {shape(state[key])} vs {shape(expected[key])}"
        for key in ordered(set(expected) & set(state))
        if shape(state[key]) != shape(expected[key])
    ]
    parts = [
        f"{what} ({len(items)}): " + ", ".join(items[:10]) + (", ..." if len(items) > 10 else "")
        for what, items in (("shape mismatches, file vs model", mismatched), ("missing keys", missing),
                            ("unexpected keys", unexpected))
        if items
    ]
    if parts:
        raise CheckpointError(f"{source} does not fit this model (another model size or layout?) -- " + "; ".join(parts))


def first_misfit(expected: Mapping[str, Tensor], given: Mapping[str, Tensor], given_name: str, expected_name: str
                 ) -> str | None:
    """The first key (embedders and final layer first: they tell the model size) that ``given`` lacks, holds besides,
    or holds in another shape than ``expected``, as a phrase naming both sides; None when all fit."""
    for key in sorted(set(expected) | set(given), key=lambda key: (key.startswith("blocks."), key)):
        if key not in given:
            return f"{given_name} lacks {key}, which {expected_name} has"
        if key not in expected:
            return f"{given_name} holds {key}, which {expected_name} has not"
        if tuple(given[key].shape) != tuple(expected[key].shape):
            return f"{key} is {tuple(given[key].shape)} in {given_name} but {tuple(expected[key].shape)} in {expected_name}"
    return None


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
