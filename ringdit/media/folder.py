"""A folder of captioned images or videos: which files, and each one's caption.

Captions come from, in this order:
    metadata.jsonl / metadata.csv   the Hugging Face imagefolder convention: a ``file_name`` column (relative to the
                                    folder) and a caption column (``text`` by default, ``caption_column=`` to choose)
    sidecar .txt files              ``a.jpg`` + ``a.txt``
Media files are found recursively and taken in sorted path order, so the same folder always gives the same list
(prepare's shard i is always the same files, which is what makes resuming safe).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from ringdit.errors import ConfigError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_SUFFIXES = (".mp4", ".mov", ".webm", ".mkv", ".avi", ".gif")


@dataclass(frozen=True)
class MediaItem:
    path: Path
    caption: str

    @property
    def is_video(self) -> bool:
        return self.path.suffix.lower() in VIDEO_SUFFIXES


def list_media(folder: str | Path, caption_column: str = "text") -> list[MediaItem]:
    """Every image / video under ``folder`` with its caption; a missing folder or caption is a ``ConfigError``."""
    root = Path(str(folder)).expanduser()
    if not root.is_dir():
        raise ConfigError(f"input={folder} is not a folder; pass a folder of images or videos with captions "
                          f"(sidecar .txt files or a metadata.jsonl / metadata.csv)")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES + VIDEO_SUFFIXES)
    if not files:
        raise ConfigError(f"input={folder} holds no images ({', '.join(IMAGE_SUFFIXES)}) or videos "
                          f"({', '.join(VIDEO_SUFFIXES)})")
    table = _metadata_captions(root, caption_column)
    items = []
    for path in files:
        key = path.relative_to(root).as_posix()
        if table is not None:
            caption = table.get(key)
        else:
            sidecar = path.with_suffix(".txt")
            caption = sidecar.read_text(encoding="utf-8").strip() if sidecar.is_file() else None
        if caption is None:
            where = f"a row with file_name={key!r} in the metadata file" if table is not None else \
                f"a caption file {path.with_suffix('.txt').name} beside it"
            raise ConfigError(f"input={folder}: {key} has no caption; add {where} (every file needs one)")
        items.append(MediaItem(path, caption))
    return items


def _metadata_captions(root: Path, column: str) -> dict[str, str] | None:
    """file_name -> caption from metadata.jsonl or metadata.csv, or None when there is neither."""
    jsonl, table_csv = root / "metadata.jsonl", root / "metadata.csv"
    if jsonl.is_file():
        source = jsonl
        with open(jsonl, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    elif table_csv.is_file():
        source = table_csv
        with open(table_csv, encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        return None
    captions = {}
    for number, row in enumerate(rows, 1):
        if "file_name" not in row or column not in row:
            raise ConfigError(f"input: {source} row {number} has columns {sorted(row)}; it needs 'file_name' and "
                              f"the caption column {column!r} (set caption_column= to the one that holds captions)")
        captions[Path(str(row["file_name"])).as_posix()] = str(row[column]).strip()
    return captions
