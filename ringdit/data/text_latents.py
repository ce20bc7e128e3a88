"""Text-conditioned latents (``data=text_latents``): what text-to-video / text-to-image models train on.

``data.path`` is one ``.safetensors`` file or a folder of them (shards, read in name order), in the format
ringdit/data/text_latent_shards.py describes; shards of different latent ``([T,] H, W)`` are the set's buckets, and
every training step reads one bucket (see ringdit/data/steps.py). ``data.datasets`` mixes several folders with repeats
or weights, and ``data.eval`` names an evaluation set (ringdit/data/datasets.py). The synthetic set of tests and CPU
demos is ringdit/data/synthetic_text_latents.py.

A sample is ``(latents (C, [T,] H, W), {"text": (L, D), "text_mask": (L,)[, "pooled": (P,)][, "glyph_text": (G, D_g),
"glyph_text_mask": (G,)][, the image keys][, "loss_mask": (1, [T,] H, W)]})``: the model reads the keys of its
family; the training loss reads ``loss_mask``.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ringdit.data.base import ImageDataModule
from ringdit.data.datasets import DatasetList, parse_datasets, parse_eval, resolve_val_fraction
from ringdit.data.latents import checked_data_path
from ringdit.data.text_latent_shards import AUDIO_TEXT, LAYOUT, MASK_KEY, Shard, condition_of
from ringdit.data.text_latent_shards import read_prompts, write_text_latents  # noqa: F401 - importable from here too
from ringdit.common.errors import ConfigError, require_count
from ringdit.commands.launcher import spawned_by_launcher
from ringdit.models.conditioning import GLYPH_KEYS, IMAGE_KEYS, NULL_KEYS, TEXT  # noqa: F401 - importable from here too
from ringdit.models.conditioning import SAMPLE_KEYS

log = logging.getLogger(__name__)

Tensor = torch.Tensor


class TextLatentRows(Dataset):
    """Sample i of the concatenated shards, read on access (one slice per tensor)."""

    def __init__(self, shards: list[Shard]):
        self.shards = shards
        self.starts = list(np.cumsum([0] + [s.size for s in shards[:-1]]))
        self.total = sum(s.size for s in shards)

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        if not 0 <= index < self.total:
            raise IndexError(index)
        shard_index = bisect.bisect_right(self.starts, index) - 1
        shard, row = self.shards[shard_index], index - self.starts[shard_index]
        values = shard.read(("latents", "text", "text_mask", "pooled", *GLYPH_KEYS, AUDIO_TEXT, *SAMPLE_KEYS,
                             MASK_KEY), row, row + 1)
        return values["latents"][0].float(), condition_of(values, 0)


class TextLatentsDataModule(ImageDataModule):
    """``data=text_latents``: shards at ``path`` (see the module docstring)."""

    def __init__(self, path: str | None = None, batch_size: int = 8, num_workers: int = 0,
                 val_fraction: float | None = None, val_batches: int = 4, seed: int = 0, check_values: bool = True,
                 tokens_per_batch: int | None = None, size: list | int | None = None, frames: int | None = None,
                 datasets: list | None = None, eval: str | list | None = None,  # noqa: A002 - the setting's name
                 latent: bool = True):
        """``check_values``: read every value once now (train.py: in the launching process, before any rank
        starts; not again in the ranks Lightning spawns) and refuse NaN / Inf; False skips that scan (a reader that
        only wants a few prompts, such as infer.py's held-out prompts). ``size`` / ``frames``: the clips' size the
        run was planned for (a recipe's prepare size; ``python -m ringdit.plan experiment=...`` lays it out): a
        prepared bucket with more pixels is refused, since the layout and memory were chosen for this size.
        ``latent`` False: ``size`` / ``frames`` are the model's latent cells, not pixels (a model whose VAE no one factor
        describes, MiniMax-H3's: the planner lays it out in latent cells); the prepared buckets, in pixels, are then
        not compared with them.
        ``datasets`` / ``eval``: several folders with repeats or weights, an evaluation set (ringdit/data/datasets.py);
        ``val_fraction`` None: 0 with an evaluation set, else 0.05."""
        entries, eval_paths = parse_datasets(path, datasets), parse_eval(eval)
        super().__init__(batch_size, num_workers, resolve_val_fraction(val_fraction, eval_paths), val_batches, seed,
                         tokens_per_batch)
        self.path = _text_latents_path(entries[0].path)
        folders = [_open_folder(entry.path) for entry in entries] + [_open_folder(p) for p in eval_paths]
        _check_folders_mix([entry.setting for entry in entries] + ["data.eval"] * len(eval_paths),
                           [entry.path for entry in entries] + eval_paths, folders)
        self.shards = [shard for folder in folders for shard in folder]  # rows: the training folders', then eval's
        for folder_path, folder in zip([entry.path for entry in entries] + eval_paths, folders):
            if latent:  # pixels, as prepare records its buckets
                _check_planned_size(folder_path, folder, size, frames)
        if datasets is not None or eval_paths:  # one data.path without an evaluation set: as before dataset lists
            self.dataset_list = DatasetList(entries, [sum(s.size for s in f) for f in folders[:len(entries)]],
                                            sum(s.size for f in folders[len(entries):] for s in f), eval_paths)
            if not spawned_by_launcher():  # what an epoch holds, once, before any rank starts
                buckets = [{shard.bucket: 0 for shard in f} for f in folders]
                for f, counts in zip(folders, buckets):
                    for shard in f:
                        counts[shard.bucket] += shard.size
                for line in self.dataset_list.report(*self.dataset_list.split(seed, self.val_fraction), buckets):
                    log.info(line)
        if check_values and not spawned_by_launcher():
            for shard in self.shards:
                shard.check_values()
        (self.channels, _), (self.text_len, self.text_dim), pooled, self.glyph_shape = self.shards[0].layout()
        self.pooled_dim = pooled[0] if pooled else None
        self.num_classes, self.class_names = 0, []
        # every shard is one bucket: its latent shape; buckets in order of first appearance
        self.bucket_shapes = list(dict.fromkeys(shard.bucket for shard in self.shards))
        self.sample_buckets = np.concatenate([np.full(shard.size, self.bucket_shapes.index(shard.bucket))
                                              for shard in self.shards])
        self.image_size = tuple(self.describe_buckets()[0]["shape"])  # the most frequent: previews, the default

    def describe(self) -> dict:
        info = {"channels": self.channels, "image_size": list(self.image_size), "conditioning": TEXT,
                "buckets": self.describe_buckets(),
                "text_len": self.text_len, "text_dim": self.text_dim, "num_classes": 0, "class_names": [],
                "latent_scale": 1.0, "source": {"path": str(self.path.resolve()), "seed": self.seed,
                                                 "val_fraction": self.val_fraction}}
        if self.pooled_dim is not None:
            info["pooled_dim"] = self.pooled_dim
        if self.glyph_shape is not None:  # HunyuanVideo 1.5's glyph text (G, D_g)
            info["glyph_len"], info["glyph_dim"] = self.glyph_shape
        if self.shards[0].image_keys:  # image-to-video conditioning (every shard holds the same: _check_mixable)
            info["image_keys"] = list(self.shards[0].image_keys)
        if AUDIO_TEXT in self.shards[0].shapes:  # LTX-2's audio prompt states (N, L, D_a): their width
            info["audio_text_dim"] = self.shards[0].shapes[AUDIO_TEXT][2]
        # by prepare: how to decode and encode prompts, images; the audio VAE the sound was encoded with
        for key in ("vae", "text_encoder", "image_encoder", "audio_vae"):
            if key in self.shards[0].metadata:
                info[key] = json.loads(self.shards[0].metadata[key])
        if self.dataset_list is not None:  # infer.py's held-out prompts come from the same folders (data_source)
            info["source"].update(self.dataset_list.source())
        return info

    def build_dataset(self) -> TextLatentRows:
        return TextLatentRows(self.shards)

    def null_condition(self) -> dict[str, Tensor]:
        """The empty prompt's conditioning, (1, ...) each: from the first shard that stores it, else zeros."""
        for shard in self.shards:
            if "null_text" in shard.shapes:
                stored = shard.read(tuple(NULL_KEYS.values()), 0, 1)
                return condition_of({key: stored[NULL_KEYS[key]] for key in NULL_KEYS if NULL_KEYS[key] in stored}, 0)
        return {"text": torch.zeros(self.text_len, self.text_dim),
                "text_mask": torch.zeros(self.text_len, dtype=torch.bool)}

    def held_out(self, count: int) -> tuple[dict[str, Tensor], list[str]]:
        """The first ``count`` validation prompts (cycled): conditioning batch (count, ...) and captions."""
        self.setup()
        rows = list(self.val_set.indices) or list(self.train_set.indices)
        picked = [rows[i % len(rows)] for i in range(count)]
        conds = [self.val_set.dataset[i][1] for i in picked]
        captions = self.captions()
        return ({key: torch.stack([c[key] for c in conds]) for key in conds[0]},
                [captions[i] if captions else f"held-out prompt {i}" for i in picked])

    def captions(self) -> list[str] | None:
        """Every sample's caption, in order; None unless every shard stores them (each was checked on opening)."""
        if any(shard.captions is None for shard in self.shards):
            return None
        return [caption for shard in self.shards for caption in shard.captions]


def _check_mixable(path, shards: list[Shard]) -> None:
    """Shards of different latent ``([T,] H, W)`` are buckets of one set; any other difference cannot be mixed."""
    first = shards[0]
    for shard in shards[1:]:
        (channels, dims), text, pooled, glyph = shard.layout()
        (channels0, dims0), text0, pooled0, glyph0 = first.layout()
        audio0, audio = (s.shapes[AUDIO_TEXT][1:] if AUDIO_TEXT in s.shapes else None for s in (first, shard))
        what = ("latent channels", channels0, channels) if channels != channels0 else \
            ("latent dims (image vs video)", dims0, dims) if dims != dims0 else \
            ("text (L, D)", text0, text) if text != text0 else \
            ("pooled (P,)", pooled0, pooled) if pooled != pooled0 else \
            ("glyph text (G, D_g)", glyph0, glyph) if glyph != glyph0 else \
            ("image conditioning", list(first.image_keys), list(shard.image_keys)) \
            if shard.image_keys != first.image_keys else \
            ("a loss mask", MASK_KEY in first.shapes, MASK_KEY in shard.shapes) \
            if (MASK_KEY in shard.shapes) != (MASK_KEY in first.shapes) else \
            ("audio prompt states (L, D_a)", audio0, audio) if audio != audio0 else None
        if what is not None:
            fix = ("store images as 1-frame videos (N, C, 1, H, W) for a video model (prepare does)"
                   if what[0].startswith("latent dims") else
                   "prepare every folder with mask_path= (a clip without a mask trains everywhere), or none"
                   if what[0] == "a loss mask" else
                   "prepare every folder of clips with their sound (audio_vae=), or none: a set's clips train "
                   "with their audio or without it" if what[0] == "image conditioning" and
                   ("audio" in what[1]) != ("audio" in what[2]) else
                   "encode every shard with the same VAE and text encoder(s) and max_text_len")
            raise ConfigError(f"data.path={path}: {shard.path.name} has {what[0]} {what[2]} but {first.path.name} has "
                              f"{what[1]}; shards of different latent shapes are buckets of one set, but these cannot "
                              f"be mixed: {fix}")


def _check_planned_size(path, shards: list[Shard], size, frames) -> None:
    """No prepared bucket (prepare's ``bucket`` metadata: pixels) larger than ``data.size`` x ``data.frames``."""
    if size is None and frames is None:
        return
    given = size
    size = [size, size] if isinstance(size, int) and not isinstance(size, bool) else \
        list(size) if isinstance(size, Sequence) and not isinstance(size, str) else [] if size is None else None
    if size is None or size and (len(size) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0
                                                              for s in size)):
        raise ConfigError(f"data.size={given!r}: H, W in pixels (or one integer), e.g. data.size=[480,832], or null")
    require_count("data.frames", frames, optional=True, hint="the clips' frames as prepared, e.g. 81, or null")
    for shard in shards:
        if "bucket" not in shard.metadata:  # not written by prepare: its pixel size is not known
            continue
        bucket = json.loads(shard.metadata["bucket"])  # a JSON object: checked on opening
        clip = [bucket.get("height"), bucket.get("width"), bucket.get("frames") or 1]
        planned = [*(size or clip[:2]), frames or clip[2]]
        if all(isinstance(v, int) for v in clip) and math.prod(clip) > math.prod(planned):
            raise ConfigError(
                f"data.path={path}: {shard.path.name} holds {clip[0]}x{clip[1]} x {clip[2]} frame clips, more pixels "
                f"than data.size={planned[:2]} x data.frames={planned[2]} the run was planned for; prepare at that "
                f"size, or set data.size=[{clip[0]},{clip[1]}]" + (f" data.frames={clip[2]}" if frames else "")
                + " and plan again (python -m ringdit.plan experiment=... data.size=...)")


def _open_folder(path) -> list[Shard]:
    """One folder's (or file's) shards, checked and mixable with each other."""
    resolved = _text_latents_path(path)
    files = sorted(resolved.glob("*.safetensors")) if resolved.is_dir() else [resolved]
    if not files:
        raise ValueError(f"data.path={path} holds no .safetensors files; expected {LAYOUT}")
    shards = [Shard(f) for f in files]
    _check_mixable(path, shards)
    return shards


def _check_folders_mix(settings: list[str], paths: list[str], folders: list[list[Shard]]) -> None:
    """Every folder of a dataset list (and the evaluation set) against the first: one model trains on them all, so
    their latent channels and dims, text, pooled and glyph widths and per-sample keys must agree."""
    first = folders[0][0]
    optional = {key for folder in folders for key in folder[0].shapes} - {"latents", "text", "text_mask"}
    for setting, path, folder in zip(settings[1:], paths[1:], folders[1:]):
        shard = folder[0]
        ((channels0, dims0), *widths0), ((channels, dims), *widths) = first.layout(), shard.layout()
        keys0, keys = (sorted(k for k in optional if k in s.shapes) for s in (first, shard))
        what = ("latent channels", channels0, channels) if channels != channels0 else \
            ("latent dims (image vs video)", dims0, dims) if dims != dims0 else \
            ("text, pooled and glyph widths ((L, D), (P,), (G, D_g))", widths0, widths) if widths != widths0 else \
            ("the optional tensors", keys0, keys) if keys != keys0 else None
        if what is not None:
            fix = "store images as 1-frame videos (N, C, 1, H, W) for a video model (prepare does)" \
                if what[0].startswith("latent dims") else "prepare every folder with the same VAE, text encoder(s), " \
                "max_text_len and options (task, mask_path, image_encoder)"
            raise ConfigError(f"{setting}={path} has {what[0]} {what[2]} but {settings[0]}={paths[0]} has {what[1]}; "
                              f"the folders of one run must agree: {fix}")


def _text_latents_path(path) -> Path:
    return checked_data_path(path, LAYOUT, unset_hint=", or use data=synthetic_text_latents")
