"""Re-captioning a prepared folder: the text of a finished shard re-encoded, its latents kept.

A shard holds its samples' latents and their text encodings side by side (ringdit/data/text_latents.py), and records
which file (and window) each sample came from (``files``), their captions and the text encoder's description
(``text_encoder``). When ``python -m ringdit.prepare`` runs again over a folder whose shards exist:
    same captions, same text encoder   the shard is skipped (resume), as always;
    other captions, or another text    only the text is encoded again -- ``text``, ``text_mask``, ``pooled``, the
    encoder (its folders, length,      glyph text, the empty prompt's ``null_*``, the captions and the ``text_encoder``
    template, pooled / glyph encoder)  record -- and the shard rewritten atomically with every other tensor (latents,
                                       image-to-video conditioning, loss masks) and record carried over byte for byte:
                                       no video is decoded and the VAE is not run.
The captions come from the folder as it is now (sidecar .txt files, metadata.jsonl / .csv); a shard that holds a file
the plan no longer puts there (files added, removed or renamed) cannot be re-captioned in place: one line, prepare
into a new out= folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ringdit.data.text_latents import GLYPH_KEYS, NULL_KEYS
from ringdit.errors import ConfigError
from ringdit.media.folder import MediaItem

TEXT_KEYS = ("text", "text_mask", "pooled", *GLYPH_KEYS)  # per sample; + their null_* (NULL_KEYS)


def sample_name(item: MediaItem, root: Path) -> str:
    """A sample's name in a shard's ``files`` record and in buckets.json: its file relative to the input folder,
    ``@start`` for a window that does not start at the clip's first frame."""
    try:
        name = item.path.relative_to(root).as_posix()
    except ValueError:
        name = str(item.path)
    return name + (f"@{item.start}" if item.start else "")


def stale_captions(path: Path, planned: list[MediaItem], root: Path, described: str,
                   frames: dict | None = None) -> list[str] | None:
    """The captions the samples of the finished shard ``path`` have now, when they or the text encoder (its
    ``describe()`` JSON, ``described``) differ from what the shard was encoded with; None when its text is current.
    ``frames``: how clips are read now (the timeline and extraction, ringdit/media/windows.py), which a shard of
    clips must have been read with too -- else its latents are other frames: one line."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    bucket = json.loads(metadata.get("bucket", "{}"))
    if frames is not None and bucket.get("frame_stride") is not None:  # a shard of clips
        defaults = {"source_fps": None, "fps": None, "frame_extraction": "head"}  # shards record them when set
        then = {key: bucket.get(key, defaults.get(key)) for key in frames}
        changed = [key for key in frames if then[key] != frames[key]]
        if changed:
            raise ConfigError(f"{path} was prepared with {', '.join(f'{k}={then[k]}' for k in changed)}, but now "
                              f"{', '.join(f'{k}={frames[k]}' for k in changed)}: its latents are other frames; "
                              f"resume with the settings it was prepared with, or prepare into a new out= folder")
    before = json.loads(metadata.get("captions", "null"))
    names = json.loads(metadata.get("files", "null"))
    captions = {sample_name(item, root): item.caption for item in planned}
    if names is None:  # a shard from before the files were recorded: its samples are the planned files if all are
        if before is not None and len(before) == len(planned):
            names = list(captions)
        else:
            raise ConfigError(f"{path} does not record which files its {len(before or [])} samples are (prepared by "
                              f"an older ringdit, with files skipped), so its captions cannot be matched to the "
                              f"folder's; prepare into a new out= folder")
    unknown = [name for name in names if name not in captions]
    if unknown:
        raise ConfigError(f"{path} holds {unknown[0]}, which the input folder no longer puts in this shard (files "
                          f"were added, removed or renamed); prepare into a new out= folder")
    now = [captions[name] for name in names]
    same_encoder = json.loads(metadata.get("text_encoder", "null")) == json.loads(described)
    return None if now == before and same_encoder else now


def rewrite_text(path: Path, captions: list[str], encode: Callable[[list[str]], dict], null: dict,
                 described: str, store: torch.dtype, batch_size: int) -> None:
    """Encode ``captions`` with ``encode`` (a ``TextEncoder``) and rewrite the shard with them: its text keys and the
    empty prompt's replaced, every other tensor and record kept as it was."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ringdit.atomic import atomic_write

    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata() or {})
        text_keys = set(TEXT_KEYS) | set(NULL_KEYS.values())
        kept = {key: f.get_tensor(key) for key in f.keys() if key not in text_keys}  # noqa: SIM118
    rows: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(captions), batch_size):
        for key, value in encode(captions[start:start + batch_size]).items():
            rows.setdefault(key, []).append(value)
    text = {key: torch.cat(values) for key, values in rows.items()}
    text.update({NULL_KEYS[key]: value.reshape(1, *value.shape) for key, value in null.items()})
    text = {key: value.bool() if key.endswith("mask") else value.to(store) for key, value in text.items()}
    metadata.update(captions=json.dumps(list(captions)), text_encoder=described)
    with atomic_write(path) as tmp:
        save_file({**kept, **{k: v.contiguous() for k, v in text.items()}}, str(tmp), metadata=metadata)
