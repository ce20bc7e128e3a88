"""Encode a folder of captioned images or videos into ``data=text_latents`` shards: the work of
``python -m ringdit.prepare`` (ringdit/prepare.py: its command line and SIGTERM handling).

Buckets (the shapes files are encoded at; ringdit/media/buckets.py chooses, ringdit/media/frames.py crops):
    buckets=null     (the default) one bucket, ``size`` x ``frames``: every file is centre-cropped and resized
                     to it and every shard has that shape; a folder may not mix images and videos.
    buckets=auto     aspect-ratio buckets of area at most the size's (1:4 to 4:1, sides in ``bucket_step``
    or a list        steps), or the listed [H, W] sizes: each file goes to the bucket of nearest aspect ratio and is
                     cropped as little as it needs; a clip gets the longest allowed frame count (``frame_buckets``,
                     default 1 + k * temporal up to ``frames``) it has at ``frame_stride``, and an image is one
                     frame (latents (C, 1, H', W') with a video VAE), so images and videos can share one run.
    Every file is probed first (its size and length from the headers, no decoding), by every rank alike.
Work layout:
    buckets=null: the sorted file list is cut into shards of ``shard_size`` files. With buckets: the sorted files
    are grouped by bucket (buckets ordered by frames, height, width), each group cut into shards of ``shard_size``,
    and the shards numbered in that order, so each shard holds ONE bucket (its latents' shape is the bucket); the
    plan (each shard's bucket and files) is written to ``out/buckets.json``. Shard i is
    ``out/shard-{i:05d}.safetensors``; each records its bucket as the ``bucket`` metadata (JSON: height, width,
    frames). Rank r of W (``RANK`` / ``WORLD_SIZE``, as torchrun sets them; 1 process otherwise) encodes shards
    r, r + W, r + 2W, ... on ``cuda:LOCAL_RANK`` when there is a GPU; no process group is needed.
Parallel VAE (``parallel_vae=true``): every rank works on every clip instead, for clips too big for one rank to
    encode quickly. Rank 0 runs the one-process prepare -- reads every file, encodes the captions, writes every
    shard, resumes and checks the plan as one process does -- and before each VAE batch broadcasts its pixels to
    the other ranks, which join ``VAE.encode(group=..., dst=0)``: the batch's spatial tiles split over all ranks
    (``ringdit.media.parallel_vae``) and blended on rank 0. So the shards are one process's shards (bit-identical
    when each tile is computed with the same kernels and thread count as there). The other ranks load only the VAE
    and write nothing. The process group (gloo on CPU, nccl on GPUs) is made from torchrun's environment, unless
    a default group is initialised already.
Resume: a shard is written to a temp file and renamed, so a shard that exists is complete and is skipped; re-run
    the same command after an interruption. With buckets, a re-run whose plan differs from ``out/buckets.json``
    (files added or removed, other settings) while shards exist is refused: prepare into a new out= folder.
Skips: a file that cannot be decoded, or a clip shorter than the bucket, is left out of its shard and counted (a
    shard whose files are all skipped is not written), as is a file metadata.jsonl / .csv lists that is not there.
    The skipped files are returned, and counted and named in the summary printed at the end, with the samples
    written per bucket.
Every shard stores the VAE's class, folder and normalisation (``vae``) and its samples' files as JSON metadata; its
    text encodings, the empty prompt's (``null_*``), the captions and the text encoder's folders (``text_encoder``)
    are in its text file, ``text/<the shard's name>`` (ringdit/media/retext.py): new captions or another text encoder
    re-encode only those on a re-run, never the latents.
Two text encoders (``pooled_encoder``, Flux's CLIP + T5): ``text`` from ``text_encoder`` (T5) and ``pooled`` from
    the CLIP, both in every shard, as FluxPipeline.encode_prompt gives them (ringdit/media/text.py).
Chat text encoders (``prompt_template``: HunyuanVideo 1.5's Qwen2.5-VL, Flux.2's Mistral3): the prompt in the
    pipeline's chat template, ``text`` its hidden layers as the pipeline takes them (ringdit/media/text.py).
HunyuanVideo 1.5's glyph encoder (``glyph_encoder``, its ByT5, with ``prompt_template=hunyuan_video15``): each
    caption's quoted text also as ``glyph_text`` / ``glyph_text_mask`` (N, 256, ...), the empty prompt's as
    ``null_glyph_*``, in the same shards, as HunyuanVideo15Pipeline.encode_prompt gives them (ringdit/media/glyph.py).
Flux.2's VAE (AutoencoderKLFlux2): normalised per channel of its 2x2 latent patches (ringdit/media/vae.py), so bucket
    sizes are multiples of 16 px and ``bucket_step`` defaults to 16.
Image-to-video (``task=i2v``): each clip's shard rows also hold its first frame's ``image_latents`` and
    ``image_condition`` (ringdit/media/image_condition.py; the extra encodes go through the same VAE path as the
    clip's, so ``parallel_vae=true`` splits them too) and, with ``image_encoder`` (a CLIP or SigLIP vision model),
    its ``image_embeds``; the shards record ``task`` (a resume with another task is refused) and ``image_encoder``
    metadata. Images, and clips placed in a 1-frame bucket (``frame_buckets`` with 1), have no video to condition:
    with buckets they are left out, counted and named in the summary (and in ``buckets.json``); a folder without
    videos is refused.
Loss masks (``mask_path``, diffusion-pipe's): each clip's mask -- an image or video with its file name stem in that
    folder, of its size -- read as the clip is (the same bucket, crop and frames) and averaged onto its latents' grid
    (ringdit/media/masks.py), stored as ``loss_mask`` (N, 1, [T',] H', W'); a clip without one trains everywhere (all
    ones). A resume with masks of shards prepared without them (or the other way round) is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ringdit.atomic import atomic_write
from ringdit.data.text_latent_shards import IMAGE_KEYS, MASK_KEY, TEXT_KEYS, save_tensors
from ringdit.dtypes import dtype_named
from ringdit.errors import ConfigError, require_count
from ringdit.media.folder import MediaItem, list_media
from ringdit.media.buckets import Bucket, Buckets, make_buckets, parse_buckets, size_pair
from ringdit.media.frames import TooShort, probe, read_frames, read_image, to_image
from ringdit.media.image_condition import ImageEncoder, first_frame_condition, image_encoder_folders
from ringdit.media.masks import find_masks, latent_mask
from ringdit.media.text import TextEncoder, chat_template, check_glyph_settings, check_pooled_settings
from ringdit.media.vae import VAE, usable_device
from ringdit.media.retext import rewrite_text, sample_name, stale_captions, write_text
from ringdit.media.windows import Extraction, Timeline, extraction, pipeline_fps, timeline

log = logging.getLogger("ringdit.prepare")

PLAN = "buckets.json"  # with buckets: each shard's bucket and files (see the module docstring)
PLAN_FORMAT = "ringdit.prepare.buckets/1"
TASKS = ("t2v", "i2v")  # text-conditioned latents; + each clip's first-frame conditioning (image-to-video)


@dataclass
class EncodeReport:
    shards_written: int = 0
    shards_skipped: int = 0  # already present (resume)
    texts_encoded: int = 0  # already present, their text re-encoded: new captions or text encoder (media/retext.py)
    samples: int = 0
    unreadable: list[str] = field(default_factory=list)
    too_short: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # listed in metadata.jsonl / .csv but not there (rank 0 counts)
    stills: list[str] = field(default_factory=list)  # task=i2v: images (and 1-frame clips), no video to condition
    seconds: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)  # bucket name (HxWxT) -> samples written now
    tile_batches: int | None = None  # parallel_vae=true, ranks > 0: the VAE batches whose tiles this rank shared

    def summary(self) -> str:
        if self.tile_batches is not None:  # a helper rank wrote nothing: say so instead of "0 samples"
            return (f"parallel_vae=true: encoded a share of the VAE tiles of {self.tile_batches} batches in "
                    f"{self.seconds:.1f} s; rank 0 wrote the shards and reports them")
        rate = self.samples / self.seconds if self.seconds > 0 else 0.0
        return (f"prepared {self.samples} samples into {self.shards_written} new shards "
                f"({self.shards_skipped} already done{self._retexted()}) in {self.seconds:.1f} s "
                f"({rate:.2f} samples/s); skipped "
                f"{len(self.unreadable)} unreadable files{_named(self.unreadable)}, {len(self.too_short)} clips too "
                f"short for the bucket{_named(self.too_short)} and {len(self.missing)} files the metadata lists that "
                f"are missing or not images / videos{_named(self.missing)}" + (
                    f"; task=i2v: left out {len(self.stills)} images or 1-frame clips, which have no video to "
                    f"condition on their first frame{_named(self.stills)}" if self.stills else "") + (
                    "; by bucket: " + ", ".join(f"{name}: {count} samples" for name, count in self.buckets.items())
                    if self.buckets else ""))


    def _retexted(self) -> str:
        return f", {self.texts_encoded} re-encoded for new captions or a new text encoder, their latents kept" \
            if self.texts_encoded else ""


def _named(paths: list[str], shown: int = 5) -> str:
    """`` (a, b, ... and 3 more)`` for a summary line; empty for none."""
    if not paths:
        return ""
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return f" ({', '.join(paths[:shown])}{more})"


def bucket_size(size, spatial: int, why: str = "the VAE's downsampling factor") -> tuple[int, int]:
    """``size`` (an int, ``[H, W]`` or ``"HxW"``) -> (H, W), each a multiple of ``spatial``: the VAE's
    downsampling (x its latent patch, for Flux.2's: ``VAE.size_step``)."""
    height, width = size_pair(size)
    if height < spatial or width < spatial or height % spatial or width % spatial:
        raise ConfigError(f"size={height}x{width}: height and width must be positive multiples of {why} "
                          f"{spatial}; e.g. size={max(spatial, height // spatial * spatial)}")
    return height, width


def check_task(task, image_encoder, image_processor) -> None:
    """One-line errors for the task / image encoder settings, before any work (the image encoder's folders are
    checked, nothing loaded)."""
    if task not in TASKS:
        raise ConfigError(f"task={task!r} is not one of {', '.join(TASKS)}; pass task=t2v (text-conditioned latents) "
                          f"or task=i2v (also each clip's first-frame conditioning, for image-to-video)")
    if image_encoder is not None and task != "i2v":
        raise ConfigError(f"image_encoder={image_encoder} gives the image embeddings of image-to-video, but "
                          f"task={task}; pass task=i2v, or drop image_encoder")
    if image_processor is not None and image_encoder is None:
        raise ConfigError(f"image_processor={image_processor} is the image encoder's processor, but image_encoder is "
                          f"not set; pass image_encoder=<CLIP / SigLIP vision model folder> too, or drop "
                          f"image_processor")
    if image_encoder is not None:
        image_encoder_folders(image_encoder, image_processor)


def check_resumed_task(out_dir: Path, task: str, masked: bool = False) -> None:
    """Shards already in ``out_dir`` were prepared for the same task and with loss masks alike (else resuming would
    mix shards with and without the image-to-video or the mask keys): a ``ConfigError`` if not. (A glyph encoder added
    or dropped is another text encoder: the text files are encoded again.)"""
    from safetensors import safe_open

    done = next(iter(sorted(out_dir.glob("shard-*.safetensors"))), None)
    if done is None:
        return
    try:
        with safe_open(str(done), framework="pt") as f:
            before = (f.metadata() or {}).get("task", "t2v")  # shards from before task= are text-to-video
            had_masks = MASK_KEY in f.keys()  # noqa: SIM118 - a safetensors handle lists its tensors with keys()
    except Exception:  # noqa: BLE001 - an unreadable shard is the reader's to report; it says nothing of the task
        return
    if before != task:
        raise ConfigError(f"out={out_dir} holds shards prepared with task={before} ({done.name}), but task={task}; "
                          f"pass task={before} to resume them, or prepare into a new out= folder")
    if had_masks != masked:
        raise ConfigError(f"out={out_dir} holds shards prepared {'with' if had_masks else 'without'} loss masks "
                          f"({done.name}), but mask_path is {'set' if masked else 'null'}; resume them as they were "
                          f"prepared, or prepare into a new out= folder")


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.safetensors"


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def default_device() -> str:
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"


def encode_folder(input: str, out: str, vae: str, text_encoder: str, tokenizer: str | None = None, *,
            vae_subfolder: str | None = "vae", caption_column: str = "text", size=256, frames: int = 17,
            frame_stride: int = 1, buckets=None, bucket_step: int | None = None, frame_buckets=None,
            max_text_len: int = 512, shard_size: int = 64, batch_size: int = 4, device: str | None = None,
            dtype: str = "float32", text_dtype: str | None = None, tiling: bool = True, tile: int | None = None,
            parallel_vae: bool = False,
            task: str = "t2v", image_encoder: str | None = None, image_processor: str | None = None,
            pooled_encoder: str | None = None, pooled_tokenizer: str | None = None, max_pooled_len: int = 77,
            masked_text: bool | None = None, prompt_template: str | None = None, glyph_encoder: str | None = None,
            glyph_tokenizer: str | None = None, mask_path: str | None = None, frame_extraction: str = "head",
            window_stride: int | None = None, frame_sample: int | None = None, source_fps=None,
            fps: int | None = None, rank: int | None = None, world_size: int | None = None,
            progress: bool = True) -> EncodeReport:
    """Encode ``input`` into shards under ``out`` (see the module docstring); settings errors are ``ConfigError``."""
    check_task(task, image_encoder, image_processor)  # before any work, on every rank alike
    device = str(usable_device(device or default_device()))  # meta, or a GPU this machine lacks: one line
    check_pooled_settings(pooled_encoder, pooled_tokenizer, masked_text)
    chat_template(prompt_template)  # a name it does not know: one line, before any work
    check_glyph_settings(glyph_encoder, glyph_tokenizer, prompt_template)
    if not isinstance(parallel_vae, bool):
        raise ConfigError(f"parallel_vae must be true or false, got {parallel_vae!r}; pass parallel_vae=true to split "
                          f"each clip's VAE tiles over the torchrun ranks, or parallel_vae=false (one rank per shard)")
    if parallel_vae and tiling is False:
        raise ConfigError("parallel_vae=true splits the VAE's spatial tiles over the ranks, but tiling=false makes "
                          "no tiles; pass tiling=true (tile= sets their size), or parallel_vae=false")
    if rank is None and world_size is None and parallel_vae and dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()  # a group made by the caller (e.g. a test)
    elif rank is None or world_size is None:
        rank, world_size = rank_and_world()
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} of world size {world_size} (RANK / WORLD_SIZE) is not a valid process; "
                          f"launch with torchrun, or unset both for one process")
    if parallel_vae and world_size == 1:
        log.warning("parallel_vae=true in one process: there are no other ranks to share the tiles with, so this "
                    "is the plain prepare; launch with torchrun --nproc-per-node N to split them over N ranks")
    with TileGroup.joined(parallel_vae and world_size > 1, rank, world_size, device) as tiles:
        return _encode_folder(input, out, vae, text_encoder, tokenizer, vae_subfolder=vae_subfolder,
                              caption_column=caption_column, size=size, frames=frames,
                              frame_stride=frame_stride, buckets=buckets, bucket_step=bucket_step,
                              frame_buckets=frame_buckets, max_text_len=max_text_len, shard_size=shard_size,
                              batch_size=batch_size, device=device, dtype=dtype, text_dtype=text_dtype,
                              tiling=tiling, tile=tile,
                              task=task, image_encoder=image_encoder, image_processor=image_processor,
                              pooled_encoder=pooled_encoder, pooled_tokenizer=pooled_tokenizer,
                              max_pooled_len=max_pooled_len, masked_text=masked_text, prompt_template=prompt_template,
                              glyph_encoder=glyph_encoder, glyph_tokenizer=glyph_tokenizer, mask_path=mask_path,
                              frame_extraction=frame_extraction, window_stride=window_stride,
                              frame_sample=frame_sample, source_fps=source_fps, fps=fps, tiles=tiles, rank=rank,
                              world_size=world_size, progress=progress)


