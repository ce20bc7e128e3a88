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
import logging
import posixpath
from dataclasses import dataclass
from pathlib import Path

from ringdit.common.errors import ConfigError
from ringdit.common.safe_json import parse_json

log = logging.getLogger("ringdit.prepare")

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_SUFFIXES = (".mp4", ".mov", ".webm", ".mkv", ".avi", ".gif")


@dataclass(frozen=True)
class MediaItem:
    path: Path
    caption: str
    start: int = 0  # a clip's window: its first frame on the clip's timeline (ringdit/media/windows.py)

    @property
    def is_video(self) -> bool:
        return self.path.suffix.lower() in VIDEO_SUFFIXES


def list_media(folder: str | Path, caption_column: str = "text", missing: list[str] | None = None) -> list[MediaItem]:
    """Every image / video under ``folder`` with its caption; a missing folder or caption, or a metadata file that
    cannot be read as a table of relative file names and text captions, is a ``ConfigError``. Rows of the metadata
    file whose file is not there (or is not an image / video) are left out, named in a warning and appended to
    ``missing`` (their paths), so that a summary can count them with the other skipped files."""
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
            caption = _read_text(sidecar, f"input={folder}: the caption file").strip() if sidecar.is_file() else None
        if caption is None:
            where = f"a row with file_name={key!r} in the metadata file" if table is not None else \
                f"a caption file {path.with_suffix('.txt').name} beside it"
            raise ConfigError(f"input={folder}: {key} has no caption; add {where} (every file needs one)")
        items.append(MediaItem(path, caption))
    if table is not None:
        found = {path.relative_to(root).as_posix() for path in files}
        absent = [key for key in table if key not in found]
        for key in absent:
            why = "is not an image or video" if (root / key).exists() else "does not exist"
            log.warning("skipping %s: the metadata file lists it, but it %s", root / key, why)
        if missing is not None:
            missing += [str(root / key) for key in absent]
    return items


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # -sig: also with the byte-order mark some editors write
    except UnicodeDecodeError as error:
        raise ConfigError(f"{what} {path} is not UTF-8 text ({error}); save it as UTF-8") from None


def _metadata_captions(root: Path, column: str) -> dict[str, str] | None:
    """file_name -> caption from metadata.jsonl or metadata.csv, or None when there is neither. Each row needs a
    ``file_name`` (a path relative to the folder, inside it) and a text caption in ``column``; a row that has not is
    a ``ConfigError`` naming the file, the row and what is wrong."""
    jsonl, table_csv = root / "metadata.jsonl", root / "metadata.csv"
    if jsonl.is_file():
        source = jsonl
        rows = []
        for number, line in enumerate(_read_text(jsonl, "input: the metadata file").splitlines(), 1):
            if not line.strip():
                continue
            example = f'{{"file_name": "a.mp4", "{column}": "a caption"}}'
            row = parse_json(line, f"input: {jsonl} row {number}", excerpt=True,
                             fix=f"each line is one object like {example}")
            rows.append((number, row))
    elif table_csv.is_file():
        source = table_csv
        with open(table_csv, encoding="utf-8-sig", newline="") as f:
            try:
                rows = list(enumerate(csv.DictReader(f), 1))
            except (UnicodeDecodeError, csv.Error) as error:
                raise ConfigError(f"input: the metadata file {table_csv} cannot be read as UTF-8 CSV ({error})"
                                  ) from None
    else:
        return None
    captions: dict[str, str] = {}
    rows_of: dict[str, int] = {}
    for number, row in rows:
        where = f"input: {source} row {number}"
        if not isinstance(row, dict):
            raise ConfigError(f"{where} is a JSON {type(row).__name__}, not an object like "
                              f"{{\"file_name\": \"a.mp4\", \"{column}\": \"a caption\"}}")
        if "file_name" not in row or column not in row:
            raise ConfigError(f"{where} has columns {sorted(map(str, row))}; it needs 'file_name' and "
                              f"the caption column {column!r} (set caption_column= to the one that holds captions)")
        name, caption = row["file_name"], row[column]
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{where}: file_name is {name!r}; give the file's path relative to the folder, "
                              f"e.g. clips/a.mp4")
        key = posixpath.normpath(name)
        if posixpath.isabs(key) or key == ".." or key.startswith("../"):
            raise ConfigError(f"{where}: file_name={name!r} is outside input={root}; file names are paths relative "
                              f"to the folder that holds {source.name}, inside it (e.g. clips/a.mp4)")
        if not isinstance(caption, str):
            what = "is empty (the row has fewer columns than the header)" if caption is None and source == table_csv \
                else f"is {caption!r} ({type(caption).__name__}), not a string"
            raise ConfigError(f"{where}: the caption ({column}) of {name} {what}; give every file a text caption")
        if key in captions:
            raise ConfigError(f"{where}: file_name={name!r} has a row already (row {rows_of[key]}); give each file "
                              f"one row (one caption)")
        captions[key], rows_of[key] = caption.strip(), number
    return captions
