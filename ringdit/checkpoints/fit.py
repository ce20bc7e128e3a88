"""Loading weights into a model: one error that lists every key and shape that does not fit, and label tables
trained for another number of classes fitted to this model's (fine-tuning on new classes)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ringdit.checkpoints.weights import read_weights
from ringdit.errors import CheckpointError

Tensor = torch.Tensor

LABEL_TABLE = "y_embedder.embedding_table.weight"


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
