"""Loss masks beside the clips (prepare's ``mask_path=``, as diffusion-pipe's ``mask_path``): where the loss counts.

A mask is an image or a video in ``mask_path`` with its clip's file name stem (``cat.mp4``'s ``cat.png`` or
``cat.mp4``), of the clip's own size: white trains, black is ignored, grey weights in between (its luminance / 255).
An image mask covers every frame of a video; a video mask is read frame by frame as its clip. A clip without a mask
trains everywhere.

It is read by prepare's own reader with its clip's bucket (the same crop and resize), then averaged onto the latent
grid: each latent cell gets the mean of the pixels it encodes -- its spatial block and, for a causal video VAE, its
frames (the first latent frame is the first frame alone, each next one the following ``temporal`` frames; latent
frames a VAE pads at the front, CogVideoX's, copy the first). Stored as ``loss_mask`` (N, 1, [T',] H', W') beside
the latents (ringdit/data/text_latent_shards.py); the training loss multiplies each sample's squared error by it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ringdit.common.errors import ConfigError
from ringdit.media.folder import IMAGE_SUFFIXES, VIDEO_SUFFIXES, MediaItem
from ringdit.media.frames import probe

Tensor = torch.Tensor


def find_masks(mask_path, items: list[MediaItem]) -> dict[Path, Path]:
    """Each item's mask in the folder ``mask_path`` (by file name stem), checked to be of its clip's size (from the
    headers, nothing decoded); items without one are left out. A ``ConfigError`` for a missing folder, two masks of
    one stem, a video mask for an image, or a mask of another size."""
    folder = Path(str(mask_path)).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"mask_path={mask_path} is not a folder; give the folder of masks (an image or video per "
                          f"clip, with its file name stem), or mask_path=null for no loss masks")
    by_stem: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() not in IMAGE_SUFFIXES + VIDEO_SUFFIXES:
            continue
        if path.stem in by_stem:
            raise ConfigError(f"mask_path={mask_path} holds two masks for {path.stem!r} ({by_stem[path.stem].name}, "
                              f"{path.name}); keep one")
        by_stem[path.stem] = path
    masks = {}
    for item in items:
        mask = by_stem.get(item.path.stem)
        if mask is None:
            continue
        mask_video = mask.suffix.lower() in VIDEO_SUFFIXES
        if mask_video and not item.is_video:
            raise ConfigError(f"mask_path: {mask.name} is a video but its {item.path.name} is an image; give an image "
                              f"mask for an image")
        try:
            clip, given = probe(item.path, item.is_video)[:2], probe(mask, mask_video)[:2]
        except Exception:  # noqa: BLE001 - an unreadable clip or mask is skipped and counted when it is read
            continue
        if clip != given:
            raise ConfigError(f"mask_path: {mask.name} is {given[1]}x{given[0]} but its {item.path.name} is "
                              f"{clip[1]}x{clip[0]} (width x height); give each mask its clip's size, so that both "
                              f"are cropped alike")
        masks[item.path] = mask
    return masks


def is_video_mask(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_SUFFIXES


def latent_mask(pixels: Tensor, latent_shape: tuple[int, ...], temporal: int) -> Tensor:
    """A mask read as prepare reads its clip -- (3, [T,] H, W) in [-1, 1] -- as weights in [0, 1] on the latent grid
    ``latent_shape`` ([T',] H', W'): its luminance, the mean over each latent cell's pixels and frames (module
    docstring). An image mask of a video covers every latent frame."""
    red, green, blue = ((pixels.double() + 1) / 2).unbind(0)
    weights = (0.299 * red + 0.587 * green + 0.114 * blue).clamp(0, 1)  # Pillow's "L" conversion, as diffusion-pipe's
    height, width = latent_shape[-2:]
    if weights.shape[-2] % height or weights.shape[-1] % width:
        raise ValueError(f"a mask of {tuple(weights.shape[-2:])} pixels does not tile a {height}x{width} latent grid")
    if weights.dim() == 2:
        weights = weights[None]  # one frame
    weights = F.avg_pool2d(weights[:, None], (weights.shape[-2] // height, weights.shape[-1] // width))[:, 0]
    if len(latent_shape) == 2:  # an image latent
        return weights[0][None].float()
    frames = latent_shape[0]
    if weights.shape[0] > 1:  # a video mask: the first frame alone, then every ``temporal`` frames
        first, rest = weights[:1], weights[1:]
        if rest.shape[0] % temporal:
            raise ValueError(f"a mask of {weights.shape[0]} frames is not 1 + k * {temporal}")
        weights = torch.cat([first, rest.unflatten(0, (-1, temporal)).mean(dim=1)])
    if weights.shape[0] == 1:
        weights = weights.expand(frames, -1, -1)
    elif weights.shape[0] < frames:  # latent frames padded at the front (copies of the first)
        weights = torch.cat([weights[:1].expand(frames - weights.shape[0], -1, -1), weights])
    if weights.shape[0] != frames:
        raise ValueError(f"a mask of {weights.shape[0]} latent frames for latents of {frames}")
    return weights[None].float()  # (1, T', H', W')
