"""Text-conditioned latents (``data=text_latents``): what text-to-video / text-to-image models train on.

On disk, ``data.path`` is one ``.safetensors`` file or a folder of them (shards, read in name order). Each shard
holds, for its N samples (one shape per shard: shards of different latent ``([T,] H, W)`` are the set's buckets,
and every training step reads one bucket; see ringdit/data/steps.py):

    latents     float  (N, C, T, H, W) video or (N, C, H, W) image latents, as the model consumes them (already
                       normalised with the VAE's scaling factor / mean / std; Flux.2's per channel of its 2x2
                       latent patches, then unpatchified: C = 32 at 1/8 of the pixels)
    text        float  (N, L, D)  the text encoder's last hidden states, zero-padded after each prompt to L tokens;
                       with prepare's prompt_template, the template's hidden layers joined per token (Flux.2: layers
                       10, 20, 30 of its Mistral3, D = 3 x 5120, every state kept and text_mask all True)
    text_mask   bool   (N, L)     True on real tokens (optional; default all True)
    pooled      float  (N, P)     a pooled text embedding, for models that take one (optional)
    glyph_text  float  (N, G, D_g)  HunyuanVideo 1.5's glyph text (optional; prepare's glyph_encoder): its ByT5's last
                       hidden states of the prompt's quoted text, G = 256 tokens, kept on the padding too; zero
                       where the prompt quotes nothing (HunyuanVideo15Pipeline's encoder_hidden_states_2)
    glyph_text_mask  bool  (N, G)  True on its real tokens; all False where the prompt quotes nothing (with
                       glyph_text, always both)
    null_text, null_text_mask, null_pooled, null_glyph_text, null_glyph_text_mask   (1, ...)   the EMPTY prompt's
                       embedding, used for the condition drop of classifier-free guidance and as the default negative
                       prompt (optional: zeros, all masked, if absent)

and, for image-to-video (optional, video latents only; ``python -m ringdit.prepare task=i2v`` writes them, by
ringdit/media/image_condition.py, which ``infer.py image=`` uses too; the condition drop keeps them):

    image_latents    float  (N, C, 1, H, W)  the clip's first frame encoded ALONE as a 1-frame video, normalised
                            like latents (Wan 2.2 TI2V's first latent frame: WanImageToVideoPipeline with
                            expand_timesteps; HunyuanVideo 1.5 I2V's condition latents)
    image_condition  float  (N, C, T, H, W)  the latents of [first frame ; zero frames] at the clip's frame count,
                            normalised like latents (Wan 2.1 I2V: the pipeline's latent_condition, without the mask)
    image_embeds     float  (N, N_img, D_img)  the first frame's image-encoder states (the pipeline's encode_image:
                            CLIP's penultimate hidden states for Wan 2.1 I2V, SigLIP's last hidden state for
                            HunyuanVideo 1.5 I2V; only when prepare is given image_encoder=)

and, for a masked loss (optional; ``python -m ringdit.prepare mask_path=`` writes it, by ringdit/media/masks.py):

    loss_mask   float  (N, 1, [T,] H, W)  each latent cell's weight in the loss, in [0, 1] (0: ignored), on the
                       latents' grid; every shard of a set has one, or none

and the metadata keys ``format`` (``ringdit.text_latents/1``) and, optionally, ``captions`` (a JSON list of N
strings) and ``vae`` (JSON: the VAE class, folder and per-channel ``shift`` / ``scale`` with latents =
(z - shift) * scale -- ``patch`` 2 (Flux.2): per channel of the 2x2-patchified z, C x 4 values --, written by
prepare so decoding can invert it; see ringdit/media/vae.py) and ``text_encoder`` (JSON: its folders, ``max_len``,
``masked``, and ``prompt_template`` / ``pooled_encoder`` / ``glyph_encoder`` where prepare was given them). Every
shard has the same C, L, D, P and (G, D_g), the same image keys and the same number of latent dims; T, H and W may
differ between shards (buckets). ``write_text_latents`` writes a shard; ``python -m ringdit.prepare`` makes them
from captioned media, and ``SyntheticTextLatentsDataModule`` makes a small procedural set for tests and CPU demos (no
download).

A sample is ``(latents (C, [T,] H, W), {"text": (L, D), "text_mask": (L,)[, "pooled": (P,)][, "glyph_text": (G, D_g),
"glyph_text_mask": (G,)][, the image keys][, "loss_mask": (1, [T,] H, W)]})``: the model reads the keys of its
family; the training loss reads ``loss_mask``.

(Over 300 lines: the format, its reader with every check of a user's shard, its writer and the synthetic data module
are one contract, kept in one file so that they cannot drift apart.)
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ringdit.atomic import atomic_write
from ringdit.data.base import ImageDataModule
from ringdit.data.datasets import DatasetList, parse_datasets, parse_eval, resolve_val_fraction
from ringdit.data.latents import checked_data_path, count_nonfinite
from ringdit.errors import ConfigError, require_count
from ringdit.launcher import spawned_by_launcher
from ringdit.models.conditioning import GLYPH_KEYS, IMAGE_KEYS, NULL_KEYS, TEXT
from ringdit.safe_json import parse_json

log = logging.getLogger(__name__)

FORMAT = "ringdit.text_latents/1"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
LAYOUT = ("a .safetensors file, or a folder of them, holding 'latents' (N, C, [T,] H, W) and 'text' (N, L, D) "
          "(see ringdit/data/text_latents.py)")
NULL_OF = {"null_text": "text (1, L, D)", "null_text_mask": "text_mask (1, L)", "null_pooled": "pooled (1, P)",
           "null_glyph_text": "glyph_text (1, G, D_g)", "null_glyph_text_mask": "glyph_text_mask (1, G)"}
IMAGE_OF = {"image_latents": "the first frame encoded alone as a 1-frame video (Wan 2.2 TI2V, HunyuanVideo 1.5 I2V)",
            "image_condition": "the latents of [first frame ; zero frames] (Wan 2.1 I2V)",
            "image_embeds": "the image encoder's states (Wan 2.1 I2V with image_dim: CLIP's penultimate; "
                            "HunyuanVideo 1.5 I2V: SigLIP's last)"}
MASK_KEY = "loss_mask"  # a masked loss's weights, optional, per sample (ringdit.media.masks writes them)

Tensor = torch.Tensor


def write_text_latents(path: str | Path, latents: Tensor, text: Tensor, text_mask: Tensor | None = None,
                       pooled: Tensor | None = None, null: dict[str, Tensor] | None = None,
                       captions: list[str] | None = None, metadata: dict[str, str] | None = None,
                       image: dict[str, Tensor] | None = None, glyph: dict[str, Tensor] | None = None,
                       loss_mask: Tensor | None = None) -> Path:
    """Write one shard (see the module docstring); ``null`` holds the empty prompt's ``text`` (L, D) [, mask, pooled,
    glyph_text (G, D_g), glyph_text_mask (G,)]; ``metadata`` adds string keys (prepare records ``vae``: the VAE's class
    and normalisation, as JSON); ``image`` the image-to-video conditioning, ``IMAGE_KEYS`` (N, ...) each; ``glyph``
    the glyph text, ``GLYPH_KEYS`` (N, ...) both; ``loss_mask`` the loss's weights (N, 1, [T,] H, W)."""
    from safetensors.torch import save_file

    tensors = {"latents": latents, "text": text}
    if text_mask is not None:
        tensors["text_mask"] = text_mask.bool()
    if pooled is not None:
        tensors["pooled"] = pooled
    unknown = sorted(set(image or {}) - set(IMAGE_KEYS))
    if unknown:  # a misspelt key would be written and never read
        raise ValueError(f"write_text_latents: image holds {unknown}; its keys are {', '.join(IMAGE_KEYS)}")
    tensors.update(image or {})
    if glyph and sorted(glyph) != sorted(GLYPH_KEYS):  # one without the other could not be read
        raise ValueError(f"write_text_latents: glyph holds {sorted(glyph)}; give both {', '.join(GLYPH_KEYS)}")
    tensors.update({key: value.bool() if key.endswith("mask") else value for key, value in (glyph or {}).items()})
    if loss_mask is not None:
        tensors[MASK_KEY] = loss_mask.float()
    for key, value in (null or {}).items():
        states = key in ("text", "glyph_text")  # (L, D) rows; the others (L,) or (P,)
        value = value.bool() if key.endswith("mask") else value
        tensors[NULL_KEYS[key]] = value.reshape(1, *value.shape[-(2 if states else 1):])
    metadata = {**(metadata or {}), "format": FORMAT}
    if captions is not None:
        metadata["captions"] = json.dumps(list(captions))
    with atomic_write(path) as tmp:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    return Path(path)


