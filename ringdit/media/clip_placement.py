"""Which files go where: each file probed and placed in its bucket (a clip once per window of frames), and the
placed files cut into shards (``encode_folder``'s plan; its module docstring says how)."""

from __future__ import annotations

import dataclasses
import json
import logging

from ringdit.common.errors import ConfigError
from ringdit.media.buckets import Bucket, Buckets, size_pair
from ringdit.media.folder import MediaItem
from ringdit.media.frames import probe
from ringdit.media.windows import Extraction, Timeline

log = logging.getLogger("ringdit.prepare")


def bucket_size(size, spatial: int, why: str = "the VAE's downsampling factor") -> tuple[int, int]:
    """``size`` (an int, ``[H, W]`` or ``"HxW"``) -> (H, W), each a multiple of ``spatial``: the VAE's
    downsampling (x its latent patch, for Flux.2's: ``VAE.size_step``)."""
    height, width = size_pair(size)
    if height < spatial or width < spatial or height % spatial or width % spatial:
        raise ConfigError(f"size={height}x{width}: height and width must be positive multiples of {why} "
                          f"{spatial}; e.g. size={max(spatial, height // spatial * spatial)}")
    return height, width

def place_files(items: list[MediaItem], chooser: Buckets, progress: bool = False, clock: Timeline = Timeline(),
                windows: Extraction = Extraction()) -> tuple[list[tuple[MediaItem, Bucket]], list[str], list[str]]:
    """Each file's bucket from its probed size and length (a clip's length on its ``clock``), a clip once per window
    (``windows``): (placed files, unreadable paths, too-short paths)."""
    from tqdm.auto import tqdm

    placed, unreadable, too_short = [], [], []
    for item in tqdm(items, unit="file", desc="probe", disable=not progress):
        try:
            height, width, length = probe(item.path, item.is_video)
        except Exception as error:  # noqa: BLE001 - a file that cannot be opened is skipped, as when decoding
            unreadable.append(str(item.path))
            log.warning("skipping unreadable %s (%s: %s)", item.path, type(error).__name__, error)
            continue
        if length is None or chooser.frame_counts is None:
            placed.append((item, chooser.choose(height, width, length)))
            continue
        usable = clock.length(length)
        bucket = chooser.place(height, width, usable)
        if bucket is None:
            too_short.append(str(item.path))
            log.warning("skipping a clip too short for every frame bucket (%s on its timeline %s): %s has %d frames "
                        "there", ", ".join(map(str, chooser.frame_counts or ())), json.dumps(clock.describe()),
                        item.path.name, usable)
            continue
        placed += [(dataclasses.replace(item, start=start), bucket) for start in windows.starts(usable, bucket.frames)]
    return placed, unreadable, too_short


def clip_windows(items: list[MediaItem], frames: int, clock: Timeline, windows: Extraction, progress: bool = False
                 ) -> tuple[list[MediaItem], list[str], list[str]]:
    """buckets=null: each clip once per window of ``frames`` frames on its ``clock`` (probed: its length from the
    headers), in the files' order: (the windows, unreadable paths, too-short paths)."""
    from tqdm.auto import tqdm

    kept, unreadable, too_short = [], [], []
    for item in tqdm(items, unit="file", desc="probe", disable=not progress):
        try:
            length = probe(item.path, True)[2]
        except Exception as error:  # noqa: BLE001 - a file that cannot be opened is skipped, as when decoding
            unreadable.append(str(item.path))
            log.warning("skipping unreadable %s (%s: %s)", item.path, type(error).__name__, error)
            continue
        starts = windows.starts(clock.length(length), frames)
        if not starts:
            too_short.append(str(item.path))
            log.warning("skipping a clip too short for frames=%d on its timeline %s: %s has %d frames there", frames,
                        json.dumps(clock.describe()), item.path.name, clock.length(length))
        kept += [dataclasses.replace(item, start=start) for start in starts]
    return kept, unreadable, too_short


def plan_shards(placed: list[tuple[MediaItem, Bucket]], shard_size: int) -> list[tuple[Bucket, list[MediaItem]]]:
    """Group the files (in their sorted order) by bucket, buckets in ``Bucket.order``, and cut each group into
    shards of ``shard_size``: shard i of the result is ``shard-{i:05d}``, the same on every rank and every run."""
    groups: dict[Bucket, list[MediaItem]] = {}
    for item, bucket in placed:
        groups.setdefault(bucket, []).append(item)
    return [(bucket, files[start:start + shard_size])
            for bucket in sorted(groups, key=Bucket.order)
            for files in [groups[bucket]] for start in range(0, len(files), shard_size)]
