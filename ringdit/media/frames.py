"""Reading one image or video into its bucket's pixels: (3, H, W) or (3, T, H, W) float in [-1, 1], and probing a
file's size and length cheaply (``probe``: headers only) so that every file's bucket is known before any decoding.

The bucket rule, for a bucket of H x W pixels and T frames (``python -m ringdit.prepare``: with ``buckets=null`` one
bucket per prepared folder, ``size`` x ``frames``; with ``buckets=auto`` or a list, each file's own bucket, of
nearest aspect ratio, chosen by ringdit/media/buckets.py):
    space  scale to cover (H, W) and centre-crop the excess: crop to the bucket's aspect ratio (keep the largest
           middle region), then resize to (H, W) with Lanczos filtering, so nothing is stretched;
    time   the window's frames (ringdit/media/windows.py: frames 0, stride, 2 * stride, ... by default; another start,
           or frames resampled from source_fps), read lazily (a long clip is not decoded beyond what is used); a
           clip with fewer is skipped as too short (``TooShort``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

EXIF_ORIENTATION = 0x0112
SWAPPING_ORIENTATIONS = (5, 6, 7, 8)  # exif_transpose turns these by 90 degrees: width and height swap


class TooShort(Exception):
    """The clip has fewer frames than the bucket needs at this stride."""


class UnreadableImage(ValueError):
    """A file Pillow cannot open or decode, or one whose header declares more pixels than Pillow's bomb guard
    (``Image.MAX_IMAGE_PIXELS``) allows."""


@contextlib.contextmanager
def open_image(path):
    """``Image.open(path)`` whose every failure -- not an image, a broken header, a decompression bomb (Pillow's
    ``DecompressionBombError``, for more than twice ``Image.MAX_IMAGE_PIXELS``, is a plain ``Exception``) -- is one
    ``UnreadableImage`` naming the file; a failure of the caller's own code inside the block passes through."""
    try:
        image = Image.open(path)
    except Exception as error:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, DecompressionBombError, ...
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UnreadableImage(f"{path} is not a readable image ({first})") from None
    with image:
        yield image


HIGH_DEPTH_MODES = {"I;16": "16-bit", "I;16B": "16-bit", "I;16L": "16-bit", "I;16N": "16-bit", "I": "32-bit integer",
                    "F": "floating-point"}  # Pillow's convert("RGB") clips them: a 16-bit photo becomes white


def decoded(image: Image.Image) -> Image.Image:
    """``image.load()`` (every pixel decoded now: a file cut off fails here, not later) as an ``UnreadableImage``;
    so is an image of more than 8 bits per channel, which would become a blank frame."""
    name = image.filename or "the image"
    try:
        image.load()
    except Exception as error:  # noqa: BLE001 - any decoder failure: this file is unusable
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UnreadableImage(f"{name} is not a readable image ({first})") from None
    if image.mode in HIGH_DEPTH_MODES:
        raise UnreadableImage(f"{name} is a {HIGH_DEPTH_MODES[image.mode]} image (Pillow mode {image.mode}), not a "
                              f"readable 8-bit one (converting would clip it to white or black); save it as an 8-bit "
                              f"PNG / JPEG")
    return image


def fit(image: Image.Image, height: int, width: int) -> Image.Image:
    """Centre-crop ``image`` to the aspect ratio height:width, then resize to exactly (width, height)."""
    w, h = image.size
    if w * height > h * width:  # too wide: keep the middle columns
        crop_w = max(1, round(h * width / height))
        left = (w - crop_w) // 2
        image = image.crop((left, 0, left + crop_w, h))
    else:  # too tall: keep the middle rows
        crop_h = max(1, round(w * height / width))
        top = (h - crop_h) // 2
        image = image.crop((0, top, w, top + crop_h))
    return image.resize((width, height), Image.LANCZOS)


def to_pixels(frames: list[Image.Image]) -> torch.Tensor:
    """RGB frames -> (3, T, H, W) float in [-1, 1]."""
    array = np.stack([np.asarray(f.convert("RGB")) for f in frames])  # (T, H, W, 3) uint8
    return torch.from_numpy(array).permute(3, 0, 1, 2).float() / 127.5 - 1


