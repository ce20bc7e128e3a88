"""The text cache of a prepared folder: each shard's text encodings kept apart from its latents.

``python -m ringdit.prepare`` writes a shard's latents (with its image-to-video conditioning and loss masks) to
``shard-i.safetensors`` and its text encodings -- ``text``, ``text_mask``, ``pooled``, the glyph text and the empty
prompt's ``null_*`` -- to ``text/shard-i.safetensors`` beside it, which records the samples' files, their captions and
the text encoder's description (``text_encoder``: its folders, length, template, pooled / glyph encoders; the format:
ringdit/data/text_latent_shards.py). When prepare runs again over a folder whose shards exist:
    same captions, same text encoder   the shard is skipped (resume), as always;
    other captions, or another text    only its text file is written again, from the captions as they are now: the
    encoder                            latent shard is not opened for writing (its bytes stay), no video is decoded
                                       and the VAE is not run.
A folder prepared with the text inside each shard is re-captioned the same way: the text file is written beside the
shard, which is left as it was (the reader takes every text key from the text file).
The captions come from the folder as it is now (sidecar .txt files, metadata.jsonl / .csv); a shard that holds a file
the plan no longer puts there (files added, removed or renamed) cannot be re-captioned in place: one line, prepare
into a new out= folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ringdit.data.text_latent_shards import NULL_KEYS, TEXT_KEYS, save_tensors, text_file
from ringdit.common.errors import ConfigError
from ringdit.media.folder import MediaItem


def sample_name(item: MediaItem, root: Path) -> str:
    """A sample's name in a shard's ``files`` record and in buckets.json: its file relative to the input folder,
    ``@start`` for a window that does not start at the clip's first frame."""
    try:
        name = item.path.relative_to(root).as_posix()
    except ValueError:
        name = str(item.path)
    return name + (f"@{item.start}" if item.start else "")


def _metadata(path: Path) -> tuple[dict, set[str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {}), set(f.keys())  # noqa: SIM118


def stale_captions(path: Path, planned: list[MediaItem], root: Path, described: str,
                   frames: dict | None = None) -> list[str] | None:
    """The captions the samples of the finished shard ``path`` have now, when they or the text encoder (its
    ``describe()`` JSON, ``described``) differ from what its text was encoded with, or its text is missing or of other
    samples; None when its text is current. ``frames``: how clips are read now (the timeline and extraction,
    ringdit/media/windows.py), which a shard of clips must have been read with too -- else its latents are other
    frames: one line."""
    metadata, keys = _metadata(path)
    bucket = json.loads(metadata.get("bucket", "{}"))
    if frames is not None and bucket.get("frame_stride") is not None:  # a shard of clips
        defaults = {"source_fps": None, "fps": None, "frame_extraction": "head"}  # shards record them when set
        then = {key: bucket.get(key, defaults.get(key)) for key in frames}
        changed = [key for key in frames if then[key] != frames[key]]
        if changed:
            raise ConfigError(f"{path} was prepared with {', '.join(f'{k}={then[k]}' for k in changed)}, but now "
                              f"{', '.join(f'{k}={frames[k]}' for k in changed)}: its latents are other frames; "
                              f"resume with the settings it was prepared with, or prepare into a new out= folder")
    names = json.loads(metadata.get("files", "null"))
    if text_file(path).is_file():
        encoded = _metadata(text_file(path))[0]
    elif "text" in keys:  # the text inside the shard
        encoded = metadata
    else:  # stopped between the shard and its text file
        encoded = {}
    before = json.loads(encoded.get("captions", "null"))
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
    same_encoder = json.loads(encoded.get("text_encoder", "null")) == json.loads(described)
    same_files = encoded.get("files", metadata.get("files")) == metadata.get("files")  # a text file of other samples
    return None if now == before and same_encoder and same_files else now


def write_text(path: Path, text: dict[str, torch.Tensor], null: dict[str, torch.Tensor], captions: list[str],
               names: list[str] | None, described: str, store: torch.dtype) -> Path:
    """The text file of the shard ``path``: ``text`` (N, ...) per sample, ``null`` the empty prompt's (unbatched),
    stored in ``store`` (masks as bool), with the samples' ``captions``, ``names`` (their files) and the text
    encoder's description."""
    tensors = {**text, **{NULL_KEYS[key]: value.reshape(1, *value.shape) for key, value in null.items()}}
    unknown = sorted(set(tensors) - set(TEXT_KEYS))
    if unknown:  # a key the reader would never take from a text file
        raise ValueError(f"write_text: {unknown} are not text keys ({', '.join(TEXT_KEYS)})")
    tensors = {key: value.bool() if key.endswith("mask") else value.to(store) for key, value in tensors.items()}
    metadata = {"captions": json.dumps(list(captions)), "text_encoder": described}
    if names is not None:
        metadata["files"] = json.dumps(list(names))
    return save_tensors(text_file(path), tensors, metadata)


def rewrite_text(path: Path, captions: list[str], encode: Callable[[list[str]], dict], null: dict,
                 described: str, store: torch.dtype, batch_size: int) -> None:
    """Encode ``captions`` with ``encode`` (a ``TextEncoder``) and write them as the text file of the shard ``path``;
    the shard itself is not written."""
    metadata = _metadata(path)[0]
    rows: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(captions), batch_size):
        for key, value in encode(captions[start:start + batch_size]).items():
            rows.setdefault(key, []).append(value)
    names = json.loads(metadata["files"]) if "files" in metadata else None
    write_text(path, {key: torch.cat(values) for key, values in rows.items()}, null, captions, names, described, store)
