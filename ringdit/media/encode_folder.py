"""Encode a folder of captioned images or videos into ``data=text_latents`` shards: the work of
``python -m ringdit.prepare`` (ringdit/prepare.py: its command line and SIGTERM handling).

Work layout:
    the sorted file list is cut into shards of ``shard_size`` files; shard i is ``out/shard-{i:05d}.safetensors``.
    Rank r of W (``RANK`` / ``WORLD_SIZE``, as torchrun sets them; 1 process otherwise) encodes shards r, r + W,
    r + 2W, ... on ``cuda:LOCAL_RANK`` when there is a GPU; no process group is needed.
Resume: a shard is written to a temp file and renamed, so a shard that exists is complete and is skipped; re-run
    the same command after an interruption.
Skips: a file that cannot be decoded, or a clip shorter than the bucket, is left out of its shard and counted (a
    shard whose files are all skipped is not written), as is a file metadata.jsonl / .csv lists that is not there.
    The skipped files are returned, and counted and named in the summary printed at the end.
Every shard stores the empty prompt's embedding (``null_*``), the captions, the VAE's class, folder and
normalisation (``vae``) and the text encoder's folders (``text_encoder``), all JSON metadata.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ringdit.data.text_latents import write_text_latents
from ringdit.dtypes import dtype_named
from ringdit.errors import ConfigError, require_count
from ringdit.media.folder import MediaItem, list_media
from ringdit.media.frames import TooShort, read_image, read_video
from ringdit.media.text import TextEncoder
from ringdit.media.vae import VAE

log = logging.getLogger("ringdit.prepare")


@dataclass
class EncodeReport:
    shards_written: int = 0
    shards_skipped: int = 0  # already present (resume)
    samples: int = 0
    unreadable: list[str] = field(default_factory=list)
    too_short: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # listed in metadata.jsonl / .csv but not there (rank 0 counts)
    seconds: float = 0.0

    def summary(self) -> str:
        rate = self.samples / self.seconds if self.seconds > 0 else 0.0
        return (f"prepared {self.samples} samples into {self.shards_written} new shards "
                f"({self.shards_skipped} already done) in {self.seconds:.1f} s ({rate:.2f} samples/s); skipped "
                f"{len(self.unreadable)} unreadable files{_named(self.unreadable)}, {len(self.too_short)} clips too "
                f"short for the bucket{_named(self.too_short)} and {len(self.missing)} files the metadata lists that "
                f"are missing or not images / videos{_named(self.missing)}")


def _named(paths: list[str], shown: int = 5) -> str:
    """`` (a, b, ... and 3 more)`` for a summary line; empty for none."""
    if not paths:
        return ""
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return f" ({', '.join(paths[:shown])}{more})"


def bucket_size(resolution, spatial: int) -> tuple[int, int]:
    """``resolution`` (an int, ``[H, W]`` or ``"HxW"``) -> (H, W), each a multiple of the VAE's downsampling."""
    if isinstance(resolution, str) and "x" in resolution:
        resolution = resolution.split("x")
    sizes = list(resolution) if isinstance(resolution, (list, tuple)) else [resolution, resolution]
    try:
        height, width = (int(s) for s in sizes)
    except (TypeError, ValueError):
        raise ConfigError(f"resolution must be an int, [H, W] or 'HxW', got {resolution!r}") from None
    if height < spatial or width < spatial or height % spatial or width % spatial:
        raise ConfigError(f"resolution={height}x{width}: height and width must be positive multiples of the VAE's "
                          f"downsampling factor {spatial}; e.g. resolution={max(spatial, height // spatial * spatial)}")
    return height, width


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.safetensors"


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def default_device() -> str:
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"


