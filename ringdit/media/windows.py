"""Which frames of a clip ``python -m ringdit.prepare`` encodes: its timeline (the model's frame rate, ``frame_stride``)
and the windows cut from it (``frame_extraction``, as musubi-tuner's dataset config names them).

The timeline. Without ``source_fps`` a clip's frames are taken as they are: timeline frame t is source frame
``t * frame_stride``. With ``source_fps`` (the rate the clips were shot at) they are resampled BY TIME to the model's
frame rate ``fps`` (its family's, ``Family.fps``: Wan 16, HunyuanVideo 24, LTX-Video 25, ...): timeline frame t plays at
time ``t * frame_stride / fps`` and is the source frame shown then, the nearest one, ``floor(t * frame_stride *
source_fps / fps + 1/2)`` -- so 30 fps clips lose about every other frame and 8 fps clips show each frame twice, and a
clip keeps its duration and speed (a plain frame stride only does that for whole ratios). Computed in exact fractions
(``source_fps`` as written, e.g. 29.97), so no rounding drifts along a long clip.

The windows, each ``T`` timeline frames (T: ``frames`` with buckets=null; with buckets the clip's bucket's count, the
longest allowed one the clip has), of a clip of ``n`` timeline frames:
    head     one window, from the start (the default; what prepare always did)
    chunk    back-to-back windows: starts 0, T, 2T, ... while a whole window fits (n // T windows)
    slide    starts 0, s, 2s, ... (s = ``window_stride``) while a whole window fits
    uniform  ``frame_sample`` windows spread evenly, first at the start and last at the end: starts
             ``linspace(0, n - T, frame_sample)`` rounded down (the same start twice where the clip is short)
    full     the whole clip, trimmed to the longest allowed count (1 + k * the VAE's temporal factor, at most
             ``frames``): needs buckets, since with buckets=null every clip is ``frames`` long (use head there)
Each window is one sample of the prepared set, with the clip's caption.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from ringdit.common.errors import ConfigError
from ringdit.common.safe_json import read_json
from ringdit.models.diffusers.families import families_of_class

EXTRACTIONS = ("head", "chunk", "slide", "uniform", "full")


@dataclass(frozen=True)
class Timeline:
    """Timeline frame -> source frame: the frame stride after resampling ``source_fps`` -> ``fps`` (both None: no
    resampling)."""

    stride: int = 1
    source_fps: Fraction | None = None
    fps: int | None = None

    @property
    def step(self) -> Fraction:
        """Source frames per timeline frame."""
        rate = Fraction(1) if self.source_fps is None else self.source_fps / self.fps
        return rate * self.stride

    def source_index(self, t: int) -> int:
        """The source frame timeline frame ``t`` shows: the nearest in time (halves round up)."""
        return math.floor(t * self.step + Fraction(1, 2))

    def length(self, source_frames: int) -> int:
        """How many timeline frames a clip of ``source_frames`` frames has: every t whose source frame exists."""
        if source_frames <= 0:
            return 0
        # floor(t * step + 1/2) <= n - 1  <=>  t < (n - 1/2) / step
        return math.ceil((source_frames - Fraction(1, 2)) / self.step)

    def indices(self, start: int, frames: int) -> list[int]:
        """The source frames of the window of ``frames`` timeline frames from timeline frame ``start``."""
        return [self.source_index(t) for t in range(start, start + frames)]

    def describe(self) -> dict:
        return {"frame_stride": self.stride, "source_fps": None if self.source_fps is None else float(self.source_fps),
                "fps": self.fps}


@dataclass(frozen=True)
class Extraction:
    """``frame_extraction`` with its ``window_stride`` (slide) and ``frame_sample`` (uniform)."""

    mode: str = "head"
    window_stride: int | None = None
    frame_sample: int | None = None

    def starts(self, length: int, window: int) -> list[int]:
        """The windows' first timeline frames in a clip of ``length`` timeline frames; [] when no window fits."""
        if length < window:
            return []
        if self.mode in ("head", "full"):
            return [0]
        if self.mode == "chunk":
            return list(range(0, length - window + 1, window))
        if self.mode == "slide":
            return list(range(0, length - window + 1, self.window_stride))
        # uniform: numpy.linspace(0, length - window, frame_sample).astype(int), in exact integers
        last, count = length - window, self.frame_sample
        return [0] if count == 1 else [last * i // (count - 1) for i in range(count)]

    def describe(self) -> dict:
        info = {"frame_extraction": self.mode}
        if self.mode == "slide":
            info["window_stride"] = self.window_stride
        if self.mode == "uniform":
            info["frame_sample"] = self.frame_sample
        return info


def _positive_int(name: str, value, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive whole number of frames; e.g. {name}={example}")
    return value


def extraction(frame_extraction, window_stride, frame_sample, bucketed: bool) -> Extraction:
    """The settings -> ``Extraction``; each mistake one line naming the setting."""
    if frame_extraction not in EXTRACTIONS:
        raise ConfigError(f"frame_extraction={frame_extraction!r} is not one of {', '.join(EXTRACTIONS)}; pass "
                          f"frame_extraction=head (one window from each clip's start) or another of them")
    if frame_extraction == "slide":
        window_stride = _positive_int("window_stride", window_stride, "8 (frame_extraction=slide: a window every 8 "
                                                                      "frames)")
    elif window_stride is not None:
        raise ConfigError(f"window_stride={window_stride!r} is the step between frame_extraction=slide's windows, but "
                          f"frame_extraction={frame_extraction}; pass frame_extraction=slide, or drop window_stride")
    if frame_extraction == "uniform":
        frame_sample = _positive_int("frame_sample", frame_sample, "4 (frame_extraction=uniform: 4 windows a clip)")
    elif frame_sample is not None:
        raise ConfigError(f"frame_sample={frame_sample!r} is frame_extraction=uniform's windows per clip, but "
                          f"frame_extraction={frame_extraction}; pass frame_extraction=uniform, or drop frame_sample")
    if frame_extraction == "full" and not bucketed:
        raise ConfigError("frame_extraction=full takes each clip whole (up to frames=), which needs buckets: with "
                          "buckets=null every clip is cut to frames=; pass buckets=auto (or a list), or "
                          "frame_extraction=head")
    return Extraction(frame_extraction, window_stride, frame_sample)


def timeline(frame_stride: int, source_fps, fps, model_fps: int | None, vae: str) -> Timeline:
    """``frame_stride`` and ``source_fps`` -> ``fps`` (``fps`` None: ``model_fps``, the VAE's pipeline's family's
    rate) -> ``Timeline``; each mistake one line naming the setting."""
    if source_fps is None:
        if fps is not None:
            raise ConfigError(f"fps={fps!r} is the model's frame rate that source_fps resamples the clips to, but "
                              f"source_fps is not set; pass source_fps=<the clips' frame rate> too, or drop fps")
        return Timeline(frame_stride)
    if isinstance(source_fps, bool) or not isinstance(source_fps, (int, float, str)):
        raise ConfigError(f"source_fps={source_fps!r} must be the clips' frame rate, a positive number; e.g. "
                          f"source_fps=30 (or 29.97)")
    try:
        rate = Fraction(str(source_fps))
    except (ValueError, ZeroDivisionError, OverflowError):
        rate = None
    if rate is None or rate <= 0:
        raise ConfigError(f"source_fps={source_fps!r} must be the clips' frame rate, a positive number; e.g. "
                          f"source_fps=30 (or 29.97), or source_fps=null to take the frames as they are")
    if fps is None:
        fps = model_fps
        if fps is None:
            raise ConfigError(f"source_fps={source_fps} resamples the clips to the model's frame rate, which vae={vae} "
                              f"does not tell (no video pipeline around it, or a transformer class of models at "
                              f"several rates); pass fps=<the model's rate>, e.g. fps=16 for Wan 2.1, 24 for Wan 2.2 "
                              f"TI2V and HunyuanVideo")
    _positive_int("fps", fps, "16 (Wan's frame rate)")
    return Timeline(frame_stride, rate, fps)


def pipeline_fps(vae: str, vae_subfolder: str | None) -> int | None:
    """The frame rate of the model whose pipeline folder holds the VAE: model_index.json's transformer class ->
    its family's ``Family.fps``; None for a bare VAE folder, an image model, or a class whose families differ."""
    from pathlib import Path

    root = Path(str(vae)).expanduser()
    for folder in (root, root.parent):  # the pipeline folder given, or its vae/ folder
        index = folder / "model_index.json"
        if index.is_file():
            config = read_json(index, f"vae={vae}: {index}", kind=dict, fix="give the pipeline folder as saved")
            transformer = config.get("transformer")
            class_name = transformer[1] if isinstance(transformer, list) and len(transformer) == 2 else None

            # one transformer class can be several families: Wan 2.1 (16 fps) and Wan 2.2 TI2V-5B (24 fps), whose
            # pipeline sets expand_timesteps (its first-frame conditioning); any other doubt: no rate
            families = families_of_class(class_name)
            ti2v = bool(config.get("expand_timesteps"))
            families = [f for f in families if (f.image_condition == "first_frame") == ti2v] or families
            rates = {f.fps for f in families}
            return rates.pop() if len(rates) == 1 else None
    return None
