"""Choosing each file's bucket for ``python -m ringdit.prepare buckets=...``: the (H, W[, T]) it is encoded at.

The candidate sizes (``buckets``):
    null     one bucket, ``size`` x ``frames`` (every file cropped to it; encode_folder does not call this)
    auto     the musubi-tuner / kohya rule: the largest square, and for each width w = step, 2 * step, ... the
             largest height h, a multiple of ``step``, with h * w <= the size's area (``size ** 2``, or
             H * W for ``[H, W]``), kept when the aspect ratio is within 1:4 .. 4:1; ``step`` (``bucket_step``)
             defaults to twice the VAE's downsampling (16 px for the Wan / Flux VAEs: whole 2 x 2 latent patches)
    a list   of ``[H, W]`` pixel sizes (or ``"HxW"``), each a multiple of the VAE's downsampling; those of area
             above the size's are left out (with a warning)
A file goes to the size of nearest aspect ratio (the smallest |log(h / w) - log(H / W)|); of equally near sizes
(only a list can have several), the largest the file covers without upscaling, else the smallest. It is then
scaled to cover the size and centre-cropped (``frames.fit``).

Frames (with a video VAE, which takes 1 + k * temporal frames): an image is one frame (T = 1); a clip gets the
longest allowed count not above its usable length at ``frame_stride`` (``(n - 1) // stride + 1`` of its n frames):
``frame_buckets`` lists the allowed counts, default every 1 + k * temporal (k >= 1) up to ``frames`` (5, 9, ..., 81
for Wan with frames=81). A clip shorter than the smallest count is skipped as too short; put 1 in
``frame_buckets`` to keep such a clip as its first frame instead. With an image VAE there is no T.

This module only decides (no file is opened here): ``make_buckets`` checks the settings, ``Buckets.choose`` places
one file from its probed size and length.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ringdit.common.errors import ConfigError

log = logging.getLogger("ringdit.prepare")

MAX_RATIO = 4.0  # auto: aspect ratios from 1:4 to 4:1


@dataclass(frozen=True)
class Bucket:
    """One shape of a prepared set: pixels (H, W), and T frames with a video VAE (None with an image VAE)."""
    height: int
    width: int
    frames: int | None = None

    @property
    def name(self) -> str:
        """``480x832x81`` (H x W x T), or ``512x512`` without T."""
        return f"{self.height}x{self.width}" + ("" if self.frames is None else f"x{self.frames}")

    def order(self) -> tuple[int, int, int]:
        """The fixed order of the buckets' shards: by frames, then height, then width."""
        return (self.frames or 0, self.height, self.width)


def size_pair(size) -> tuple[int, int]:
    """``size`` (an int, ``[H, W]`` or ``"HxW"``) -> (H, W), both positive integers."""
    value = size
    if isinstance(value, str) and "x" in value:
        value = value.split("x")
    sizes = list(value) if isinstance(value, (list, tuple)) else [value, value]
    try:
        if len(sizes) != 2 or any(isinstance(s, (bool, float)) for s in sizes):
            raise ValueError
        height, width = (int(s) for s in sizes)
    except (TypeError, ValueError):
        raise ConfigError(f"size must be an int, [H, W] or 'HxW', got {size!r}") from None
    if height < 1 or width < 1:
        raise ConfigError(f"size={size!r}: height and width must be positive, e.g. size=256")
    if max(height, width) > MAX_SIDE:  # auto buckets would enumerate every size up to it; a frame would not fit
        raise ConfigError(f"size={size!r}: {max(height, width)} pixels on a side is more than "
                          f"{MAX_SIDE}; give [H, W], e.g. size=[480,832]")
    return height, width


MAX_SIDE = 16384  # pixels on a side: 8K video is 7680; beyond this a size is a typo


BUCKETS_HINT = ("pass buckets=null (one bucket at size), buckets=auto, or a list of [H, W] pixel sizes, e.g. "
                "buckets=[[480,832],[832,480],[624,624]]")


