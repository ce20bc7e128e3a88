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
Resume: a shard is written to a temp file and renamed, so a shard that exists is complete and is skipped (its text file re-encoded where missing or stale); re-run
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
Sound (``audio_vae``, LTX-2's audio VAE): each clip's window of sound, resampled by PyAV to the VAE's rate, as LTX-2's
    log-mel spectrogram through ``AutoencoderKLLTX2Audio`` into ``audio`` (N, C_audio, L, mel bins), normalised and
    counted as LTX2Pipeline does (ringdit/media/audio_latents.py); the shards record the audio VAE (``audio_vae``
    metadata). A file without a sound track, or clips of several frame rates without ``source_fps``, is refused
    before any model loads.
"""

from __future__ import annotations

import dataclasses
import logging

import torch.distributed as dist

from ringdit.common.errors import ConfigError
from ringdit.media.clip_placement import bucket_size, clip_windows, place_files, plan_shards
from ringdit.media.encode_report import EncodeReport
from ringdit.media.encode_shards import FolderSettings, encode_shards
from ringdit.media.image_condition import image_encoder_folders
from ringdit.media.prepare_ranks import TileGroup, default_device, rank_and_world
from ringdit.media.shard_plan import PLAN, PLAN_FORMAT, check_plan, check_resumed_task, shard_path
from ringdit.media.text import chat_template, check_glyph_settings, check_pooled_settings
from ringdit.media.vae import usable_device

# the command's entry and its checks live here; the work is split by job (each name importable from here as before):
# clip_placement.py (probing, buckets, windows, shards), encode_shards.py (the encoding), shard_plan.py (the shards on
# disk, resume checks), prepare_ranks.py (ranks, TileGroup), encode_report.py (the report)
__all__ = ["PLAN", "PLAN_FORMAT", "TASKS", "EncodeReport", "FolderSettings", "TileGroup", "bucket_size", "check_plan",
           "check_resumed_task", "check_task", "clip_windows", "default_device", "encode_folder", "place_files",
           "plan_shards", "rank_and_world", "shard_path"]

log = logging.getLogger("ringdit.prepare")

TASKS = ("t2v", "i2v")  # text-conditioned latents; + each clip's first-frame conditioning (image-to-video)


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


def encode_folder(input: str, out: str, vae: str, text_encoder: str, tokenizer: str | None = None, *,
            vae_subfolder: str | None = "vae", caption_column: str = "text", size=256, frames: int = 17,
            frame_stride: int = 1, buckets=None, bucket_step: int | None = None, frame_buckets=None,
            max_text_len: int = 512, shard_size: int = 64, batch_size: int = 4, device: str | None = None,
            dtype: str = "float32", text_dtype: str | None = None, tiling: bool = True, tile: int | None = None,
            parallel_vae: bool = False,
            task: str = "t2v", image_encoder: str | None = None, image_processor: str | None = None,
            pooled_encoder: str | None = None, pooled_tokenizer: str | None = None, max_pooled_len: int = 77,
            masked_text: bool | None = None, prompt_template: str | None = None, glyph_encoder: str | None = None,
            glyph_tokenizer: str | None = None, mask_path: str | None = None, control: str | None = None,
            reference: str | None = None, audio_vae: str | None = None,
            audio_vae_subfolder: str | None = "audio_vae", frame_extraction: str = "head",
            window_stride: int | None = None, frame_sample: int | None = None, source_fps=None,
            fps: int | None = None, rank: int | None = None, world_size: int | None = None,
            progress: bool = True) -> EncodeReport:
    """Encode ``input`` into shards under ``out`` (see the module docstring); settings errors are ``ConfigError``."""
    settings = FolderSettings(**locals())  # every parameter, as called: the first line, before any other local
    check_task(task, image_encoder, image_processor)  # before any work, on every rank alike
    device = str(usable_device(device or default_device()))  # meta, or a GPU this machine lacks: one line
    check_pooled_settings(pooled_encoder, pooled_tokenizer, masked_text)
    template = chat_template(prompt_template)  # a name it does not know: one line, before any work
    if template is not None and template.edit_pipeline and not reference:  # captions encoded with their images
        raise ConfigError(f"prompt_template={prompt_template} encodes each caption with its reference image, as "
                          f"{template.edit_pipeline} does, but reference= is not set; pass reference=<folder "
                          f"of reference images>, or prompt_template=qwenimage for the captions alone")
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
        return encode_shards(dataclasses.replace(settings, device=device, rank=rank, world_size=world_size),
                             tiles)