def _encode_folder(input, out, vae, text_encoder, tokenizer, *, vae_subfolder, caption_column, size, frames,
                   frame_stride, buckets, bucket_step, frame_buckets, max_text_len, shard_size, batch_size, device,
                   dtype, text_dtype, tiling, tile, task, image_encoder, image_processor, pooled_encoder,
                   pooled_tokenizer, max_pooled_len, masked_text, prompt_template, glyph_encoder, glyph_tokenizer,
                   mask_path,
                   frame_extraction, window_stride, frame_sample, source_fps, fps,
                   tiles: TileGroup | None, rank, world_size, progress) -> EncodeReport:
    """``encode_folder``'s work, given its ``TileGroup`` (parallel_vae=true on several ranks, else None)."""
    from tqdm.auto import tqdm

    from ringdit.preemption import sigterm_waits

    for name, value in (("frames", frames), ("frame_stride", frame_stride), ("shard_size", shard_size),
                        ("batch_size", batch_size)):
        require_count(name, value)
    store = dtype_named("dtype", dtype)
    text_store = store if text_dtype is None else dtype_named("text_dtype", text_dtype)  # the text encoder's
    if not isinstance(tiling, bool):
        raise ConfigError(f"tiling must be true or false, got {tiling!r}")
    require_count("tile", tile, optional=True, hint="the VAE's spatial tile size in pixels, e.g. tile=256")
    bucketed = parse_buckets(buckets) is not None  # its form checked before any model is loaded
    windows = extraction(frame_extraction, window_stride, frame_sample, bucketed)  # which frames: before any work
    clock = timeline(frame_stride, source_fps, fps, pipeline_fps(vae, vae_subfolder) if fps is None and
                     source_fps is not None else None, vae)
    if not bucketed and frame_buckets is not None:
        raise ConfigError(f"frame_buckets={frame_buckets!r} needs buckets=auto or a list of [H, W] (with "
                          f"buckets=null every clip is cut to frames={frames}); pass buckets=auto, or drop "
                          f"frame_buckets")
    if bucket_step is not None and parse_buckets(buckets) != "auto":
        raise ConfigError(f"bucket_step={bucket_step!r} is the size step of buckets=auto, but buckets="
                          f"{'null' if buckets is None else repr(buckets)}; pass buckets=auto, or drop bucket_step")
    out_dir = Path(str(out)).expanduser()
    if not bucketed and (out_dir / PLAN).is_file() and any(out_dir.glob("shard-*.safetensors")):
        raise ConfigError(f"out={out} holds shards prepared with buckets ({PLAN}); pass the buckets= setting they "
                          f"were made with to resume, or prepare into a new out= folder")
    check_resumed_task(out_dir, task, mask_path is not None)  # no resume that mixes shards' keys
    missing: list[str] = []  # the metadata's rows without their file: named in the summary (by rank 0: all see them)
    items = list_media(input, caption_column, missing=missing)
    masks = find_masks(mask_path, items) if mask_path is not None else None  # headers only: before any model loads
    if masks is not None and len(masks) < len(items):
        log.warning("mask_path=%s: %d of %d files have no mask (first: %s); they train everywhere", mask_path,
                    len(items) - len(masks), len(items), next(i.path.name for i in items if i.path not in masks))
    videos = [item for item in items if item.is_video]
    if videos and len(videos) < len(items) and not bucketed:
        image = next(item for item in items if not item.is_video)
        raise ConfigError(f"input={input} mixes videos ({videos[0].path.name}) and images ({image.path.name}); with "
                          f"buckets=null a prepared set has one shape, so pass buckets=auto (images become "
                          f"one-frame buckets) or prepare them into separate out= folders")
    if task == "i2v" and not videos:
        raise ConfigError(f"task=i2v conditions each clip on its first frame, but input={input} holds no videos"
                          f"{' (only images)' if items else ''}; pass a folder of clips, or task=t2v")
    if task == "i2v" and not bucketed and frames == 1:
        raise ConfigError("task=i2v with frames=1: a 1-frame clip is its own first frame, with nothing to generate; "
                          "pass frames=1 + k * the VAE's temporal factor (e.g. frames=17), or task=t2v")
    device = device or default_device()
    codec = VAE(vae, vae_subfolder, device=device, dtype=store, tiling=tiling, tile=tile)
    encode = codec.encode
    if tiles is not None:
        tiles.check(codec, vae)
        if rank != 0:  # a helper: its share of every batch's tiles, until rank 0 is done
            return tiles.serve(codec)
        encode = tiles.leader(codec)  # the pixels to the helpers, then the tile-parallel encode
        rank, world_size = 0, 1  # from here rank 0 prepares every shard, as one process would
    if videos and not codec.is_video:
        raise ConfigError(f"vae={vae} is an image VAE ({codec.class_name}) but input={input} holds videos (first: "
                          f"{videos[0].path.name}); pass a video VAE folder (AutoencoderKLWan)")
    if videos:
        codec.check_frames(frames)
    report = EncodeReport(missing=missing if rank == 0 else [])
    if bucketed:
        if bucket_step is None and codec.patch > 1:  # Flux.2: one token's 16 px (as 2 x 8 px for Flux's 2x2 packing)
            bucket_step = codec.size_step
        chooser = make_buckets(buckets, size, spatial=codec.size_step,
                               temporal=codec.temporal if codec.is_video else None, frames=frames,
                               frame_stride=frame_stride, frame_buckets=frame_buckets, bucket_step=bucket_step,
                               class_name=codec.class_name)
        placed, unreadable, too_short = place_files(items, chooser, progress=progress, clock=clock, windows=windows)
        stills = []
        if task == "i2v":  # an image (or a 1-frame clip) has no video to condition on its first frame: left out
            stills = [str(item.path) for item, bucket in placed if bucket.frames == 1]
            placed = [(item, bucket) for item, bucket in placed if bucket.frames != 1]
            if stills and not placed:  # nothing would be prepared: say why instead of "prepared 0 samples"
                raise ConfigError(f"task=i2v: every file of input={input} falls in a 1-frame bucket (buckets="
                                  f"{buckets}, frames={frames}), and a 1-frame clip is its own first frame, with "
                                  f"nothing to generate; give frame buckets of 1 + k * {codec.temporal} frames (e.g. "
                                  f"frames={1 + codec.temporal * 4}), or task=t2v")
            if stills:
                log.warning("task=i2v: leaving out %d images or 1-frame clips (first: %s); image-to-video trains on "
                            "clips", len(stills), Path(stills[0]).name)
        if rank == 0:  # every rank probes every file; rank 0 reports the files left out, so totals add up
            report.unreadable += unreadable
            report.too_short += too_short
            report.stills += stills
        shards = plan_shards(placed, shard_size)
        check_plan(out_dir, Path(str(input)).expanduser(), shards, rank, unreadable, too_short, chooser, stills)
    else:
        height, width = bucket_size(size, codec.size_step, "the VAE's downsampling factor" if codec.patch == 1
                                    else f"{codec.class_name}'s {codec.spatial}x downsampling x its {codec.patch}x"
                                         f"{codec.patch} latent patches,")
        bucket = Bucket(height, width, frames if videos else None)
        if videos and (windows.mode != "head" or clock.source_fps is not None):  # the windows need each length
            items, unreadable, too_short = clip_windows(items, frames, clock, windows, progress=progress)
            if rank == 0:
                report.unreadable += unreadable
                report.too_short += too_short
        shards = [(bucket, items[start:start + shard_size]) for start in range(0, len(items), shard_size)]
    encoder = TextEncoder(text_encoder, tokenizer, max_len=max_text_len, device=device, dtype=text_store,
                          pooled_encoder=pooled_encoder, pooled_tokenizer=pooled_tokenizer,
                          max_pooled_len=max_pooled_len, masked=masked_text, prompt_template=prompt_template,
                          glyph_encoder=glyph_encoder, glyph_tokenizer=glyph_tokenizer)
    clip = ImageEncoder(image_encoder, image_processor, device=device, dtype=store) if image_encoder else None

    out_dir.mkdir(parents=True, exist_ok=True)
    mine = range(rank, len(shards), world_size)
    pending = [i for i in mine if not shard_path(out_dir, i).exists()]
    null = {key: value[0] for key, value in encoder([""]).items()}  # the empty prompt: (L, D), (L,)[, (P,), ...]
    described = {"vae": json.dumps(codec.describe()),  # the text's dtype too: another re-encodes only the text
                 "text_encoder": json.dumps({**encoder.describe(), "dtype": str(text_store).removeprefix("torch.")})}
    root = Path(str(input)).expanduser()
    for index in (i for i in mine if i not in pending):  # finished: new captions or text encoder re-encode the text
        path = shard_path(out_dir, index)
        captions = stale_captions(path, shards[index][1], root, described["text_encoder"],
                                  {**clock.describe(), **windows.describe()})
        if captions is None:
            report.shards_skipped += 1
            continue
        with sigterm_waits():
            rewrite_text(path, captions, encoder, null, described["text_encoder"], text_store, batch_size)
        report.texts_encoded += 1
    if task == "i2v":
        described["task"] = "i2v"  # what a resumed run checks (check_resumed_task); no key: t2v, as before
    if clip is not None:
        described["image_encoder"] = json.dumps(clip.describe())
    start = time.perf_counter()
    bar = tqdm(total=sum(len(shards[i][1]) for i in pending), unit="file", disable=not progress,
               desc=f"prepare (rank {rank}/{world_size})" if world_size > 1 else "prepare")

    def load(item: MediaItem, bucket: Bucket) -> torch.Tensor | None:
        try:
            if item.is_video:
                pixels = read_frames(item.path, bucket.height, bucket.width, clock.indices(item.start, bucket.frames),
                                     f"{bucket.frames} frames from frame {item.start} of its timeline "
                                     f"({json.dumps(clock.describe())})")
            else:
                pixels = read_image(item.path, bucket.height, bucket.width)
            # with buckets, an image in a video VAE's set is a one-frame video, stacked with any 1-frame clips
            return pixels[:, None] if bucketed and bucket.frames is not None and pixels.ndim == 3 else pixels
        except TooShort as error:
            report.too_short.append(str(item.path))
            log.warning("skipping a clip too short for frames=%d frame_stride=%d: %s", bucket.frames, frame_stride,
                        error)
        except Exception as error:  # noqa: BLE001 - any decoder failure means this one file is unusable
            report.unreadable.append(str(item.path))
            log.warning("skipping unreadable %s (%s: %s)", item.path, type(error).__name__, error)
        return None

    for index in pending:
        bucket, files = shards[index]
        rows: dict[str, list[torch.Tensor]] = {}
        captions: list[str] = []
        names: list[str] = []  # each sample's file (and window): what a re-run matches new captions to
        for batch_start in range(0, len(files), batch_size):
            batch = files[batch_start:batch_start + batch_size]
            loaded = [(item, load(item, bucket)) for item in batch]
            loaded = [(item, pixels) for item, pixels in loaded if pixels is not None]
            if masks is not None:  # each clip's mask read as the clip (an unreadable one skips its clip, counted)
                read = [(item, pixels, load(dataclasses.replace(item, path=masks[item.path]), bucket)
                         if item.path in masks else torch.ones_like(pixels)) for item, pixels in loaded]
                loaded = [(item, pixels) for item, pixels, mask in read if mask is not None]
                mask_pixels = [mask for _, _, mask in read if mask is not None]
            bar.update(len(batch))
            if not loaded:
                continue
            pixels = torch.stack([pixels for _, pixels in loaded])  # (B, 3, [T,] H, W)
            latents = encode(pixels)  # (B, C, [T',] H', W')
            cond = encoder([item.caption for item, _ in loaded])
            if masks is not None:
                cond[MASK_KEY] = torch.stack([latent_mask(mask, tuple(latents.shape[2:]), codec.temporal)
                                              for mask in mask_pixels])
            if task == "i2v":  # the first frame's conditioning, its encodes by the same VAE path as the clips'
                cond.update(first_frame_condition(encode, pixels[:, :, 0], bucket.frames))
                if clip is not None:  # CLIP sees the first frame as the bucket shows it (the same 8-bit RGB)
                    cond["image_embeds"] = clip([to_image(frame) for frame in pixels[:, :, 0]])
            for key, value in {"latents": latents, **cond}.items():
                rows.setdefault(key, []).append(value)
            captions += [item.caption for item, _ in loaded]
            names += [sample_name(item, root) for item, _ in loaded]
        if not captions:
            log.warning("shard %d: every file was skipped; no shard written", index)
            continue
        tensors = {key: torch.cat(values) for key, values in rows.items()}
        clips = any(item.is_video for item in files)
        metadata = {**{k: v for k, v in described.items() if k != "text_encoder"}, "files": json.dumps(names),
                    "bucket": json.dumps({
            "height": bucket.height, "width": bucket.width, "frames": bucket.frames,
            "frame_stride": frame_stride if clips else None, "source": str(input),
            **({**clock.describe(), **windows.describe(), "starts": [int(n.rpartition("@")[2]) if "@" in n else 0
                                                                     for n in names]}
               if clips and (windows.mode != "head" or clock.source_fps is not None) else {})})}
        latents = {"latents": tensors["latents"].to(store),
                   **{key: tensors[key].to(store) for key in IMAGE_KEYS if key in tensors},
                   **({MASK_KEY: tensors[MASK_KEY].float()} if MASK_KEY in tensors else {})}
        # under ringdit.prepare's SIGTERM handling: a shard being written is finished first. The latents first, then
        # the text: a shard stopped before its text file has stale text, which a re-run encodes (media/retext.py)
        with sigterm_waits():
            save_tensors(shard_path(out_dir, index), latents, metadata)
            write_text(shard_path(out_dir, index), {key: tensors[key] for key in TEXT_KEYS if key in tensors},
                       null, captions, names, described["text_encoder"], text_store)
            report.shards_written += 1
            report.samples += len(captions)
            report.buckets[bucket.name] = report.buckets.get(bucket.name, 0) + len(captions)
    bar.close()
    report.seconds = time.perf_counter() - start
    return report