def parse_buckets(buckets) -> str | list[tuple[int, int]] | None:
    """The ``buckets`` setting's form: None, ``"auto"`` or a list of (H, W); anything else is a ``ConfigError``.
    (Whether the sizes suit the VAE is ``make_buckets``' check.)"""
    if buckets is None:
        return None
    if isinstance(buckets, str) and buckets.strip().lower() == "auto":
        return "auto"
    if not isinstance(buckets, (list, tuple)) or not buckets:
        raise ConfigError(f"buckets={buckets!r} is not null, auto or a list of [H, W]; {BUCKETS_HINT}")
    sizes = []
    for entry in buckets:
        pair = entry.split("x") if isinstance(entry, str) else entry
        try:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2 or \
                    any(isinstance(s, (bool, float)) for s in pair):
                raise ValueError
            height, width = (int(s) for s in pair)
            if height < 1 or width < 1:
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f"buckets: the entry {entry!r} is not an [H, W] pair of positive pixel sizes; "
                              f"{BUCKETS_HINT}") from None
        if (height, width) not in sizes:
            sizes.append((height, width))
    return sizes


def auto_sizes(area: int, step: int, max_ratio: float = MAX_RATIO) -> list[tuple[int, int]]:
    """(H, W) multiples of ``step`` with H * W <= ``area``: the largest square, and for each width the largest height
    that fits and its mirror image (portrait and landscape alike), kept when 1 / max_ratio <= W / H <= max_ratio
    (musubi-tuner / kohya); sorted by height, then width."""
    side = math.isqrt(area) // step * step
    sizes = {(side, side)} if side else set()
    width = step
    while width * step <= area:
        height = area // width // step * step
        if height >= step and 1 / max_ratio <= width / height <= max_ratio:
            sizes |= {(height, width), (width, height)}
        width += step
    return sorted(sizes)


def _log_distance(height: int, width: int, size: tuple[int, int]) -> float:
    return round(abs(math.log(height / width) - math.log(size[0] / size[1])), 9)  # rounded: equal ratios tie


def nearest_size(height: int, width: int, sizes: list[tuple[int, int]]) -> tuple[int, int]:
    """The size of nearest aspect ratio to a ``height`` x ``width`` file; of equally near ones the largest it covers
    (no upscaling), else the smallest (the least upscaling); then by (H, W), so the choice is deterministic."""
    def key(size):
        covered = size[0] <= height and size[1] <= width
        area = size[0] * size[1]
        return (_log_distance(height, width, size), not covered, -area if covered else area, size)

    return min(sizes, key=key)


def frame_count(available: int, counts: list[int]) -> int | None:
    """The longest of ``counts`` not above ``available`` frames; None when the clip is shorter than all."""
    fitting = [count for count in counts if count <= available]
    return max(fitting) if fitting else None


def usable_frames(total: int, stride: int) -> int:
    """How many frames 0, stride, 2 * stride, ... a clip of ``total`` frames has."""
    return (total - 1) // stride + 1 if total > 0 else 0


@dataclass(frozen=True)
class Buckets:
    """The sizes and (video VAE) frame counts a prepared set may have, and the rule placing each file in one."""
    sizes: tuple[tuple[int, int], ...]
    frame_counts: tuple[int, ...] | None  # None: an image VAE (no T)
    frame_stride: int = 1

    def choose(self, height: int, width: int, frames: int | None = None) -> Bucket | None:
        """The bucket of a ``height`` x ``width`` image (``frames`` None) or clip of ``frames`` frames; None when
        the clip is too short for every frame count."""
        bucket_h, bucket_w = nearest_size(height, width, list(self.sizes))
        if self.frame_counts is None:
            return Bucket(bucket_h, bucket_w)
        if frames is None:  # an image: a one-frame video
            return Bucket(bucket_h, bucket_w, 1)
        return self.place(height, width, usable_frames(frames, self.frame_stride))

    def place(self, height: int, width: int, usable: int) -> Bucket | None:
        """The bucket of a clip of ``usable`` frames as encoded (after its stride or resampling: its timeline,
        ringdit/media/windows.py); None when it is too short for every frame count."""
        bucket_h, bucket_w = nearest_size(height, width, list(self.sizes))
        count = frame_count(usable, list(self.frame_counts))
        return None if count is None else Bucket(bucket_h, bucket_w, count)

    def describe(self) -> dict:
        return {"sizes": [list(s) for s in self.sizes], "frame_counts": None if self.frame_counts is None else
                list(self.frame_counts), "frame_stride": self.frame_stride}


