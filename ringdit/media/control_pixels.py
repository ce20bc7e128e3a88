"""A control-video model's control input from pixels (``infer.py control=``; ``prepare control=`` finds each clip's
control clip, ``prepare reference=`` each image's reference image): the control clip read at the samples'
frames and size and encoded with the data's VAE into ``control`` (B, vace_in_channels, T', h, w), as
``WanVACEPipeline`` builds ``control_hidden_states`` from its ``video`` (no mask: every pixel generated;
``ringdit.models.diffusers.wan_vace.control_condition``). The clip is checked for its frame count and size before
anything starts (``check_control_clip``) and is never cropped or resized: another clip would condition on other
frames than were asked for."""

from __future__ import annotations

from pathlib import Path

import torch

from ringdit.common.errors import ConfigError
from ringdit.media.folder import IMAGE_SUFFIXES, VIDEO_SUFFIXES
from ringdit.media.frames import image_pixels, open_image, probe, read_video
from ringdit.media.vae import VAE
from ringdit.models.diffusers.wan_vace import control_condition


def check_control_clip(file: str, height: int, width: int, frames: int) -> None:
    """The control clip opens as a video of exactly ``frames`` frames of ``height`` x ``width`` pixels, or a one-line
    ConfigError naming ``control=``."""
    path = Path(file).expanduser()
    if not path.is_file():
        raise ConfigError(f"control={file} does not exist; give the control video file (MP4, WebM ...)")
    try:
        clip_height, clip_width, clip_frames = probe(path, is_video=True)
    except Exception as error:  # noqa: BLE001 - PyAV raises its own errors for files it cannot read
        raise ConfigError(f"control={file} cannot be read as a video ({error}); give an MP4 / WebM file") from None
    if (clip_height, clip_width, clip_frames) != (height, width, frames):
        raise ConfigError(f"control={file} has {clip_frames} frames of {clip_width}x{clip_height} (W x H) but the "
                          f"samples have {frames} frames of {width}x{height}: a control clip is the samples' own "
                          f"frames and size; sample at frames={clip_frames} size=[{clip_height},{clip_width}], or "
                          f"give a clip of {frames} frames at {width}x{height}")