class TileGroup:
    """parallel_vae=true on several ranks: rank 0 (the leader) prepares as one process and, for each VAE batch,
    sends its pixels to the other ranks (the helpers), which then encode their share of its tiles with it.

    One message a batch -- (shape, dtype) by ``broadcast_object_list``, then the pixels by ``broadcast`` -- and
    ``None`` when the leader is done. The helpers need nothing but the VAE and this stream, so they read no file and
    load no text encoder, and whatever ends the leader's run (its last shard, a settings error, a SIGTERM) ends
    theirs: ``joined`` sends the ``None`` on the way out, unless the leader stopped inside a batch's collectives,
    where a stray message would not match what the helpers wait for; torchrun then stops them."""

    # The helpers wait on the leader's setup (probing every file, loading the text encoder) and on its file reading,
    # text encoding and writing between batches: far longer than a collective usually takes.
    TIMEOUT = datetime.timedelta(hours=2)

    def __init__(self, group, transport: torch.device):
        self.group, self.transport = group, transport
        self.leading = False  # rank 0 passed the checks every rank makes: the helpers are serving and wait for it
        self.busy = False  # inside a batch's collectives

    @classmethod
    @contextlib.contextmanager
    def joined(cls, wanted: bool, rank: int, world_size: int, device: str | None):
        """The TileGroup of this rank (None unless ``wanted``); the process group made from torchrun's environment
        (``MASTER_ADDR`` ...) unless one is initialised, and destroyed after if made here."""
        if not wanted:
            yield None
            return
        made = not dist.is_initialized()
        on = torch.device(device or default_device())
        if not made and dist.get_world_size() != world_size:
            raise ConfigError(f"parallel_vae=true: the process group has {dist.get_world_size()} ranks but "
                              f"world_size={world_size} (WORLD_SIZE); launch with torchrun, which sets both alike")
        if made:
            if on.type == "cuda":
                torch.cuda.set_device(on)
            dist.init_process_group("nccl" if on.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                                    timeout=cls.TIMEOUT)
        group = dist.group.WORLD
        tiles = cls(group, on if dist.get_backend(group) == "nccl" else torch.device("cpu"))
        try:
            yield tiles
        finally:
            if tiles.leading and not tiles.busy:
                tiles._announce(None)  # the helpers stop, however the leader ended
            if made:
                dist.destroy_process_group()

    @staticmethod
    def check(codec: VAE, setting) -> None:
        """A clear error, on every rank alike, where ``codec`` cannot split its encode into tiles."""
        from ringdit.media.parallel_vae import IMAGE, VIDEO

        name = type(codec.model).__name__
        if name not in VIDEO + IMAGE:
            raise ConfigError(f"parallel_vae=true: vae={setting} is {name}, whose encode ringdit cannot split into "
                              f"tiles (it can for {', '.join(VIDEO + IMAGE)}); pass parallel_vae=false")
        if not getattr(codec.model, "use_tiling", False):
            raise ConfigError(f"parallel_vae=true: vae={setting} ({name}) has spatial tiling off, so there are no "
                              f"tiles to split; pass tiling=true, or parallel_vae=false")

    def _announce(self, pixels: torch.Tensor | None) -> None:
        dist.broadcast_object_list([None if pixels is None else (tuple(pixels.shape), pixels.dtype)], src=0,
                                   group=self.group)

    def leader(self, codec: VAE):
        """Rank 0's ``encode``: the batch to every rank, then its tiles encoded by all of them; latents here."""
        self.leading = True

        def encode(pixels: torch.Tensor) -> torch.Tensor:
            self.busy = True
            self._announce(pixels)
            dist.broadcast(pixels.to(self.transport).contiguous(), src=0, group=self.group)
            latents = codec.encode(pixels, group=self.group, dst=0)
            self.busy = False
            return latents
        return encode

    def serve(self, codec: VAE) -> EncodeReport:
        """A helper's whole run: each batch rank 0 announces, received and encoded with it, until its ``None``."""
        report, start = EncodeReport(tile_batches=0), time.perf_counter()
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0, group=self.group)
            if message[0] is None:
                break
            shape, dtype = message[0]
            pixels = torch.empty(shape, dtype=dtype, device=self.transport)
            dist.broadcast(pixels, src=0, group=self.group)
            codec.encode(pixels, group=self.group, dst=0)  # None here: the latents go to rank 0
            report.tile_batches += 1
        report.seconds = time.perf_counter() - start
        return report


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


