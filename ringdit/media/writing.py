"""Decoded samples to files: images as a PNG grid plus one PNG each, videos as MP4 (H.264 via PyAV, with an AAC
sound track where the sample has sound) plus GIF -- the one writer of infer.py, the previews, the server and
``python -m ringdit.media.decode``.

    write_pixels(pixels, out_dir)   # pixels uint8 (N, H, W, C) or (N, T, H, W, C)
    -> samples.png + sample-000.png ...              (images)
    -> samples.gif + sample-000.mp4 + sample-000.gif (videos; the grid as an animated GIF, as infer.py writes it)
    write_sample(video, path, fps, sound=(waveform, rate))   # one sample's file, whole or not there
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ringdit.common.atomic import atomic_write
from ringdit.media.images import save_samples, to_image, write_gif


def write_mp4(frames: np.ndarray, path: Path, fps: int = 16,
              audio: tuple[np.ndarray, int] | None = None) -> Path:
    """(T, H, W, C) uint8 -> H.264 MP4, with ``audio`` = (waveform (channels, samples) in [-1, 1], sample rate) as
    its AAC sound track (LTX-2's). yuv420p (what every player reads) needs even sides: odd ones are padded by
    repeating the last row / column. PyAV directly: imageio's PyAV plugin spends ~0.5 s closing each file (measured
    inside infer.py), which for a grid of small samples costs more than sampling them.

    The same frames give the same bytes: x264's macroblock-tree rate control (mbtree) encodes small frames (32 x 32)
    differently from run to run (measured: 10 distinct files from 40 encodes of one 5-frame clip, PyAV 18.1's x264
    core 165), so it is off; the rest is x264's default (CRF 23, preset medium)."""
    import av

    t, h, w, c = frames.shape
    if c == 1:
        frames = np.repeat(frames, 3, axis=-1)
    frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps, options={"x264-params": "no-mbtree=1"})
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        sound = None if audio is None else _audio_stream(container, *audio)  # every stream before the first packet
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames
        if sound is not None:
            _mux_audio(container, sound, *audio)
    return path


def _audio_stream(container, waveform: np.ndarray, rate: int):
    """An AAC stream for a (channels, samples) waveform, mono or stereo."""
    if waveform.shape[0] not in (1, 2):
        raise ValueError(f"an MP4 sound track here is mono or stereo; the waveform has {waveform.shape[0]} channels")
    stream = container.add_stream("aac", rate=rate)
    stream.layout = "mono" if waveform.shape[0] == 1 else "stereo"
    return stream


def _mux_audio(container, stream, waveform: np.ndarray, rate: int) -> None:
    """The waveform (channels, samples) in [-1, 1] into ``stream`` (the encoder cuts it into its frames)."""
    import av

    samples = np.ascontiguousarray(np.clip(waveform, -1, 1), dtype=np.float32)
    frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout=stream.layout.name)
    frame.sample_rate = rate
    container.mux(stream.encode(frame))
    container.mux(stream.encode())  # flush the encoder's delayed frames


def write_pixels(pixels: np.ndarray, out_dir: Path, *, stem: str = "samples", indices: list[int] | None = None,
                 fps: int = 16, columns: int | None = None, each: bool = True,
                 sounds: list[tuple[np.ndarray, int]] | None = None) -> list[Path]:
    """uint8 ``(N, H, W, C)`` images or ``(N, T, H, W, C)`` videos of one shape: the grid ``stem``.png / .gif and,
    with ``each``, ``sample-<i>.png`` (images) or ``.mp4`` + ``.gif`` (videos) named by ``indices`` (the sample
    numbers; None: their positions); ``sounds``: each video's (waveform (channels, samples), rate), its MP4's sound
    track (None: silent)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [save_samples(pixels, out / stem, columns=columns, fps=fps)]
    indices = range(len(pixels)) if indices is None else indices
    for n, (i, sample) in enumerate(zip(indices, pixels) if each else ()):
        name = out / f"sample-{i:03d}"
        if pixels.ndim == 4:
            written.append(write_sample(sample, name.with_suffix(".png")))
        else:
            written += [write_sample(sample, name.with_suffix(".mp4"), fps, sounds[n] if sounds else None),
                        write_gif(sample, name.with_suffix(".gif"), fps)]
    return written


def write_sample(pixels: np.ndarray, path: Path, fps: int | None = None,
                 sound: tuple[np.ndarray, int] | None = None) -> Path:
    """One sample's file at ``path``, whole or not there (written beside it and renamed): uint8 ``(H, W, C)`` as a
    PNG, ``(T, H, W, C)`` as an H.264 MP4 at ``fps`` with ``sound`` = (waveform (channels, samples), rate) as its AAC
    track (None: silent)."""
    path = Path(path)
    if pixels.ndim == 3:
        with atomic_write(path) as partial:
            to_image(pixels).save(partial, format="PNG")
        return path
    partial = path.with_name(f"{path.stem}.partial{path.suffix}")  # PyAV picks the container by the suffix
    write_mp4(pixels, partial, fps or 16, audio=sound)
    partial.replace(path)
    return path
