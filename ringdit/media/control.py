"""A control-video model's control input from pixels (``infer.py control=``): the control clip read at the samples'
frames and size and encoded with the data's VAE into ``control`` (B, vace_in_channels, T', h, w), as
``WanVACEPipeline`` builds ``control_hidden_states`` from its ``video`` (no mask: every pixel generated;
``ringdit.models.diffusers.wan_vace.control_condition``). The clip is checked for its frame count and size before
anything starts (``check_control_clip``) and is never cropped or resized: another clip would condition on other
frames than were asked for."""

from __future__ import annotations

from pathlib import Path

import torch

from ringdit.errors import ConfigError
from ringdit.media.frames import probe, read_video


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
                          f"samples have {frames} frames of {width}x{height}: a control clip is the samples' own frames "
                          f"and size; sample at frames={clip_frames} size=[{clip_height},{clip_width}], or give a clip "
                          f"of {frames} frames at {width}x{height}")


def encode_control(file: str, *, vae: str, size: tuple[int, int], frames: int, temporal: int,
                   device: str | None = None) -> torch.Tensor:
    """(1, 2 C + spatial^2, T', h, w) float32 on the CPU: ``file``'s ``frames`` frames at ``size`` (H, W) encoded with
    the VAE folder ``vae`` (the data's), as WanVACEPipeline prepares its control video. ``temporal``: the frames the
    VAE folds into one latent frame (the model family's)."""
    from ringdit.media.vae import VAE
    from ringdit.models.diffusers.wan_vace import control_condition

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    codec = VAE(vae, device=device, dtype=torch.float32)
    video = read_video(Path(file).expanduser(), *size, frames)[None]  # (1, 3, T, H, W) in [-1, 1]
    with torch.no_grad():
        control = control_condition(codec.encode, video.to(device), codec.spatial, temporal)
    return control.float().cpu()