class Shard:
    """One file's header: shapes and dtypes, read without loading the tensors."""

    def __init__(self, path: Path):
        from safetensors import SafetensorError, safe_open

        self.path = path
        try:
            with safe_open(str(path), framework="pt") as f:
                self.shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
                self.dtypes = {key: f.get_slice(key).get_dtype() for key in f.keys()}
                self.metadata = f.metadata() or {}
        except (SafetensorError, OSError) as error:
            raise ValueError(f"data.path: {path} is not a readable .safetensors file ({error})") from None
        self.check()
        where = f"data.path: {path}"
        self.captions = parse_captions(where, self.metadata["captions"], self.size) \
            if "captions" in self.metadata else None
        for key in ("vae", "text_encoder", "image_encoder", "bucket"):  # what describe() hands on: decoding,
            if key in self.metadata:  # prompt encoding; prepare's bucket (its pixel size)
                parse_json_object(where, key, self.metadata[key])

    @property
    def size(self) -> int:
        return self.shapes["latents"][0]

    def check(self) -> None:
        where = f"data.path: {self.path}"
        for key in ("latents", "text"):
            if key not in self.shapes:
                raise ValueError(f"{where} has no tensor {key!r} (it holds {sorted(self.shapes)}); expected {LAYOUT}")
            if self.dtypes[key] not in FLOAT_DTYPES:
                raise ValueError(f"{where}: {key} is {self.dtypes[key]}; store floating-point values")
        latents, text = self.shapes["latents"], self.shapes["text"]
        if len(latents) not in (4, 5):
            raise ValueError(f"{where}: latents have shape {latents}; expected (N, C, H, W) or (N, C, T, H, W)")
        if len(text) != 3 or text[0] != latents[0]:
            raise ValueError(f"{where}: text has shape {text}; expected (N, L, D) with N = {latents[0]} as latents")
        if latents[0] == 0:
            raise ValueError(f"{where} holds no samples")
        for key, expected in (("text_mask", text[:2]), ("pooled", (latents[0], None))):
            shape = self.shapes.get(key)
            if shape is not None and (len(shape) != len(expected) or
                                      any(e is not None and s != e for s, e in zip(shape, expected))):
                raise ValueError(f"{where}: {key} has shape {shape}; expected {tuple(expected)} "
                                 f"(None = any)")
        pooled = self.shapes.get("pooled")
        for key, expected in (("null_text", (1, *text[1:])), ("null_text_mask", (1, text[1])),
                              ("null_pooled", (1, pooled[1]) if pooled else None)):
            shape = self.shapes.get(key)
            if shape is not None and shape != expected:
                wanted = f"{expected}, the empty prompt's {NULL_OF[key]}" if expected else \
                    "no null_pooled: the shard holds no pooled embeddings"
                raise ConfigError(f"{where}: {key} has shape {shape}; expected {wanted} (write the shard with "
                                  f"write_text_latents(..., null=...))")
        self.check_glyph()
        self.check_images()
        self.check_loss_mask()

    def check_loss_mask(self) -> None:
        """The loss mask, where present: float (N, 1, [T,] H, W), one weight per latent cell."""
        shape, latents = self.shapes.get(MASK_KEY), self.shapes["latents"]
        wanted = (latents[0], 1, *latents[2:])
        if shape is not None and (shape != wanted or self.dtypes[MASK_KEY] not in FLOAT_DTYPES):
            raise ConfigError(f"data.path: {self.path}: {MASK_KEY} is {self.dtypes[MASK_KEY]} {shape}; expected float "
                              f"{wanted}, one weight in [0, 1] per latent cell (prepare's mask_path= writes it)")

    def check_glyph(self) -> None:
        """The glyph text, where present: ``glyph_text`` float (N, G, D_g) and ``glyph_text_mask`` (N, G), both or
        neither, and the empty prompt's (1, ...) of the same G, D_g."""
        where, count = f"data.path: {self.path}", self.size
        for pair in (GLYPH_KEYS, tuple(NULL_KEYS[key] for key in GLYPH_KEYS)):
            present = [key for key in pair if key in self.shapes]
            if len(present) == 1:
                missing = next(key for key in pair if key not in self.shapes)
                raise ConfigError(f"{where} holds {present[0]} but no {missing}; write both (write_text_latents(..., "
                                  f"glyph=..., null=...), as prepare's glyph_encoder does)")
        glyph = self.shapes.get("glyph_text")
        expected = {"glyph_text": (count, None, None), "glyph_text_mask": (count, glyph[1] if glyph else None),
                    "null_glyph_text": (1, *glyph[1:]) if glyph else None,
                    "null_glyph_text_mask": (1, glyph[1]) if glyph else None}
        for key, wanted in expected.items():
            shape = self.shapes.get(key)
            if shape is None:
                continue
            if wanted is None:
                raise ConfigError(f"{where} holds {key} but no glyph_text: the empty prompt's glyph text without the "
                                  f"samples'; write both (write_text_latents(..., glyph=..., null=...))")
            fits = len(shape) == len(wanted) and all(w is None or s == w for s, w in zip(shape, wanted))
            states = key.endswith("glyph_text")
            if not fits or (states and self.dtypes[key] not in FLOAT_DTYPES):
                raise ConfigError(f"{where}: {key} is {self.dtypes[key]} {shape}; expected {'float ' if states else ''}"
                                  f"{wanted} (None = any), {NULL_OF.get(key, 'the glyph text of each sample')}")

    @property
    def image_keys(self) -> tuple[str, ...]:
        """The image-to-video conditioning this shard holds (``IMAGE_KEYS``), in that order."""
        return tuple(key for key in IMAGE_KEYS if key in self.shapes)

    def check_images(self) -> None:
        """The first-frame conditioning, where present, fits the latents (N, C, T, H, W): ``image_latents``
        (N, C, 1, H, W), ``image_condition`` (N, C, T, H, W), ``image_embeds`` (N, N_img, D_img)."""
        latents = self.shapes["latents"]
        expected = {"image_latents": (*latents[:2], 1, *latents[3:]), "image_condition": latents,
                    "image_embeds": (latents[0], None, None)}
        for key in self.image_keys:
            shape, wanted = self.shapes[key], expected[key]
            fits = len(latents) == 5 and len(shape) == len(wanted) and self.dtypes[key] in FLOAT_DTYPES and \
                all(w is None or s == w for s, w in zip(shape, wanted))
            if not fits:
                raise ConfigError(f"data.path: {self.path}: {key} is {self.dtypes[key]} {shape}; expected float "
                                  f"{wanted} (None = any) for video latents {latents}: {IMAGE_OF[key]}")

    def check_values(self) -> None:
        """Every floating-point tensor (latents, text, pooled, null_*, a float text_mask, any other) holds only
        finite values: read ``CHUNK_BYTES`` at a time (ringdit.data.latents), so a shard larger than RAM is checked
        too. A NaN here would surface as a NaN loss many steps later, looking like a learning-rate problem."""
        from safetensors import safe_open

        found, bad = [], []
        with safe_open(str(self.path), framework="pt") as f:
            for key in sorted(self.shapes, key=lambda k: (k not in ("latents", "text"), k)):
                dtype, shape = self.dtypes[key], self.shapes[key]
                if not (dtype in FLOAT_DTYPES or dtype.startswith("F8")):
                    continue
                rows = f.get_slice(key) if shape else f.get_tensor(key).reshape(1)  # a 0-d tensor: one row
                values, bad_rows, first = count_nonfinite(rows, shape[0] if shape else 1, tuple(shape[1:]))
                if values:
                    found.append(key)
                    several = shape and shape[0] > 1  # not the empty prompt's (1, ...) tensors: one row
                    where = f" in {bad_rows} of its {shape[0]} rows (the first: row {first})" if several else ""
                    bad.append(f"{key} {shape} holds {values} NaN or Inf values{where}")
        if MASK_KEY in self.shapes and not found:  # weights outside [0, 1] (a 0-255 mask) would rescale the loss
            with safe_open(str(self.path), framework="pt") as f:
                weights = f.get_tensor(MASK_KEY)
            if weights.numel() and (weights.min() < 0 or weights.max() > 1):
                raise ConfigError(f"data.path: {self.path}: {MASK_KEY} holds weights from {weights.min().item()} to "
                                  f"{weights.max().item()}; a loss mask's are in [0, 1] (0: ignored, 1: trained): "
                                  f"divide 0-255 masks by 255, or prepare them with mask_path=")
        if found:
            empty = [key for key in found if key.startswith("null_")]
            fixes = (["re-encode those samples or drop them"] if len(empty) < len(found) else []) \
                + (["encode the empty prompt again (null_*)"] if empty else [])
            raise ConfigError(f"data.path: {self.path}: {'; '.join(bad)}; {', and '.join(fixes)} (an encoder may "
                              f"have overflowed, e.g. in float16)")

    def layout(self) -> tuple:
        """What must agree across shards: latent channels and dims, text (L, D), pooled (P,) and glyph text (G, D_g)
        shapes. The latent ``([T,] H, W)`` may differ: each shape is a bucket."""
        latents, text = self.shapes["latents"], self.shapes["text"]
        pooled, glyph = self.shapes.get("pooled"), self.shapes.get("glyph_text")
        return (latents[1], len(latents) - 2), text[1:], pooled[1:] if pooled else None, \
            glyph[1:] if glyph else None  # (C, [T,] H, W dims), (L, D), (P,), (G, D_g)

    @property
    def bucket(self) -> tuple[int, ...]:
        """The latent ``([T,] H, W)`` of every sample in this shard."""
        return tuple(self.shapes["latents"][2:])

    def read(self, keys: tuple[str, ...], start: int, stop: int) -> dict[str, Tensor]:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            return {key: f.get_slice(key)[start:stop] for key in keys if key in self.shapes}


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
        values = shard.read(("latents", "text", "text_mask", "pooled", *GLYPH_KEYS, *IMAGE_KEYS, MASK_KEY), row,
                            row + 1)
        return values["latents"][0].float(), condition_of(values, 0)


