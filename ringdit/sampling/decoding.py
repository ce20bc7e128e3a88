"""The codecs of a sampling run (``spec_codecs``, ``output_codecs``: the text encoder, the VAE, the audio VAE and
vocoder), and infer.py's decoding after sampling: every rank of the run decodes its share of each written sample's
VAE tiles (``ringdit.media.parallel_vae``) and rank 0 writes the pictures and videos beside the samples' .npz files.

The sampling side's files (samples.npz, the grids, each sample's file) are written by ``SampleWriter`` and here,
the latents decoded by the run's ``Sampler`` (``Sampler.decode``, as the server, the previews and ``ringdit.load``
decode theirs); ``ringdit.media.decode`` keeps the VAE step itself (``decode_latents``) and the ``python -m
ringdit.media.decode`` command.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch.distributed as dist

from ringdit.common.errors import ConfigError
from ringdit.media.audio import AudioDecoder
from ringdit.media.decode import DEFAULT_FPS, shared_latents, stored_fps
from ringdit.media.text import data_text_encoder
from ringdit.media.vae import VAE
from ringdit.models.conditioning import AUDIO_KEY, text_conditioned
from ringdit.sampling.sampler import Codecs, Sampler
from ringdit.sampling.writer import write_pixels


def output_codecs(data: dict, output, device, text_encoder=None) -> Codecs:
    """The decoders of a sampling run's ``output`` (a ``ringdit.spec.OutputSpec``): its VAE (None without
    ``output.vae``) and, for a model that samples sound with its video, the audio VAE and vocoder (``audio_vae``)."""
    vae = VAE(output.vae, output.vae_subfolder, device=device, tile=output.vae_tile, tile_setting="vae_tile") \
        if output.vae else None
    audio = AudioDecoder.load(output.audio_vae, output.audio_vae_subfolder, output.vocoder_subfolder,
                              device=device) if output.audio_vae else None
    return Codecs.of_data(data, text_encoder, vae, audio)


def spec_codecs(spec, device) -> Codecs:
    """The codecs of a sampling run (a ``ringdit.spec.InferSpec``: the server's rank 0, ``ringdit.load``): the text
    encoder a text model's prompts are encoded with, where one is known (``data_text_encoder``: as the data's were,
    its width checked), and ``output_codecs``' decoders."""
    encoder = data_text_encoder(spec.data, spec.conditioning.text_encoder, spec.conditioning.tokenizer, device=device) \
        if text_conditioned(spec.data) and spec.conditioning.text_encoder else None
    return output_codecs(spec.data, spec.output, device, encoder)


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


def decode_written(files: list[Path], sampler: Sampler, output, group=None) -> list[Path]:
    """Decode infer.py's written samples with ``sampler``'s VAE (``Sampler.decode``; ``output``: the run's
    ``OutputSpec``): samples.npz into samples.png / .gif and sample-000.png / .mp4 ... as ``python -m
    ringdit.media.decode`` writes them, or each shape's samples-<name>.npz into its grid samples-<name>.png / .gif and
    its samples' files, named by their numbers (the npz's ``index``); a video's sound (the npz's ``audio``, LTX-2)
    decoded with the sampler's audio VAE and vocoder into its MP4's sound track. ``group`` (``decode_group``): every
    rank calls this and decodes its share of the tiles; rank 0 reads the files and writes the pictures (the others
    return [])."""
    written = []
    for file in files:
        whole = len(files) == 1 and file.name == "samples.npz"
        latents, indices = shared_latents(file, group, index=not whole)
        try:
            pixels = sampler.decode(latents, group)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if pixels is None:  # a rank other than the group's first: its tiles are decoded, rank 0 writes
            continue
        with np.load(file, allow_pickle=False) as stored:  # rank 0's file: the sound sampled with the video
            sounds = sampler.sounds({AUDIO_KEY: stored[AUDIO_KEY]}) if AUDIO_KEY in stored.files else None
        if whole:  # videos: the rate infer.py wrote beside them (the model's), else 16
            fps = output.fps or (stored_fps(file) or DEFAULT_FPS if pixels.ndim == 5 else None)
            written += write_pixels(pixels, file.parent, fps=fps, sounds=sounds)
        else:
            written += write_pixels(pixels, file.parent, stem=file.stem, indices=indices, fps=output.fps,
                                    sounds=sounds)
    return written
