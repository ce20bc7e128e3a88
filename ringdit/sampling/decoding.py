"""infer.py's decoding after sampling: every rank of the run decodes its share of each written sample's VAE tiles
(``ringdit.media.parallel_vae``) and rank 0 writes the pictures and videos beside the samples' .npz files.

The sampling side's files (samples.npz, the grids, each sample's file) are written by ``SampleWriter`` and here;
``ringdit.media.decode`` keeps the VAE step itself (``decode_latents``) and the ``python -m ringdit.media.decode``
command.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ringdit.common.errors import ConfigError
from ringdit.media.decode import decode_latents, decode_samples, latents_normalised, shared_latents
from ringdit.media.vae import VAE
from ringdit.sampling.writer import write_pixels


def decode_group():
    """The sampling run's ranks, still joined after ``trainer.predict`` (Lightning's ranks run this script to its
    end; the process group is destroyed at exit): every rank decodes its share of each sample's VAE tiles
    (``ringdit.media.parallel_vae``) and rank 0 writes the files. None for a single process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def shared_files(files: list[Path], group) -> list[Path]:
    """Rank 0's written samples*.npz (the SampleWriter writes on rank 0 alone), on every rank of ``group``."""
    if group is None:
        return files
    message = [[str(file) for file in files]]
    dist.broadcast_object_list(message, src=0, group=group)
    return [Path(file) for file in message[0]]


def decode_written(files: list[Path], output, data_info: dict, device: str, group=None) -> list[Path]:
    """Decode infer.py's written samples with ``output.vae`` (its ``OutputSpec``; ``data_info``: the checkpoint's
    data): samples.npz as ``decode_samples`` does (samples.png / .gif, sample-000.png / .mp4 ...), or each shape's
    samples-<name>.npz into its grid samples-<name>.png / .gif and its samples' files, named by their numbers (the
    npz's ``index``). ``group`` (``decode_group``): every rank calls this and decodes its share of the tiles; rank 0
    reads the files and writes the pictures (the others return [])."""
    normalised = latents_normalised(data_info)
    if len(files) == 1 and files[0].name == "samples.npz":
        return decode_samples(files[0], output.vae, vae_subfolder=output.vae_subfolder, fps=output.fps,
                              tile=output.vae_tile, device=device, normalised=normalised, group=group,
                              tile_setting="vae_tile")
    codec = VAE(output.vae, output.vae_subfolder, device=device, tile=output.vae_tile, tile_setting="vae_tile")
    written = []
    for file in files:
        latents, indices = shared_latents(file, group, index=True)
        try:
            pixels = decode_latents(latents, codec, normalised, group=group)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if pixels is not None:  # rank 0 (or a single process)
            written += write_pixels(pixels, file.parent, stem=file.stem, indices=indices, fps=output.fps)
    return written