def condition_of(values: dict[str, Tensor], row: int) -> dict[str, Tensor]:
    """The conditioning dict of one row: text (L, D) float32, text_mask (L,) bool [, pooled (P,)] [, glyph_text
    (G, D_g) float32, glyph_text_mask (G,) bool] [, the image keys (IMAGE_KEYS) float32]."""
    text = values["text"][row].float()
    mask = values["text_mask"][row].bool() if "text_mask" in values else torch.ones(text.shape[0], dtype=torch.bool)
    cond = {"text": text, "text_mask": mask}
    if "pooled" in values:
        cond["pooled"] = values["pooled"][row].float()
    if "glyph_text" in values:
        cond["glyph_text"] = values["glyph_text"][row].float()
        cond["glyph_text_mask"] = values["glyph_text_mask"][row].bool()
    for key in (*IMAGE_KEYS, MASK_KEY):
        if key in values:
            cond[key] = values[key][row].float()
    return cond


class TextLatentsDataModule(ImageDataModule):
    """``data=text_latents``: shards at ``path`` (see the module docstring)."""

    def __init__(self, path: str | None = None, batch_size: int = 8, num_workers: int = 0,
                 val_fraction: float | None = None, val_batches: int = 4, seed: int = 0, check_values: bool = True,
                 tokens_per_batch: int | None = None, size: list | int | None = None, frames: int | None = None,
                 datasets: list | None = None, eval: str | list | None = None):  # noqa: A002 - the setting's name
        """``check_values``: read every value once now (train.py: in the launching process, before any rank
        starts; not again in the ranks Lightning spawns) and refuse NaN / Inf; False skips that scan (a reader that
        only wants a few prompts, such as infer.py's held-out prompts). ``size`` / ``frames``: the clips' size the
        run was planned for (a recipe's prepare size; ``python -m ringdit.plan experiment=...`` lays it out): a
        prepared bucket with more pixels is refused, since the layout and memory were chosen for this size.
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
        for key in ("vae", "text_encoder", "image_encoder"):  # by prepare: how to decode and encode prompts, images
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
        what = ("latent channels", channels0, channels) if channels != channels0 else \
            ("latent dims (image vs video)", dims0, dims) if dims != dims0 else \
            ("text (L, D)", text0, text) if text != text0 else \
            ("pooled (P,)", pooled0, pooled) if pooled != pooled0 else \
            ("glyph text (G, D_g)", glyph0, glyph) if glyph != glyph0 else \
            ("image conditioning", list(first.image_keys), list(shard.image_keys)) \
            if shard.image_keys != first.image_keys else \
            ("a loss mask", MASK_KEY in first.shapes, MASK_KEY in shard.shapes) \
            if (MASK_KEY in shard.shapes) != (MASK_KEY in first.shapes) else None
        if what is not None:
            fix = ("store images as 1-frame videos (N, C, 1, H, W) for a video model (prepare does)"
                   if what[0].startswith("latent dims") else
                   "prepare every folder with mask_path= (a clip without a mask trains everywhere), or none"
                   if what[0] == "a loss mask" else
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


def parse_captions(where: str, text: str, count: int) -> list[str]:
    """The ``captions`` metadata: a JSON list of ``count`` strings, one per sample, else a ``ConfigError``."""
    fix = f"store json.dumps(captions), a list of {count} strings, one per sample (or leave the key out)"
    captions = _json_metadata(where, "captions", text, list, fix)
    odd = next((i for i, c in enumerate(captions) if not isinstance(c, str)), None)
    if odd is not None:
        raise ConfigError(f"{where}: captions[{odd}] is {captions[odd]!r} ({type(captions[odd]).__name__}), not a "
                          f"string; {fix}")
    if len(captions) != count:
        raise ConfigError(f"{where}: the captions metadata lists {len(captions)} captions for {count} samples; {fix}")
    return captions


def parse_json_object(where: str, key: str, text: str) -> dict:
    return _json_metadata(where, key, text, dict, "it is written by python -m ringdit.prepare: prepare the shard "
                                                  "again, or leave the key out")


def _json_metadata(where: str, key: str, text: str, kind: type, fix: str):
    """Metadata entry ``key``: JSON of type ``kind`` (list or dict), else a ``ConfigError`` that ends with ``fix``."""
    value = parse_json(text, f"{where}: the {key} metadata", fix=fix, excerpt=True)
    if not isinstance(value, kind):
        raise ConfigError(f"{where}: the {key} metadata is a JSON {type(value).__name__}, not "
                          f"{'a list' if kind is list else 'an object'}; {fix}")
    return value


def read_prompts(path: str, setting: str = "text_embeds") -> tuple[dict[str, Tensor], list[str] | None]:
    """Prompt embeddings from a file in this format (``latents`` not needed): ``text`` (N, L, D) [+ ``text_mask``,
    ``pooled``, ``glyph_text`` and ``glyph_text_mask``] and the ``captions`` metadata if present. Returns the
    conditioning batch and the captions."""
    from safetensors import SafetensorError, safe_open

    file = Path(os.path.expanduser(str(path)))
    if not file.is_file() or file.suffix != ".safetensors":
        raise ValueError(f"{setting}={path} is not a .safetensors file; give one holding text (N, L, D) embeddings "
                         f"(and optionally text_mask (N, L), pooled (N, P)): a text_latents shard works")
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            if "text" not in keys:
                raise ValueError(f"{setting}={path} has no tensor 'text' (it holds {sorted(keys)})")
            values = {key: f.get_tensor(key) for key in ("text", "text_mask", "pooled", *GLYPH_KEYS) if key in keys}
            metadata = f.metadata() or {}
    except SafetensorError as error:
        raise ValueError(f"{setting}={path} is not a readable .safetensors file ({error})") from None
    if values["text"].dim() != 3 or not values["text"].is_floating_point():
        raise ValueError(f"{setting}={path}: text has shape {tuple(values['text'].shape)} "
                         f"({values['text'].dtype}); expected float (N, L, D)")
    for key, value in values.items():
        if value.is_floating_point() and not (finite := torch.isfinite(value)).all():
            where = f" in {int((~finite).flatten(1).any(dim=1).sum())} of its {len(value)} rows" if value.dim() > 1 \
                else ""
            raise ConfigError(f"{setting}={path}: {key} {tuple(value.shape)} holds {int((~finite).sum())} NaN or Inf "
                              f"values{where}; encode those prompts again")
    count = values["text"].shape[0]
    conds = [condition_of(values, row) for row in range(count)]
    captions = parse_captions(f"{setting}={path}", metadata["captions"], count) if "captions" in metadata else None
    return {key: torch.stack([c[key] for c in conds]) for key in conds[0]}, captions


def _text_latents_path(path) -> Path:
    return checked_data_path(path, LAYOUT, unset_hint=", or use data=synthetic_text_latents")


# ---- a procedural set: tests and CPU demos without downloads --------------------------------------------------------


def synthetic_text_latents(num_samples: int, *, channels: int = 4, frames: int = 3, size: int | tuple[int, int] = 8,
                           text_len: int = 8, text_dim: int = 16, num_prompts: int = 8, pooled_dim: int = 0,
                           seed: int = 0, first_sample: int = 0, image: bool = False, image_dim: int = 0) -> dict:
    """``num_samples`` latent videos (``frames=0``: images) of ``size`` (H = W, or (H, W)) of a soft blob whose start
    and direction depend on the prompt; ``pooled_dim`` > 0 adds a pooled prompt embedding (Flux); ``image`` adds the
    first-frame conditioning of image-to-video (``image_latents``: the first latent frame, ``image_condition``: it
    followed by zero frames) and ``image_dim`` > 0 a random stand-in for CLIP image embeddings (N, 4, image_dim).

    Prompt p has a fixed random text embedding (its first ``3 + p % (text_len - 2)`` tokens real, the rest zero, as
    padded encoder states are) and caption ``"blob p"``; each video is drawn from (seed, sample index), the samples
    numbered from ``first_sample`` (a bucket's samples follow the buckets before it). Returns the
    ``write_text_latents`` arguments.
    """
    height, width = (size, size) if isinstance(size, int) else size
    g = torch.Generator().manual_seed(seed)
    prompt_text = torch.randn(num_prompts, text_len, text_dim, generator=g)
    lengths = torch.tensor([3 + p % max(1, text_len - 2) for p in range(num_prompts)]).clamp(max=text_len)
    prompt_mask = torch.arange(text_len)[None, :] < lengths[:, None]  # (num_prompts, L)
    prompt_text = prompt_text * prompt_mask[..., None]
    angles = torch.arange(num_prompts) * (2 * math.pi / num_prompts)
    colours = torch.randn(num_prompts, channels, generator=g)
    prompt_pooled = torch.randn(num_prompts, pooled_dim, generator=g)
    # the samples' prompts and jitter: after the prompts' draws (one bucket), or from the bucket's own stream
    draws = torch.Generator().manual_seed(seed * 1_000_003 + first_sample) if first_sample else g
    prompts = torch.randint(num_prompts, (num_samples,), generator=draws)
    jitter = torch.rand(num_samples, 2, generator=draws) - 0.5
    rows, cols = torch.arange(height, dtype=torch.float32), torch.arange(width, dtype=torch.float32)
    videos = []
    for i, p in enumerate(prompts.tolist()):
        direction = torch.stack([torch.cos(angles[p]), torch.sin(angles[p])])
        frames_ = []
        for f in range(max(frames, 1)):
            # videos: the blob travels along the prompt's direction; images: it sits off-centre in that direction
            step = (f - (frames - 1) / 2) * min(height, width) / (2 * frames) if frames else min(height, width) / 4
            centre = torch.tensor([(height - 1) / 2, (width - 1) / 2]) + step * direction + jitter[i]
            blob = torch.exp(-((rows[:, None] - centre[0]) ** 2 + (cols[None, :] - centre[1]) ** 2) / 4.0)  # (H, W)
            frames_.append(colours[p][:, None, None] * blob)  # (C, H, W)
        videos.append(torch.stack(frames_, dim=1) if frames else frames_[0])  # (C, T, H, W) or (C, H, W)
    null = {"text": torch.zeros(text_len, text_dim), "text_mask": torch.zeros(text_len, dtype=torch.bool)}
    result = {"latents": torch.stack(videos), "text": prompt_text[prompts], "text_mask": prompt_mask[prompts],
              "null": null, "captions": [f"blob {p}" for p in prompts.tolist()]}
    if pooled_dim:
        result["pooled"], null["pooled"] = prompt_pooled[prompts], torch.zeros(pooled_dim)
    if image or image_dim:
        result["image"] = synthetic_image_condition(result["latents"], image, image_dim, draws)
    return result


def synthetic_image_condition(latents: Tensor, image: bool, image_dim: int, generator: torch.Generator
                              ) -> dict[str, Tensor]:
    """Stand-ins for prepare task=i2v's keys of videos ``latents`` (N, C, T, H, W): the first latent frame as the
    image's latents (a causal VAE encodes the first frame alone into it), [it ; zeros] as the I2V condition, and
    ``image_dim`` > 0 random embeddings (N, 4, image_dim) (only their shape and flow are tested)."""
    if latents.dim() != 5:
        raise ConfigError("data.image=true needs videos: set data.frames >= 1 (image-to-video conditions on the "
                          "first frame)")
    first = latents[:, :, :1]  # (N, C, 1, H, W)
    out = {"image_latents": first, "image_condition": torch.cat([first, torch.zeros_like(latents[:, :, 1:])], 2)} \
        if image else {}
    if image_dim:
        out["image_embeds"] = torch.randn(latents.shape[0], 4, image_dim, generator=generator)
    return out


class SyntheticTextLatentsDataModule(TextLatentsDataModule):
    """``data=synthetic_text_latents``: ``synthetic_text_latents`` written once to ``cache_dir`` and read like any
    text_latents folder (so the same code path is exercised); regenerated when the settings change.

    ``buckets``: a list of latent shapes ``[T, H, W]`` (videos) or ``[H, W]`` (images; ``frames`` is then unused):
    a mixed-bucket set, one shard per bucket, ``num_samples`` split between them as ``bucket_samples`` says (default
    evenly). None: one bucket of ``frames`` x ``size`` x ``size``. ``image`` / ``image_dim``: the image-to-video keys
    (``synthetic_image_condition``)."""

    def __init__(self, cache_dir: str, num_samples: int = 512, channels: int = 4, frames: int = 3, size: int = 8,
                 text_len: int = 8, text_dim: int = 16, num_prompts: int = 8, pooled_dim: int = 0,
                 batch_size: int = 8, num_workers: int = 0, val_fraction: float = 0.05, val_batches: int = 4,
                 seed: int = 0, buckets: list | None = None, bucket_samples: list[int] | None = None,
                 tokens_per_batch: int | None = None, image: bool = False, image_dim: int = 0):
        settings = dict(num_samples=num_samples, channels=channels, frames=frames, size=size, text_len=text_len,
                        text_dim=text_dim, num_prompts=num_prompts, pooled_dim=pooled_dim, seed=seed)
        for key, value in settings.items():
            require_count(f"data.{key}", value, minimum=0 if key in ("seed", "frames", "pooled_dim") else 1)
        require_count("data.image_dim", image_dim, minimum=0)
        # image-to-video keys (named in the file only when asked for: the text-to-video sets keep their names)
        settings.update({"image": True} if image else {}, **({"image_dim": image_dim} if image_dim else {}))
        common = {key: value for key, value in settings.items() if key not in ("num_samples", "frames", "size")}
        if buckets is None:  # one file, as before buckets existed
            path = Path(cache_dir).expanduser() / ("synthetic-" + "-".join(f"{k}{v}" for k, v in settings.items())
                                                   + ".safetensors")
            if not path.is_file():
                write_text_latents(path, **synthetic_text_latents(**settings))
        else:  # a folder of one shard per bucket
            shapes = _synthetic_buckets(buckets)
            counts = _bucket_counts(bucket_samples, num_samples, len(shapes))
            path = Path(cache_dir).expanduser() / ("synthetic-" + "-".join(f"{k}{v}" for k, v in common.items())
                                                   + "-buckets-" + "-".join(f"{n}x{'x'.join(map(str, shape))}"
                                                                            for n, shape in zip(counts, shapes)))
            first = 0
            for index, (count, shape) in enumerate(zip(counts, shapes)):
                shard = path / f"shard-{index:05d}.safetensors"
                if not shard.is_file():
                    write_text_latents(shard, **synthetic_text_latents(
                        count, frames=shape[0] if len(shape) == 3 else 0, size=tuple(shape[-2:]), first_sample=first,
                        **common))
                first += count
        super().__init__(str(path), batch_size, num_workers, val_fraction, val_batches, seed,
                         tokens_per_batch=tokens_per_batch)


def _synthetic_buckets(buckets) -> list[tuple[int, ...]]:
    from omegaconf import OmegaConf

    buckets = OmegaConf.to_container(buckets) if OmegaConf.is_config(buckets) else buckets
    shapes = [tuple(b) for b in (list(buckets) if not isinstance(buckets, (str, int)) else [None])
              if isinstance(b, (list, tuple)) and len(b) in (2, 3) and all(isinstance(n, int) and n > 0 for n in b)]
    if not buckets or isinstance(buckets, (str, int)) or len(shapes) != len(buckets) or len({len(s) for s in shapes}) > 1:
        raise ConfigError(f"data.buckets={buckets!r}: give a list of latent shapes, all [T, H, W] (videos) or all "
                          f"[H, W] (images), e.g. data.buckets='[[3,6,10],[5,10,6]]'")
    return shapes


def _bucket_counts(bucket_samples, num_samples: int, buckets: int) -> list[int]:
    from omegaconf import OmegaConf

    bucket_samples = OmegaConf.to_container(bucket_samples) if OmegaConf.is_config(bucket_samples) else bucket_samples
    if bucket_samples is None:
        return [num_samples // buckets + (b < num_samples % buckets) for b in range(buckets)]
    counts = list(bucket_samples)
    if len(counts) != buckets or not all(isinstance(n, int) and n > 0 for n in counts):
        raise ConfigError(f"data.bucket_samples={bucket_samples!r}: give {buckets} positive sample counts, one per "
                          f"bucket of data.buckets (or leave it unset to split data.num_samples evenly)")
    return counts
