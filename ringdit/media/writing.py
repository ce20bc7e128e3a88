"""Decoded samples to files: images as a PNG grid plus one PNG each, videos as MP4 (H.264 via PyAV) plus GIF.

    write_media(pixels, out_dir)   # pixels uint8 (N, H, W, C) or (N, T, H, W, C)
    -> samples.png + sample-000.png ...              (images)
    -> samples.gif + sample-000.mp4 + sample-000.gif (videos; the grid as an animated GIF, as infer.py writes it)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

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


def write_media(pixels: np.ndarray, out_dir: str | Path, fps: int = 16, prefix: str = "sample") -> list[Path]:
    """Write every sample and a grid into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [save_samples(pixels, out / "samples", fps=fps)]  # the grid: samples.png, or samples.gif for videos
    for i, sample in enumerate(pixels):
        name = out / f"{prefix}-{i:03d}"
        if pixels.ndim == 4:
            to_image(sample).save(name.with_suffix(".png"))
            written.append(name.with_suffix(".png"))
        else:
            written += [write_mp4(sample, name.with_suffix(".mp4"), fps),
                        write_gif(sample, name.with_suffix(".gif"), fps)]
    return written