def encode_control(file: str, *, vae: str, size: tuple[int, int], frames: int, temporal: int,
                   device: str | None = None) -> torch.Tensor:
    """(1, 2 C + spatial^2, T', h, w) float32 on the CPU: ``file``'s ``frames`` frames at ``size`` (H, W) encoded with
    the VAE folder ``vae`` (the data's), as WanVACEPipeline prepares its control video. ``temporal``: the frames the
    VAE folds into one latent frame (the model family's)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    codec = VAE(vae, device=device, dtype=torch.float32)
    video = read_video(Path(file).expanduser(), *size, frames)[None]  # (1, 3, T, H, W) in [-1, 1]
    with torch.no_grad():
        control = control_condition(codec.encode, video.to(device), codec.spatial, temporal)
    return control.float().cpu()


def find_controls(control, items: list) -> dict[Path, Path]:
    """``python -m ringdit.prepare control=<folder>``: each clip's control clip in that folder (the clip's file name
    stem), checked from the headers to have the clip's size and frame count, so that both are read and cropped alike
    (prepare reads the control clip's frames at the clip's indices). A ``ConfigError`` naming ``control=`` for a
    missing folder, an image among the clips, a clip without a control clip, or one of another size or length."""
    folder = Path(str(control)).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"control={control} is not a folder; give the folder of control videos (one per clip, with "
                          f"its file name stem), or control=null")
    by_stem = {path.stem: path for path in sorted(folder.iterdir()) if path.suffix.lower() in VIDEO_SUFFIXES}
    controls = {}
    for item in items:
        if not item.is_video:
            raise ConfigError(f"control={control}: {item.path.name} is an image, but a control video conditions "
                              f"video clips; prepare the images without control=")
        found = by_stem.get(item.path.stem)
        if found is None:
            raise ConfigError(f"control={control} has no control video for {item.path.name} (a video named "
                              f"{item.path.stem}.mp4 or another video suffix); give every clip its control video")
        try:
            clip, given = probe(item.path, True), probe(found, True)
        except Exception as error:  # noqa: BLE001 - PyAV raises its own errors for files it cannot read
            raise ConfigError(f"control={control}: {item.path.name} or its control video {found.name} cannot be read "
                              f"as a video ({error}); replace the file, or leave the clip out") from None
        if clip != given:
            raise ConfigError(f"control={control}: {found.name} has {given[2]} frames of {given[1]}x{given[0]} but "
                              f"{item.path.name} has {clip[2]} frames of {clip[1]}x{clip[0]} (W x H); give each "
                              f"control video its clip's frames and size")
        controls[item.path] = found
    return controls


def find_references(reference, items: list) -> dict[Path, Path]:
    """``python -m ringdit.prepare reference=<folder>``: each image's reference image in that folder (the image's file
    name stem), checked from the headers to have the image's aspect ratio (it is read at the image's size: another
    ratio would be squeezed or cropped unlike its image). A ``ConfigError`` naming ``reference=`` for a missing
    folder, a video among the images, an image without a reference, or one of another aspect ratio."""
    folder = Path(str(reference)).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"reference={reference} is not a folder; give the folder of reference images (one per "
                          f"image, with its file name stem), or reference=null")
    by_stem = {path.stem: path for path in sorted(folder.iterdir()) if path.suffix.lower() in IMAGE_SUFFIXES}
    found = {}
    for item in items:
        if item.is_video:
            raise ConfigError(f"reference={reference}: {item.path.name} is a video, but a reference image conditions "
                              f"images (Qwen-Image-Edit); prepare the videos without reference=")
        path = by_stem.get(item.path.stem)
        if path is None:
            raise ConfigError(f"reference={reference} has no reference image for {item.path.name} (an image named "
                              f"{item.path.stem}.png or another image suffix); give every image its reference")
        try:
            (height, width, _), (ref_height, ref_width, _) = probe(item.path, False), probe(path, False)
        except Exception as error:  # noqa: BLE001 - PIL raises its own errors for files it cannot read
            raise ConfigError(f"reference={reference}: {item.path.name} or its reference {path.name} cannot be read "
                              f"as an image ({error}); replace the file, or leave the image out") from None
        if abs(ref_width * height - ref_height * width) >= max(height, width):  # other ratio, beyond 1 px rounding
            raise ConfigError(f"reference={reference}: {path.name} is {ref_width}x{ref_height} (W x H) but "
                              f"{item.path.name} is {width}x{height}: a different aspect ratio; crop the reference to "
                              f"{width}:{height} (it is read at its image's size)")
        found[item.path] = path
    return found


def reference_image(path: Path):
    """A reference image as the edit pipelines take it for their prompt: the file, turned upright (as infer.py's
    ``image=`` is read), in RGB (PIL)."""
    from PIL import ImageOps

    with open_image(path) as opened:
        return ImageOps.exif_transpose(opened).convert("RGB")


def encode_reference(pictures, *, vae: str, size: tuple[int, int], device: str | None = None) -> torch.Tensor:
    """(n, C, h, w) float32 on the CPU: each picture (PIL, upright as stored) read at ``size`` (H, W) as prepare reads
    an image (``frames.image_pixels``: centre-cropped to the ratio, resized) and encoded with the VAE folder ``vae``
    (the data's) as prepare encodes images: a reference image's latents (``prepare reference=``, Qwen-Image-Edit)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    codec = VAE(vae, device=device, dtype=torch.float32)
    pixels = torch.stack([image_pixels(picture, *size) for picture in pictures])  # (n, 3, H, W) in [-1, 1]
    with torch.no_grad():
        latents = codec.encode(pixels.to(device))  # (n, C, h, w), or (n, C, 1, h, w) from a video VAE
    return (latents[:, :, 0] if latents.dim() == 5 else latents).float().cpu()