def encode_folder(input: str, out: str, vae: str, text_encoder: str, tokenizer: str | None = None, *,
            vae_subfolder: str | None = "vae", caption_column: str = "text", resolution=256, frames: int = 17,
            frame_stride: int = 1, max_text_len: int = 512, shard_size: int = 64, batch_size: int = 4,
            device: str | None = None, dtype: str = "float32", tiling: bool = True, tile: int | None = None,
            rank: int | None = None,
            world_size: int | None = None, progress: bool = True) -> EncodeReport:
    """Encode ``input`` into shards under ``out`` (see the module docstring); settings errors are ``ConfigError``."""
    from tqdm.auto import tqdm

    from ringdit.training.preemption import sigterm_waits

    for name, value in (("frames", frames), ("frame_stride", frame_stride), ("shard_size", shard_size),
                        ("batch_size", batch_size)):
        require_count(name, value)
    store = dtype_named("dtype", dtype)
    if not isinstance(tiling, bool):
        raise ConfigError(f"tiling must be true or false, got {tiling!r}")
    require_count("tile", tile, optional=True, hint="the VAE's spatial tile size in pixels, e.g. tile=256")
    if rank is None or world_size is None:
        rank, world_size = rank_and_world()
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} of world size {world_size} (RANK / WORLD_SIZE) is not a valid process; "
                          f"launch with torchrun, or unset both for one process")
    missing: list[str] = []  # the metadata's rows without their file: named in the summary (by rank 0: all see them)
    items = list_media(input, caption_column, missing=missing)
    videos = [item for item in items if item.is_video]
    if videos and len(videos) < len(items):
        image = next(item for item in items if not item.is_video)
        raise ConfigError(f"input={input} mixes videos ({videos[0].path.name}) and images ({image.path.name}); a "
                          f"prepared set has one shape, so prepare them into separate out= folders")
    device = device or default_device()
    codec = VAE(vae, vae_subfolder, device=device, dtype=store, tiling=tiling, tile=tile)
    if videos and not codec.is_video:
        raise ConfigError(f"vae={vae} is an image VAE ({codec.class_name}) but input={input} holds videos (first: "
                          f"{videos[0].path.name}); pass a video VAE folder (AutoencoderKLWan)")
    if videos and not codec.frames_ok(frames):
        raise ConfigError(f"frames={frames}: {codec.class_name} encodes 1 + k * {codec.temporal} frames; pass e.g. "
                          f"frames={1 + max(0, frames - 1) // codec.temporal * codec.temporal}")
    height, width = bucket_size(resolution, codec.spatial)
    encoder = TextEncoder(text_encoder, tokenizer, max_len=max_text_len, device=device, dtype=store)

    out_dir = Path(str(out)).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = [items[start:start + shard_size] for start in range(0, len(items), shard_size)]
    mine = range(rank, len(shards), world_size)
    report = EncodeReport(shards_skipped=sum(shard_path(out_dir, i).exists() for i in mine),
                           missing=missing if rank == 0 else [])
    pending = [i for i in mine if not shard_path(out_dir, i).exists()]
    null = {key: value[0] for key, value in encoder([""]).items()}  # the empty prompt: (L, D), (L,)[, (P,)]
    metadata = {"vae": json.dumps(codec.describe()), "text_encoder": json.dumps(encoder.describe()),
                "bucket": json.dumps({"height": height, "width": width, "frames": frames if videos else None,
                                      "frame_stride": frame_stride if videos else None, "source": str(input)})}
    start = time.perf_counter()
    bar = tqdm(total=sum(len(shards[i]) for i in pending), unit="file", disable=not progress,
               desc=f"prepare (rank {rank}/{world_size})" if world_size > 1 else "prepare")

    def load(item: MediaItem) -> torch.Tensor | None:
        try:
            if item.is_video:
                return read_video(item.path, height, width, frames, frame_stride)
            return read_image(item.path, height, width)
        except TooShort as error:
            report.too_short.append(str(item.path))
            log.warning("skipping a clip too short for frames=%d frame_stride=%d: %s", frames, frame_stride, error)
        except Exception as error:  # noqa: BLE001 - any decoder failure means this one file is unusable
            report.unreadable.append(str(item.path))
            log.warning("skipping unreadable %s (%s: %s)", item.path, type(error).__name__, error)
        return None

    for index in pending:
        rows: dict[str, list[torch.Tensor]] = {}
        captions: list[str] = []
        for batch_start in range(0, len(shards[index]), batch_size):
            batch = shards[index][batch_start:batch_start + batch_size]
            loaded = [(item, load(item)) for item in batch]
            loaded = [(item, pixels) for item, pixels in loaded if pixels is not None]
            bar.update(len(batch))
            if not loaded:
                continue
            latents = codec.encode(torch.stack([pixels for _, pixels in loaded]))  # (B, C, [T',] H', W')
            cond = encoder([item.caption for item, _ in loaded])
            for key, value in {"latents": latents, **cond}.items():
                rows.setdefault(key, []).append(value)
            captions += [item.caption for item, _ in loaded]
        if not captions:
            log.warning("shard %d: every file was skipped; no shard written", index)
            continue
        tensors = {key: torch.cat(values) for key, values in rows.items()}
        with sigterm_waits():  # under ringdit.prepare's SIGTERM handling: a shard being written is finished first
            write_text_latents(shard_path(out_dir, index), tensors["latents"].to(store), tensors["text"].to(store),
                               tensors["text_mask"], tensors["pooled"].to(store) if "pooled" in tensors else None,
                               null={k: (v.to(store) if v.is_floating_point() else v) for k, v in null.items()},
                               captions=captions, metadata=metadata)
            report.shards_written += 1
            report.samples += len(captions)
    bar.close()
    report.seconds = time.perf_counter() - start
    return report