def check_plan(out_dir: Path, root: Path, shards: list[tuple[Bucket, list[MediaItem]]], rank: int,
               unreadable: list[str], too_short: list[str], chooser: Buckets,
               stills: list[str] = ()) -> None:
    """Write the plan to ``out/buckets.json`` (rank 0, atomically), or, when shards are there already, check that it
    is the plan they were written by (else resuming would mix two plans): a ``ConfigError`` if not."""
    def relative(path: Path | str) -> str:
        try:
            return Path(path).relative_to(root).as_posix()
        except ValueError:
            return str(path)

    planned = [{"shard": shard_path(out_dir, i).name, "bucket": bucket.name,
                "files": [sample_name(item, root) for item in files]}
               for i, (bucket, files) in enumerate(shards)]
    path = out_dir / PLAN
    done = any(out_dir.glob("shard-*.safetensors"))
    if path.is_file():
        try:
            before = json.loads(path.read_text())["shards"]
        except (OSError, ValueError, KeyError, TypeError):
            before = None
        if before == planned:
            return
        if done:
            changed = _difference(before, planned)
            raise ConfigError(f"out={out_dir}: the shards there were planned differently ({changed}"
                              f"): the input folder or the bucket settings changed; prepare into a new out= folder, "
                              f"or delete its shard-*.safetensors and {PLAN} to start again")
    elif done:
        raise ConfigError(f"out={out_dir} holds shards prepared without buckets (it has no {PLAN}); prepare into a "
                          f"new out= folder, or delete its shard-*.safetensors to start again")
    if rank == 0:
        counts: dict[str, int] = {}
        for bucket, files in shards:
            counts[bucket.name] = counts.get(bucket.name, 0) + len(files)
        out_dir.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as tmp:
            tmp.write_text(json.dumps({"format": PLAN_FORMAT, "input": str(root), "buckets": chooser.describe(),
                                       "samples": counts, "shards": planned,
                                       "skipped": {"unreadable": [relative(p) for p in unreadable],
                                                   "too_short": [relative(p) for p in too_short],
                                                   **({"stills": [relative(p) for p in stills]} if stills else {})}},
                                      indent=1))


def _difference(before, planned: list[dict]) -> str:
    """What changed between two plans, in a few words."""
    if not isinstance(before, list):
        return f"{PLAN} cannot be read"
    for i, (old, new) in enumerate(zip(before, planned)):
        if old == new:
            continue
        files = old.get("files") if isinstance(old, dict) else None
        bucket = old.get("bucket") if isinstance(old, dict) else None
        if isinstance(files, list) and len(files) == len(new["files"]) and bucket == new["bucket"]:
            was, now = next(((a, b) for a, b in zip(files, new["files"]) if a != b), (None, None))
            if was is not None:
                return f"shard {i} would hold {now} instead of {was}"
        return (f"shard {i} was {len(files) if isinstance(files, list) else '?'} files of {bucket}, now "
                f"{len(new['files'])} of {new['bucket']}")
    return f"{len(before)} shards then, {len(planned)} now"