def upright_size(image: Image.Image) -> tuple[int, int]:
    """(height, width) of an opened image once turned upright (``ImageOps.exif_transpose``: phone photos store their
    rotation in EXIF), from its header: no pixel is decoded."""
    width, height = image.size
    return (width, height) if _orientation(image) in SWAPPING_ORIENTATIONS else (height, width)


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation the header records (1: upright). The base class's ``getexif``, not PNG's, which decodes
    the whole image to look for an EXIF chunk after the pixels; a broken EXIF block counts as upright."""
    try:
        return int(Image.Image.getexif(image).get(EXIF_ORIENTATION, 1))
    except Exception:  # a malformed EXIF block: Pillow raises struct.error, ValueError, ...
        return 1


def to_image(pixels: torch.Tensor) -> Image.Image:
    """(3, H, W) in [-1, 1] -> the RGB image: the exact inverse of ``to_pixels`` for its 8-bit frames (the float
    rounding of / 127.5 - 1 is far below the 0.5 that ``round`` absorbs)."""
    array = ((pixels.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)  # (3, H, W)
    return Image.fromarray(array.permute(1, 2, 0).numpy())


def image_pixels(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """An opened image -> (3, H, W) in [-1, 1]: upright (EXIF rotation applied), cropped and resized by ``fit``."""
    return to_pixels([fit(ImageOps.exif_transpose(image).convert("RGB"), height, width)])[:, 0]


def read_image(path: Path, height: int, width: int) -> torch.Tensor:
    """(3, H, W) in [-1, 1], upright (EXIF rotation applied); raises (OSError, ValueError, ...) when the file cannot
    be decoded."""
    with open_image(path) as image:
        return image_pixels(decoded(image), height, width)


def read_video(path: Path, height: int, width: int, frames: int, stride: int = 1) -> torch.Tensor:
    """(3, frames, H, W) in [-1, 1] from frames 0, stride, 2 * stride, ...; ``TooShort`` when the clip ends first."""
    return read_frames(path, height, width, [index * stride for index in range(frames)],
                       f"{frames} frames at stride {stride}")


def read_frames(path: Path, height: int, width: int, indices: list[int], wanted: str | None = None) -> torch.Tensor:
    """(3, len(indices), H, W) in [-1, 1]: the clip's frames ``indices`` (ascending; one may repeat, where a slower
    clip is resampled to a faster rate), decoded up to the last of them only; ``TooShort`` when the clip ends first."""
    import av

    picked: list[Image.Image] = []
    last, seen = max(indices), 0
    # PyAV directly, not imageio's plugin: that one ends every file with a full garbage collection (gc.collect), which
    # with a model loaded costs ~0.25 s a clip -- more than decoding a short clip
    with av.open(str(path)) as container:
        for index, frame in enumerate(container.decode(video=0)):  # decodes lazily, frame by frame
            seen, repeats = index + 1, indices.count(index)
            if repeats:
                fitted = fit(frame.to_image(), height, width)  # RGB, as frame.to_ndarray(format="rgb24")
                picked += [fitted] * repeats
            if index == last:
                return to_pixels(picked)
    raise TooShort(f"{path.name}: the clip ends after {seen} frames, but {wanted or f'frame {last}'} is needed")


def probe(path: Path, is_video: bool) -> tuple[int, int, int | None]:
    """(height, width, frames) of an image (frames None) or a video, from the headers: PIL's size without decoding
    pixels; PyAV's stream metadata (its frame count, else the packets counted, no frame decoded). Raises (OSError,
    ValueError, av.error.*, ...) when the file cannot be opened as one."""
    if not is_video:
        with open_image(path) as image:
            return *upright_size(image), None
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError(f"{path.name} has no video stream")
        stream = container.streams.video[0]
        height, width = stream.codec_context.height, stream.codec_context.width
        frames = int(stream.frames or 0)
        if frames <= 0:  # no count in the container (some .webm / .mkv / .avi): one packet per frame
            frames = sum(1 for packet in container.demux(stream) if packet.size)
    if not height or not width:
        raise ValueError(f"{path.name}: the video stream has no frame size")
    return int(height), int(width), frames
