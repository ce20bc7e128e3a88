"""Several prepared folders in one run (``data.datasets``) and an evaluation set by path (``data.eval``).

``data.datasets=[{path: /data/a, repeats: 2}, {path: /data/b}]`` (from the command line, quoted, or a YAML list):
each entry is a prepared folder (or ``.safetensors`` file) of ``text_latents`` shards, image or video; their
samples are one training set, and every folder keeps its buckets (shards of one latent shape, across folders, are
one bucket, as shards of one folder are). An entry holds:

``path``     the folder, as ``data.path`` takes it (required).
``repeats``  an integer >= 1 (default 1): each of the folder's training samples appears exactly ``repeats`` times per
             epoch (musubi-tuner's and diffusion-pipe's ``num_repeats``). An epoch is sum(samples x repeats) over the
             folders; a bucket is read epoch by epoch in its own seeded order, so over every epoch of a bucket each
             sample is read exactly its folder's repeats times, and a folder's share of the samples read is
             samples x repeats / the epoch.
``weight``   a positive number: the folder's share of the samples read is weight / (sum of the weights), whatever its
             size. Each step's bucket (one folder's samples of one shape) is drawn with the folder's share times the
             bucket's share of the folder's batches; within a folder every sample is read once per epoch of its
             bucket. Either every entry has a weight or none; an entry with a weight takes no repeats (repeats fixes
             a share by counting samples, a weight sets it: the two would contradict each other).

``data.eval=<path>`` (or a list of paths): folders of the same kind whose loss is logged as ``val/loss`` at every
validation, instead of holding out a fraction of the training clips: ``data.val_fraction`` is then 0 unless given.

Which samples a step reads depends on (seed, step, data-parallel rank) and the global batch only (ringdit/data/
steps.py), so a dataset list trains on the same samples in the same order under every rank layout. Every setting
is checked when the data module is built (train.py: before any rank starts), each refusal one line naming it.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ringdit.common.errors import ConfigError
from ringdit.common.seeding import Stream, generator

log = logging.getLogger(__name__)

KEYS = ("path", "repeats", "weight")
DEFAULT_VAL_FRACTION = 0.05  # held out when no evaluation set is given (data.val_fraction: null)
EXAMPLE = "e.g. 'data.datasets=[{path: /data/a, repeats: 2}, {path: /data/b}]'"


@dataclass(frozen=True)
class DatasetEntry:
    path: str
    setting: str               # how refusals and log lines name it: data.datasets[1] (data.path: a single folder)
    repeats: int = 1
    weight: float | None = None


def _plain(value):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def parse_datasets(path, datasets) -> list[DatasetEntry]:
    """``data.path`` (one folder, repeats 1) or ``data.datasets`` (the list), checked: one ConfigError line naming the
    entry and the setting. Paths are checked to exist here; what they hold, by the data module."""
    datasets = _plain(datasets)
    if datasets is None:
        return [DatasetEntry(path, "data.path")]
    if path is not None and str(path) != "":
        raise ConfigError(f"data.path={path} and data.datasets are both set; list the folder in data.datasets "
                          f"({{path: {path}}}) and set data.path=null, or drop data.datasets")
    if not isinstance(datasets, list) or not datasets:
        raise ConfigError(f"data.datasets={datasets!r}: give a list of {{path, repeats, weight}} entries, {EXAMPLE} "
                          f"(or data.datasets=null for data.path)")
    entries = [_entry(k, entry) for k, entry in enumerate(datasets)]
    weighted = [e for e in entries if e.weight is not None]
    if weighted and len(weighted) < len(entries):
        bare = next(e for e in entries if e.weight is None)
        raise ConfigError(f"{bare.setting} has no weight but {weighted[0].setting} has weight {weighted[0].weight}: "
                          f"give every dataset a weight (its share of the samples read), or none (repeats count "
                          f"samples per epoch)")
    return entries


def _entry(k: int, entry) -> DatasetEntry:
    setting = f"data.datasets[{k}]"
    if isinstance(entry, str):  # a bare path: data.datasets=[/data/a,/data/b]
        entry = {"path": entry}
    if not isinstance(entry, dict):
        raise ConfigError(f"{setting}={entry!r}: give {{path: <folder>[, repeats: <n>][, weight: <share>]}}, {EXAMPLE}")
    for key in entry:
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), KEYS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"{setting} has an unknown key {key!r}; {hint}an entry takes {', '.join(KEYS)}")
    path = entry.get("path")
    if path is None or str(path) == "":
        raise ConfigError(f"{setting} has no path; give {{path: <a prepared folder>}} ({EXAMPLE})")
    if not Path(os.path.expanduser(str(path))).exists():
        raise ConfigError(f"{setting}.path={path} does not exist; give a folder of text_latents shards made by "
                          f"python -m ringdit.prepare (or a .safetensors shard)")
    if "repeats" in entry and "weight" in entry:
        raise ConfigError(f"{setting} sets both repeats={entry['repeats']!r} and weight={entry['weight']!r}; repeats "
                          f"sets the folder's share by counting its samples per epoch, weight sets the share directly: "
                          f"keep one of them")
    repeats = entry.get("repeats", 1)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"{setting}.repeats={repeats!r}: give how many times each sample appears per epoch, an "
                          f"integer >= 1 (e.g. repeats: 2)")
    weight = entry.get("weight")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                               or not math.isfinite(weight) or weight <= 0):
        raise ConfigError(f"{setting}.weight={weight!r}: give a positive finite number, the folder's share of the "
                          f"samples read relative to the other weights (e.g. weight: 0.5)")
    return DatasetEntry(str(path), setting, repeats, None if weight is None else float(weight))


def parse_eval(eval_) -> list[str]:
    """``data.eval``: null, a path or a list of paths, each existing."""
    eval_ = _plain(eval_)
    paths = [] if eval_ is None else [eval_] if isinstance(eval_, str) else eval_
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise ConfigError(f"data.eval={eval_!r}: give a prepared folder (or a list of them), e.g. data.eval=/data/eval, "
                          f"or null to hold out data.val_fraction of the training clips")
    for p in paths:
        if not Path(os.path.expanduser(p)).exists():
            raise ConfigError(f"data.eval={p} does not exist; give a folder of text_latents shards made by python -m "
                              f"ringdit.prepare, or data.eval=null to hold out data.val_fraction of the training clips")
    return paths


def resolve_val_fraction(val_fraction, eval_paths: Sequence[str]) -> float:
    """``data.val_fraction``: as given, else 0 with an evaluation set and ``DEFAULT_VAL_FRACTION`` without."""
    if val_fraction is not None:
        return val_fraction
    return 0.0 if eval_paths else DEFAULT_VAL_FRACTION


class DatasetList:
    """The bookkeeping of a dataset list over one concatenated dataset: the training folders' rows in list order,
    then the evaluation rows. ``sizes``: each entry's sample count; ``eval_size``: the evaluation rows."""

    def __init__(self, entries: Sequence[DatasetEntry], sizes: Sequence[int], eval_size: int = 0,
                 eval_paths: Sequence[str] = ()):
        self.entries, self.sizes = list(entries), [int(n) for n in sizes]
        self.eval_size, self.eval_paths = int(eval_size), list(eval_paths)
        self.training_rows = sum(self.sizes)
        self.entry_of_row = np.repeat(np.arange(len(self.sizes)), self.sizes)  # (training rows,)
        self.weighted = self.entries[0].weight is not None  # parse_datasets: all or none

    def split(self, seed: int, val_fraction: float) -> tuple[list[int], list[int]]:
        """(training indices, validation indices) of the concatenated dataset. ``val_fraction`` of the training rows
        are held out, drawn as before dataset lists existed (one folder: the same split); every other training row
        appears its entry's ``repeats`` times; the evaluation rows are validation rows."""
        order = torch.randperm(self.training_rows, generator=generator(Stream.DATA_SPLIT, seed)).tolist()
        held = int(self.training_rows * val_fraction)
        repeats = [e.repeats for e in self.entries]
        train = [i for i in order[held:] for _ in range(repeats[self.entry_of_row[i]])]
        return train, order[:held] + list(range(self.training_rows, self.training_rows + self.eval_size))

    def weighted_groups(self, train: Sequence[int], sample_buckets: np.ndarray, batch_sizes: Sequence[int]
                        ) -> tuple[list[list[int]], list[int], list[float]]:
        """With weights: every (folder, bucket) with training samples is a group of positions in ``train``, drawn
        per step with chance (the folder's weight share) x (the group's share of the folder's batches). Returns the
        groups, their batch sizes and chances."""
        groups: dict[tuple[int, int], list[int]] = {}
        for position, index in enumerate(train):
            groups.setdefault((int(self.entry_of_row[index]), int(sample_buckets[index])), []).append(position)
        keys = sorted(groups)
        total_weight = sum(self.entries[folder].weight for folder in {key[0] for key in keys})
        batches = {key: len(groups[key]) / batch_sizes[key[1]] for key in keys}
        chances = []
        for key in keys:
            folder = sum(b for k, b in batches.items() if k[0] == key[0])
            chances.append(self.entries[key[0]].weight / total_weight * batches[key] / folder)
        return [groups[k] for k in keys], [batch_sizes[k[1]] for k in keys], chances

    def report(self, train: Sequence[int], val: Sequence[int], buckets: Sequence[dict[tuple[int, ...], int]]
               ) -> list[str]:
        """One line per folder (its training samples, repeats or weight, share of an epoch or of the samples read,
        buckets: ``buckets[k]`` maps folder k's latent shapes to their samples) and one for the evaluation set:
        train.py logs them at start-up, before any rank starts."""
        per_entry = np.bincount(self.entry_of_row[np.asarray(train, dtype=np.int64)], minlength=len(self.entries))
        epoch = int(per_entry.sum())
        lines = []
        for k, entry in enumerate(self.entries):
            trained = int(per_entry[k]) // entry.repeats
            kept = f"{trained} samples" + (f" ({self.sizes[k] - trained} of {self.sizes[k]} held out by "
                                           f"data.val_fraction)" if trained != self.sizes[k] else "")
            if self.weighted:
                total = sum(e.weight for e in self.entries)
                share = f"weight {entry.weight:g} = {100 * entry.weight / total:.1f} % of the samples read"
            else:
                share = (f"x {entry.repeats} repeats = {int(per_entry[k])} of an epoch's {epoch} samples "
                         f"({100 * per_entry[k] / max(epoch, 1):.1f} %)")
            lines.append(f"{entry.setting} {entry.path}: {kept}, {share}; buckets {_shapes(buckets[k])}")
        if self.eval_paths:
            held = len(val) - self.eval_size
            lines.append(f"data.eval {', '.join(self.eval_paths)}: {self.eval_size} samples, their loss logged as "
                         f"val/loss" + (f", and {held} training samples held out by data.val_fraction" if held else
                                        "; data.val_fraction=0: no training sample held out")
                         + f"; buckets {_shapes({s: n for b in buckets[len(self.entries):] for s, n in b.items()})}")
        return lines

    def source(self) -> dict:
        """What a checkpoint records to open the same folders again (infer.py's held-out prompts): ``data_source``."""
        listed = [{"path": str(Path(os.path.expanduser(e.path)).resolve()),
                   **({"weight": e.weight} if self.weighted else {"repeats": e.repeats})} for e in self.entries]
        return {"datasets": listed, "eval": [str(Path(os.path.expanduser(p)).resolve()) for p in self.eval_paths]}


def _shapes(counts: dict[tuple[int, ...], int]) -> str:
    return ", ".join(f"{'x'.join(map(str, shape))}: {n}" for shape, n in counts.items())


def data_source(source: dict) -> dict:
    """The data module arguments that open a checkpoint's recorded data (its ``source``) again."""
    listed = "datasets" in source
    return {"path": None if listed else source["path"], "datasets": source.get("datasets"),
            "eval": source.get("eval") or None, "val_fraction": source["val_fraction"], "seed": source["seed"]}
