"""``encode_folder``'s work on one rank: the settings checked, the files listed, placed and planned into shards, and
this rank's shards encoded and written (finished ones skipped, their text re-encoded when it is stale). The module
docstring of ``ringdit.media.encode_folder`` says what the shards hold."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ringdit.commands.preemption import sigterm_waits
from ringdit.data.text_latent_shards import MASK_KEY, TEXT_KEYS, save_tensors
from ringdit.media.audio_latents import AudioLatentEncoder, audio_vae_class, audio_vae_folder, check_audio_tracks
from ringdit.common.dtypes import dtype_named
from ringdit.common.errors import ConfigError, require_count
from ringdit.media.buckets import Bucket, make_buckets, parse_buckets
from ringdit.media.control_pixels import find_controls, find_references, reference_image
from ringdit.media.clip_placement import bucket_size, clip_windows, place_files, plan_shards
from ringdit.media.encode_report import EncodeReport
from ringdit.media.folder import MediaItem, list_media
from ringdit.media.frames import TooShort, read_frames, read_image, to_image
from ringdit.media.image_condition import ImageEncoder, first_frame_condition
from ringdit.media.masks import find_masks, latent_mask
from ringdit.media.minimax_audio import AUDIO_VAE_CLASS as MINIMAX_AUDIO_VAE, MiniMaxAudioEncoder
from ringdit.media.prepare_ranks import TileGroup, default_device
from ringdit.media.retext import rewrite_text, sample_name, stale_captions, write_text
from ringdit.media.shard_plan import PLAN, check_plan, check_resumed_task, shard_path
from ringdit.media.text import TextEncoder
from ringdit.media.vae import VAE
from ringdit.media.windows import extraction, pipeline_fps, timeline
from ringdit.models.conditioning import AUDIO_KEY, CONTROL_KEY, REFERENCE_KEY, SAMPLE_KEYS
from ringdit.models.diffusers.wan_vace import control_condition

log = logging.getLogger("ringdit.prepare")


@dataclass(frozen=True)
class FolderSettings:
    """``encode_folder``'s settings as one record, its work's input (``encode_folder``'s signature holds their defaults;
    the module docstring of ``ringdit.media.encode_folder`` says what each does)."""

    input: str
    out: str
    vae: str
    text_encoder: str
    tokenizer: str | None
    vae_subfolder: str | None
    caption_column: str
    size: int | str | list[int]  # an int, [H, W] or "HxW"
    frames: int
    frame_stride: int
    buckets: str | list | None  # null, "auto" or a list of [H, W]
    bucket_step: int | None
    frame_buckets: int | list[int] | None
    max_text_len: int
    shard_size: int
    batch_size: int
    device: str | None  # encode_folder resolves it before making the record
    dtype: str
    text_dtype: str | None
    tiling: bool
    tile: int | None
    parallel_vae: bool
    task: str
    image_encoder: str | None
    image_processor: str | None
    pooled_encoder: str | None
    pooled_tokenizer: str | None
    max_pooled_len: int
    masked_text: bool | None
    prompt_template: str | None
    glyph_encoder: str | None
    glyph_tokenizer: str | None
    mask_path: str | None
    control: str | None  # a folder of control videos, one per clip (Wan VACE's control latents)
    reference: str | None  # a folder of reference images, one per image (Qwen-Image-Edit's reference latents)
    audio_vae: str | None  # LTX-2's audio VAE (a pipeline folder with audio_vae/, or its own): each clip's sound
    audio_vae_subfolder: str | None
    frame_extraction: str
    window_stride: int | None
    frame_sample: int | None
    source_fps: float | str | None  # the clips' frame rate, e.g. 30 or "29.97"
    fps: int | None
    rank: int | None  # resolved too (torchrun's RANK, a caller's process group)
    world_size: int | None
    progress: bool


def encode_shards(settings: FolderSettings, tiles: TileGroup | None) -> EncodeReport:
    """``encode_folder``'s work with its ``settings``, given its ``TileGroup`` (parallel_vae=true on several ranks,
    else None)."""
    device, bucket_step = settings.device, settings.bucket_step  # these four may change below
    rank, world_size = settings.rank, settings.world_size
    from tqdm.auto import tqdm

    for name, value in (("frames", settings.frames), ("frame_stride", settings.frame_stride),
                        ("shard_size", settings.shard_size), ("batch_size", settings.batch_size)):
        require_count(name, value)
    store = dtype_named("dtype", settings.dtype)
    text_store = (store if settings.text_dtype is None  # the text encoder's
                  else dtype_named("text_dtype", settings.text_dtype))
    if not isinstance(settings.tiling, bool):
        raise ConfigError(f"tiling must be true or false, got {settings.tiling!r}")
    require_count("tile", settings.tile, optional=True, hint="the VAE's spatial tile size in pixels, e.g. tile=256")
    bucketed = parse_buckets(settings.buckets) is not None  # its form checked before any model is loaded
    windows = extraction(settings.frame_extraction, settings.window_stride, settings.frame_sample,
                         bucketed)  # which frames: before any work
    clock = timeline(settings.frame_stride, settings.source_fps, settings.fps,
                     pipeline_fps(settings.vae, settings.vae_subfolder) if settings.fps is None and
                     settings.source_fps is not None else None, settings.vae)
    if not bucketed and settings.frame_buckets is not None:
        raise ConfigError(f"frame_buckets={settings.frame_buckets!r} needs buckets=auto or a list of [H, W] (with "
                          f"buckets=null every clip is cut to frames={settings.frames}); pass buckets=auto, or drop "
                          f"frame_buckets")
    if bucket_step is not None and parse_buckets(settings.buckets) != "auto":
        raise ConfigError(f"bucket_step={bucket_step!r} is the size step of buckets=auto, but buckets="
                          f"{'null' if settings.buckets is None else repr(settings.buckets)}; pass buckets=auto, or "
                          f"drop bucket_step")
    out_dir = Path(str(settings.out)).expanduser()
    if not bucketed and (out_dir / PLAN).is_file() and any(out_dir.glob("shard-*.safetensors")):
        raise ConfigError(f"out={settings.out} holds shards prepared with buckets ({PLAN}); pass the buckets= setting "
                          f"they were made with to resume, or prepare into a new out= folder")
    # no resume that mixes shards' keys
    check_resumed_task(out_dir, settings.task, settings.mask_path is not None, bool(settings.control))
    missing: list[str] = []  # the metadata's rows without their file: named in the summary (by rank 0: all see them)
    items = list_media(settings.input, settings.caption_column, missing=missing)
    masks = (find_masks(settings.mask_path, items)  # headers only: before any model loads
             if settings.mask_path is not None else None)
    if masks is not None and len(masks) < len(items):
        log.warning("mask_path=%s: %d of %d files have no mask (first: %s); they train everywhere", settings.mask_path,
                    len(items) - len(masks), len(items), next(i.path.name for i in items if i.path not in masks))
    controls = find_controls(settings.control, items) if settings.control else None  # headers only, as the masks
    references = find_references(settings.reference, items) if settings.reference else None  # headers only too
    videos = [item for item in items if item.is_video]
    if settings.audio_vae:  # headers only, before any model loads: every file has sound, the clips one frame rate
        audio_vae_folder(settings.audio_vae, settings.audio_vae_subfolder)
        check_audio_tracks(list(dict.fromkeys(item.path for item in items)), settings.audio_vae, settings.source_fps)
    if videos and len(videos) < len(items) and not bucketed:
        image = next(item for item in items if not item.is_video)
        raise ConfigError(f"input={settings.input} mixes videos ({videos[0].path.name}) and images "
                          f"({image.path.name}); with buckets=null a prepared set has one shape, so pass buckets=auto "
                          f"(images become one-frame buckets) or prepare them into separate out= folders")
    if settings.task == "i2v" and not videos:
        raise ConfigError(f"task=i2v conditions each clip on its first frame, but input={settings.input} holds no "
                          f"videos{' (only images)' if items else ''}; pass a folder of clips, or task=t2v")
    if settings.task == "i2v" and not bucketed and settings.frames == 1:
        raise ConfigError("task=i2v with frames=1: a 1-frame clip is its own first frame, with nothing to generate; "
                          "pass frames=1 + k * the VAE's temporal factor (e.g. frames=17), or task=t2v")
    device = device or default_device()
    codec = VAE(settings.vae, settings.vae_subfolder, device=device, dtype=store, tiling=settings.tiling,
                tile=settings.tile)
    encode = codec.encode
    if tiles is not None:
        tiles.check(codec, settings.vae)
        if rank != 0:  # a helper: its share of every batch's tiles, until rank 0 is done
            return tiles.serve(codec)
        encode = tiles.leader(codec)  # the pixels to the helpers, then the tile-parallel encode
        rank, world_size = 0, 1  # from here rank 0 prepares every shard, as one process would
    if videos and not codec.is_video:
        raise ConfigError(f"vae={settings.vae} is an image VAE ({codec.class_name}) but input={settings.input} holds "
                          f"videos (first: {videos[0].path.name}); pass a video VAE folder (AutoencoderKLWan)")
    if videos:
        codec.check_frames(settings.frames)
    report = EncodeReport(missing=missing if rank == 0 else [])
    if bucketed:
        if bucket_step is None and codec.patch > 1:  # Flux.2: one token's 16 px (as 2 x 8 px for Flux's 2x2 packing)
            bucket_step = codec.size_step
        chooser = make_buckets(settings.buckets, settings.size, spatial=codec.size_step,
                               temporal=codec.temporal if codec.is_video else None, frames=settings.frames,
                               frame_stride=settings.frame_stride, frame_buckets=settings.frame_buckets,
                               bucket_step=bucket_step, class_name=codec.class_name)
        placed, unreadable, too_short = place_files(items, chooser, progress=settings.progress, clock=clock,
                                                    windows=windows)
        stills = []
        if settings.task == "i2v":  # an image (or a 1-frame clip) has no video to condition on its first frame: out
            stills = [str(item.path) for item, bucket in placed if bucket.frames == 1]
            placed = [(item, bucket) for item, bucket in placed if bucket.frames != 1]
            if stills and not placed:  # nothing would be prepared: say why instead of "prepared 0 samples"
                raise ConfigError(f"task=i2v: every file of input={settings.input} falls in a 1-frame bucket (buckets="
                                  f"{settings.buckets}, frames={settings.frames}), and a 1-frame clip is its own "
                                  f"first frame, with nothing to generate; give frame buckets of 1 + k * "
                                  f"{codec.temporal} frames (e.g. frames={1 + codec.temporal * 4}), or task=t2v")
            if stills:
                log.warning("task=i2v: leaving out %d images or 1-frame clips (first: %s); image-to-video trains on "
                            "clips", len(stills), Path(stills[0]).name)
        if rank == 0:  # every rank probes every file; rank 0 reports the files left out, so totals add up
            report.unreadable += unreadable
            report.too_short += too_short
            report.stills += stills
        shards = plan_shards(placed, settings.shard_size)
        check_plan(out_dir, Path(str(settings.input)).expanduser(), shards, rank, unreadable, too_short, chooser,
                   stills)
    else:
        height, width = bucket_size(settings.size, codec.size_step, "the VAE's downsampling factor" if codec.patch == 1
                                    else f"{codec.class_name}'s {codec.spatial}x downsampling x its {codec.patch}x"
                                         f"{codec.patch} latent patches,")
        bucket = Bucket(height, width, settings.frames if videos else None)
        if videos and (windows.mode != "head" or clock.source_fps is not None):  # the windows need each length
            items, unreadable, too_short = clip_windows(items, settings.frames, clock, windows,
                                                        progress=settings.progress)
            if rank == 0:
                report.unreadable += unreadable
                report.too_short += too_short
        shards = [(bucket, items[start:start + settings.shard_size])
                  for start in range(0, len(items), settings.shard_size)]
    encoder = TextEncoder(settings.text_encoder, settings.tokenizer, max_len=settings.max_text_len, device=device,
                          dtype=text_store, pooled_encoder=settings.pooled_encoder,
                          pooled_tokenizer=settings.pooled_tokenizer, max_pooled_len=settings.max_pooled_len,
                          masked=settings.masked_text, prompt_template=settings.prompt_template,
                          glyph_encoder=settings.glyph_encoder, glyph_tokenizer=settings.glyph_tokenizer)
    sound = audio_encoder(settings, device, store) if settings.audio_vae else None
    clip = (ImageEncoder(settings.image_encoder, settings.image_processor, device=device, dtype=store)
            if settings.image_encoder else None)

    out_dir.mkdir(parents=True, exist_ok=True)
    mine = range(rank, len(shards), world_size)
    pending = [i for i in mine if not shard_path(out_dir, i).exists()]
    # the empty prompt: (L, D), (L,)[, (P,), ...]; an edit pipeline's template: its text alone (one null cannot hold
    # the empty prompt with each reference image, as the pipeline encodes its negative prompt)
    null = {key: value[0] for key, value in encoder.without_images([""]).items()}
    described = {"vae": json.dumps(codec.describe()),  # the text's dtype too: another re-encodes only the text
                 "text_encoder": json.dumps({**encoder.describe(), "dtype": str(text_store).removeprefix("torch.")})}
    root = Path(str(settings.input)).expanduser()
    for index in (i for i in mine if i not in pending):  # finished: new captions or text encoder re-encode the text
        path = shard_path(out_dir, index)
        captions = stale_captions(path, shards[index][1], root, described["text_encoder"],
                                  {**clock.describe(), **windows.describe()})
        if captions is None:
            report.shards_skipped += 1
            continue
        if encoder.edit is not None:  # its captions changed: each would be encoded again with its reference image
            raise ConfigError(f"out={settings.out}: the captions of {path.name} changed, but prompt_template="
                              f"{settings.prompt_template} encodes each with its reference image, which re-encoding "
                              f"only the text does not read; prepare into a new out= folder")
        with sigterm_waits():
            rewrite_text(path, captions, encoder, null, described["text_encoder"], text_store, settings.batch_size)
        report.texts_encoded += 1
    if settings.task == "i2v":
        described["task"] = "i2v"  # what a resumed run checks (check_resumed_task); no key: t2v, as before
    if sound is not None:
        described["audio_vae"] = json.dumps(sound.describe())  # what training checks the model's audio against
    if clip is not None:
        described["image_encoder"] = json.dumps(clip.describe())
    start = time.perf_counter()
    bar = tqdm(total=sum(len(shards[i][1]) for i in pending), unit="file", disable=not settings.progress,
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
            log.warning("skipping a clip too short for frames=%d frame_stride=%d: %s", bucket.frames,
                        settings.frame_stride, error)
        except Exception as error:  # noqa: BLE001 - any decoder failure means this one file is unusable
            report.unreadable.append(str(item.path))
            log.warning("skipping unreadable %s (%s: %s)", item.path, type(error).__name__, error)
        return None

    for index in pending:
        bucket, files = shards[index]
        rows: dict[str, list[torch.Tensor]] = {}
        captions: list[str] = []
        names: list[str] = []  # each sample's file (and window): what a re-run matches new captions to
        for batch_start in range(0, len(files), settings.batch_size):
            batch = files[batch_start:batch_start + settings.batch_size]
            loaded = [(item, load(item, bucket)) for item in batch]
            loaded = [(item, pixels) for item, pixels in loaded if pixels is not None]
            if masks is not None:  # each clip's mask read as the clip (an unreadable one skips its clip, counted)
                read = [(item, pixels, load(dataclasses.replace(item, path=masks[item.path]), bucket)
                         if item.path in masks else torch.ones_like(pixels)) for item, pixels in loaded]
                loaded = [(item, pixels) for item, pixels, mask in read if mask is not None]
                mask_pixels = [mask for _, _, mask in read if mask is not None]
            if controls is not None:  # each clip's control clip read as the clip (an unreadable one skips its clip)
                read = [(item, pixels, load(dataclasses.replace(item, path=controls[item.path]), bucket))
                        for item, pixels in loaded]
                loaded = [(item, pixels) for item, pixels, control in read if control is not None]
                control_pixels = [control for _, _, control in read if control is not None]
                if masks is not None:  # the masks of the clips kept (aligned with read)
                    mask_pixels = [mask for mask, (_, _, control) in zip(mask_pixels, read) if control is not None]
            if references is not None:  # each image's reference read at its size (an unreadable one skips its image)
                read = [(item, pixels, load(dataclasses.replace(item, path=references[item.path]), bucket))
                        for item, pixels in loaded]
                loaded = [(item, pixels) for item, pixels, reference in read if reference is not None]
                reference_pixels = [reference for _, _, reference in read if reference is not None]
                if masks is not None:
                    mask_pixels = [mask for mask, (_, _, ref) in zip(mask_pixels, read) if ref is not None]
            bar.update(len(batch))
            if not loaded:
                continue
            pixels = torch.stack([pixels for _, pixels in loaded])  # (B, 3, [T,] H, W)
            latents = encode(pixels)  # (B, C, [T',] H', W')
            cond = encoder([item.caption for item, _ in loaded],  # an edit template: each with its reference image
                           [reference_image(references[item.path]) for item, _ in loaded] if encoder.edit else None)
            if masks is not None:
                cond[MASK_KEY] = torch.stack([latent_mask(mask, tuple(latents.shape[2:]), codec.temporal)
                                              for mask in mask_pixels])
            if controls is not None:  # as WanVACEPipeline encodes its video: [inactive ; reactive ; packed mask]
                cond[CONTROL_KEY] = control_condition(encode, torch.stack(control_pixels), codec.spatial,
                                                      codec.temporal)
            if references is not None:  # the reference image's latents, as the edit pipelines encode it
                cond[REFERENCE_KEY] = encode(torch.stack(reference_pixels))  # (B, C, H', W'): the latents' grid
            if sound is not None:  # each window's sound over its frames' time (ringdit/media/audio_latents.py)
                cond[AUDIO_KEY] = torch.stack([
                    sound.encode_clip(item.path, clock.source_index(item.start), bucket.frames * clock.step,
                                      clock.source_fps) for item, _ in loaded])  # LTX-2 (B, C_a, L, M);
                #                                                        MiniMax-H3 (B, 2, L, C_a)
            if settings.task == "i2v":  # the first frame's conditioning, its encodes by the same VAE path as the clips'
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
            "frame_stride": settings.frame_stride if clips else None, "source": str(settings.input),
            **({**clock.describe(), **windows.describe(), "starts": [int(n.rpartition("@")[2]) if "@" in n else 0
                                                                     for n in names]}
               if clips and (windows.mode != "head" or clock.source_fps is not None) else {})})}
        latents = {"latents": tensors["latents"].to(store),
                   **{key: tensors[key].to(store) for key in SAMPLE_KEYS if key in tensors},
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


def audio_encoder(settings: FolderSettings, device, dtype: torch.dtype):
    """The encoder of ``audio_vae=``'s class: LTX-2's (log-mel, ringdit.media.audio_latents) or MiniMax-H3's
    (waveform, ringdit.media.minimax_audio)."""
    folder = audio_vae_folder(settings.audio_vae, settings.audio_vae_subfolder)
    if audio_vae_class(folder) == MINIMAX_AUDIO_VAE:
        return MiniMaxAudioEncoder(folder, device=device, dtype=dtype)
    return AudioLatentEncoder(settings.audio_vae, settings.audio_vae_subfolder, device=device, dtype=dtype)