def make_buckets(buckets, size, *, spatial: int, temporal: int | None, frames: int, frame_stride: int = 1,
                 frame_buckets=None, bucket_step: int | None = None, class_name: str = "the VAE") -> Buckets:
    """The settings -> ``Buckets`` (see the module docstring), every mistake a one-line ``ConfigError``.
    ``temporal`` None: an image VAE; else the video VAE's temporal factor."""
    form = parse_buckets(buckets)
    if form is None:
        raise ConfigError("buckets=null is one bucket at size / frames; make_buckets is for buckets=auto or a "
                          "list of [H, W]")
    res_h, res_w = size_pair(size)
    area = res_h * res_w
    if form == "auto":
        step = 2 * spatial if bucket_step is None else bucket_step
        if isinstance(step, bool) or not isinstance(step, int) or step < spatial or step % spatial:
            raise ConfigError(f"bucket_step={bucket_step!r}: auto buckets step by a positive multiple of the VAE's "
                              f"downsampling factor {spatial}; e.g. bucket_step={2 * spatial} (null: 2 x {spatial})")
        sizes = auto_sizes(area, step)
        if not sizes:
            raise ConfigError(f"size={size!r} ({res_h}x{res_w}) is smaller than the smallest bucket "
                              f"buckets=auto can make, {step}x{step} (bucket_step={step}); pass size>={step}")
    else:
        for height, width in form:
            if height % spatial or width % spatial:
                raise ConfigError(f"buckets: [{height}, {width}] is not a multiple of {class_name}'s downsampling "
                                  f"factor {spatial}; use e.g. [{max(spatial, round(height / spatial) * spatial)}, "
                                  f"{max(spatial, round(width / spatial) * spatial)}]")
        sizes = sorted(bucket for bucket in form if bucket[0] * bucket[1] <= area)
        if not sizes:
            smallest = min(form, key=lambda s: (s[0] * s[1], s))
            raise ConfigError(f"size={size!r} ({res_h}x{res_w} = {area} px) is smaller than the smallest "
                              f"bucket in buckets, {smallest[0]}x{smallest[1]}; every bucket's area must be at most "
                              f"the size's: pass e.g. size=[{smallest[0]},{smallest[1]}] or list smaller "
                              f"buckets")
        dropped = [f"{h}x{w}" for h, w in form if h * w > area]
        if dropped:
            log.warning("buckets: leaving out %s, larger in area than size=%s (%dx%d)", ", ".join(dropped),
                        size, res_h, res_w)
    if temporal is None:
        if frame_buckets is not None:
            log.warning("frame_buckets=%s is for videos; %s is an image VAE, so it is not used", frame_buckets,
                        class_name)
        return Buckets(tuple(sizes), None, frame_stride)
    return Buckets(tuple(sizes), tuple(allowed_frames(frames, temporal, frame_buckets, class_name)), frame_stride)


def allowed_frames(frames: int, temporal: int, frame_buckets=None, class_name: str = "the VAE") -> list[int]:
    """The frame counts a clip may be cut to: ``frame_buckets``, or every 1 + k * temporal (k >= 1) up to
    ``frames``; each 1 + k * temporal and at most ``frames``."""
    if frame_buckets is None:
        counts = list(range(1 + temporal, frames + 1, temporal))
        if not counts:
            raise ConfigError(f"frames={frames}: {class_name} clips take at least {1 + temporal} frames "
                              f"(1 + {temporal}); pass frames>={1 + temporal}, or frame_buckets=[1] to keep only "
                              f"first frames")
        return counts
    hint = f"e.g. frame_buckets=[{', '.join(str(1 + k * temporal) for k in (1, 4, 8))}]"
    if not isinstance(frame_buckets, (list, tuple)) or not frame_buckets:
        raise ConfigError(f"frame_buckets={frame_buckets!r} is not null or a list of frame counts; {hint}")
    for count in frame_buckets:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1 or (count - 1) % temporal:
            finite = isinstance(count, (int, float)) and not isinstance(count, bool) and math.isfinite(count)
            near = 1 + max(1, round((count - 1) / temporal) if finite else 1) * temporal
            raise ConfigError(f"frame_buckets: {count!r} is not a frame count {class_name} encodes (1 + k * "
                              f"{temporal}: 1, {1 + temporal}, {1 + 2 * temporal}, ...); use e.g. {near}")
        if count > frames:
            raise ConfigError(f"frame_buckets: {count} is above frames={frames}, the most frames a clip is cut to; "
                              f"pass frames={max(frame_buckets)} or leave {count} out")
    return sorted(set(frame_buckets))
