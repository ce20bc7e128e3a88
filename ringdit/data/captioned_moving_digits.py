"""Captioned moving digits: a text-to-video set that needs no download, for CPU demos of the Wan path.

Video i shows one scikit-learn digit gliding in a straight line across a small canvas; its caption says which digit
and which way: ``"a 3 moving left"`` (4 directions x 10 digits = 40 captions). The captions are encoded by a text
encoder that is also built here, with no download: a word-level tokenizer over the captions' words and a small UMT5
encoder with seeded random weights (deterministic embeddings, distinct per word). Both are saved (transformers'
``save_pretrained``) beside the data, and the shard records them, so ``infer.py prompts='[a 7 moving up]'`` encodes
new prompts exactly as the training captions were encoded.

The videos stay in pixel space (1 channel in [-1, 1], no VAE): the set is written once to ``cache_dir`` as a
``data=text_latents`` shard and read through the same code as prepared data.

    python train.py experiment=captioned_moving_digits
    python infer.py 'prompts=["a 3 moving left", "a 7 moving down"]'
    python benchmarks/digits_accuracy.py outputs/infer/runs/<run>/samples.npz   # digit and direction recognised
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ringdit.data.moving_digits import GLYPH, MovingDigits
from ringdit.data.text_latents import TextLatentsDataModule, write_text_latents
from ringdit.common.errors import ConfigError, require_count
from ringdit.media.text import TextEncoder, word_level_tokenizer

# (row, column) change per frame of each direction's unit step
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
SPECIAL = ("<pad>", "</s>", "<unk>")  # T5's pad / end-of-sequence / unknown tokens, ids 0, 1, 2
WORDS = (*SPECIAL, "a", "moving", *(str(d) for d in range(10)), *DIRECTIONS)
CAPTION = re.compile(r"^a (\d) moving (" + "|".join(DIRECTIONS) + r")$")


def caption(digit: int, direction: str) -> str:
    return f"a {digit} moving {direction}"


def parse_caption(text: str) -> tuple[int, str] | None:
    """(digit, direction) of a caption of this set, None for other text."""
    match = CAPTION.match(str(text).strip())
    return (int(match[1]), match[2]) if match else None


class CaptionedMovingDigits(MovingDigits):
    """Videos ``(1, frames, canvas, canvas)`` in [-1, 1]: the digit moves ``step`` pixels a frame along one axis,
    starting where the whole path fits on the canvas (no bounce, so the caption's direction holds in every frame)."""

    def __init__(self, num_videos: int, frames: int = 8, canvas: int = 16, seed: int = 0):
        super().__init__(num_videos, frames, canvas, digit_scale=1, seed=seed)
        room = canvas - GLYPH
        self.step = max(1, room // max(1, frames - 1))  # pixels per frame: cross most of the canvas
        self.travel = self.step * (frames - 1)
        if self.travel > room:
            raise ConfigError(f"data.canvas={canvas} leaves {room} pixels to move in but {frames} frames need "
                             f"{frames - 1}; use data.canvas >= {GLYPH + frames - 1} or fewer data.frames")

    def motion(self, index: int) -> tuple[int, int, np.ndarray]:
        digit, glyph, direction, corners = self.described_motion(index)
        return digit, glyph, corners

    def described_motion(self, index: int) -> tuple[int, int, str, np.ndarray]:
        """(digit, glyph index, direction, top-left corners (frames, 2) as (row, col)) of video ``index``."""
        if not 0 <= index < self.num_videos:
            raise IndexError(f"video {index} out of range for {self.num_videos} videos")
        rng = np.random.default_rng([self.seed, index])
        digit = int(rng.integers(10))
        glyph = int(rng.choice(self.glyphs_of[digit]))
        direction = list(DIRECTIONS)[int(rng.integers(len(DIRECTIONS)))]
        room = self.canvas - GLYPH
        across = int(rng.integers(room + 1))  # the fixed coordinate
        start = int(rng.integers(room - self.travel + 1))  # where the path begins along the moving axis
        delta = np.array(DIRECTIONS[direction])
        moving = int(np.flatnonzero(delta)[0])
        along = start + self.step * np.arange(self.frames)  # (T,) increasing
        if delta[moving] < 0:
            along = along[::-1]
        corners = np.full((self.frames, 2), across, dtype=np.int64)
        corners[:, moving] = along
        return digit, glyph, direction, corners

    def caption(self, index: int) -> str:
        digit, _, direction, _ = self.described_motion(index)
        return caption(digit, direction)


def build_caption_encoder(folder: Path, text_dim: int, seed: int) -> None:
    """Save a word-level tokenizer over ``WORDS`` (``folder/tokenizer``) and a 1-layer UMT5 encoder with seeded random
    weights (``folder/text_encoder``), as a pipeline repo holds them."""
    from transformers import UMT5Config, UMT5EncoderModel

    word_level_tokenizer(WORDS).save_pretrained(folder / "tokenizer")
    heads = 2 if text_dim % 2 == 0 else 1
    config = UMT5Config(vocab_size=len(WORDS), d_model=text_dim, d_kv=text_dim // heads, d_ff=2 * text_dim,
                        num_layers=1, num_heads=heads, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    with torch.random.fork_rng(devices=[]):  # seeded weights without touching the caller's random state
        torch.manual_seed(seed)
        UMT5EncoderModel(config).save_pretrained(folder / "text_encoder")


def write_captioned_moving_digits(folder: Path, final: Path, *, num_videos: int, frames: int, canvas: int,
                                  text_len: int, text_dim: int, seed: int, image: bool = False) -> Path:
    """The text encoder and one shard ``videos.safetensors`` in ``folder``, which will be renamed ``final`` (the
    folder the shard's ``text_encoder`` metadata names); returns the shard's path. ``image``: with the first frames
    as image-to-video conditioning (``image_latents``; ``image_condition``: [first frame ; zero frames]), pixels as
    the videos are."""
    build_caption_encoder(folder, text_dim, seed)
    encoder = TextEncoder(folder / "text_encoder", folder / "tokenizer", max_len=text_len)
    videos = CaptionedMovingDigits(num_videos, frames, canvas, seed)
    captions = [videos.caption(i) for i in range(num_videos)]
    distinct = sorted(set(captions))
    encoded = encoder(distinct)  # 40 prompts at most: encode each once
    rows = torch.tensor([distinct.index(c) for c in captions])
    pixels = torch.stack([videos[i][0] for i in range(num_videos)])  # (N, 1, T, H, W)
    first = pixels[:, :, :1]  # (N, 1, 1, H, W): the given first frame
    conditioning = {"image_latents": first,
                    "image_condition": torch.cat([first, torch.zeros_like(pixels[:, :, 1:])], dim=2)}
    return write_text_latents(
        folder / "videos.safetensors", pixels, encoded["text"][rows], encoded["text_mask"][rows], null=encoder([""]),
        captions=captions, image=conditioning if image else None,
        metadata={"text_encoder": json.dumps({**encoder.describe(), "path": str(final.resolve() / "text_encoder"),
                                              "tokenizer": str(final.resolve() / "tokenizer")})})


STALE_BUILD_SECONDS = 3600  # a temporary folder this old was left by a build that was killed


def build_once(folder: Path, build) -> None:
    """Run ``build(partial)`` in a temporary folder of this process's own and rename it ``folder``: an interrupted
    build never looks finished, and two processes building the same seeded set at once (two runs, two test workers)
    neither write into one folder nor delete the one the other finished -- the second rename loses and its copy
    is dropped. Temporary folders left by killed builds are removed once they are an hour old."""
    def refuse_foreign():
        if folder.is_dir() and any(folder.iterdir()) and not (folder / "videos.safetensors").is_file():
            raise ConfigError(f"data.cache_dir: {folder} exists without its videos.safetensors; remove it and "
                              f"run again")

    refuse_foreign()  # before minutes of building
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in folder.parent.glob(f".{folder.name}.*.tmp"):
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > STALE_BUILD_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        build(partial)
        with contextlib.suppress(OSError):  # an empty folder in the way holds nothing (rmdir refuses a full one)
            folder.rmdir()
        try:
            partial.rename(folder)
        except OSError:  # the folder exists: another process finished first (the same seeded set), or it is foreign
            refuse_foreign()
            if not (folder / "videos.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


class CaptionedMovingDigitsDataModule(TextLatentsDataModule):
    """``data=captioned_moving_digits``: written once to ``cache_dir`` (per settings), then read as text_latents.
    Pixels, not latents: samples come out as videos (no VAE). ``image``: each video's first frame is stored as
    image-to-video conditioning too (experiment=captioned_moving_digits_i2v)."""

    def __init__(self, cache_dir: str, num_videos: int = 4096, frames: int = 8, canvas: int = 16, text_len: int = 8,
                 text_dim: int = 32, batch_size: int = 32, num_workers: int = 0, val_fraction: float = 0.05,
                 val_batches: int = 4, seed: int = 0, image: bool = False):
        settings = dict(num_videos=num_videos, frames=frames, canvas=canvas, text_len=text_len, text_dim=text_dim)
        for key, value in settings.items():
            require_count(f"data.{key}", value)
        settings.update({"image": True} if image else {})  # image-to-video: the first frames too (a set of its own)
        if text_len < 6:  # "a 3 moving left" and its end token
            raise ConfigError(f"data.text_len={text_len} cuts the captions (5 tokens with the end token); use >= 6")
        CaptionedMovingDigits(1, frames, canvas)  # checks that the canvas fits the motion before anything is written
        name = "captioned_moving_digits-" + "-".join(f"{k}{v}" for k, v in {**settings, "seed": seed}.items())
        folder = Path(cache_dir).expanduser() / name
        shard = folder / "videos.safetensors"
        if not shard.is_file():
            build_once(folder, lambda partial: write_captioned_moving_digits(partial, folder, seed=seed, **settings))
        super().__init__(str(shard), batch_size, num_workers, val_fraction, val_batches, seed)

    def describe(self) -> dict:
        info = super().describe()
        del info["latent_scale"]  # pixels in [-1, 1]: samples become videos directly
        return info
