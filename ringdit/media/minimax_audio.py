"""A clip's sound as MiniMax-H3 audio latents, for ``python -m ringdit.prepare audio_vae=<MiniMax-H3 folder>``: the
clip's audio track over the frames its video latents hold, decoded and resampled by PyAV to the audio VAE's rate
(32 kHz) in stereo, each channel encoded by the mono ``AutoencoderKLMiniMaxH3Audio`` (the waveform itself: no mel
front-end), its posterior mean normalised per channel by the VAE's latents_mean / latents_std -- as
``MiniMaxH3ModularPipeline`` encodes a reference's soundtrack (its ``ref2va`` condition step: the two stereo channels
two batch items, ``posterior.mode()``, ``(latents - mean) / std``), the inverse of its audio decode step.

    encoder = MiniMaxAudioEncoder("path/to/MiniMax-H3")      # its audio_vae/ folder (or the folder itself)
    audio = encoder.encode_clip(path, first_frame, frames)   # (2, L, C_a): ringdit.models.diffusers.minimax_h3's layout

``decode_stereo`` is the way back, as the pipeline's audio decode step (``MiniMaxH3AudioDecodeStep``) decodes.

L is the window's duration in audio latents, ``round(seconds x sample_rate / hop)`` (40 a second at 32 kHz: the
pipeline's ``audio_latent_num_frames``, ``round(frames / 24 x 40)`` for a clip at its 24 fps); the encoder reads
L x hop samples from the window's start (silence where the track ends early), so each latent sees the sound of its
own 25 ms and no sound after the window.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ringdit.media.audio_latents import read_waveform, video_rate

Tensor = torch.Tensor

AUDIO_VAE_CLASS = "AutoencoderKLMiniMaxH3Audio"
STEREO = 2  # MiniMax-H3's soundtrack: two channels, packed channel-major (ringdit.models.diffusers.minimax_h3)


class MiniMaxAudioEncoder:
    """MiniMax-H3's audio VAE (``AutoencoderKLMiniMaxH3Audio``) from a local diffusers folder (its class checked by
    ``ringdit.media.audio_latents.audio_vae_folder``), as prepare encodes with it."""

    def __init__(self, folder: Path, *, device="cpu", dtype: torch.dtype = torch.float32):
        import diffusers

        self.folder = folder
        self.model = diffusers.AutoencoderKLMiniMaxH3Audio.from_pretrained(str(folder), torch_dtype=dtype,
                                                                           use_safetensors=True)
        self.model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self.rate, self.hop = int(self.model.config.sampling_rate), int(self.model.hop_length)
        self.mean = torch.tensor(self.model.config.latents_mean, dtype=torch.float32).view(1, -1, 1)  # (1, C_a, 1)
        self.std = torch.tensor(self.model.config.latents_std, dtype=torch.float32).view(1, -1, 1)

    def latent_count(self, seconds: float) -> int:
        """The audio latents of ``seconds`` of sound: the pipeline's audio_latent_num_frames (40 a second)."""
        return max(1, round(seconds * self.rate / self.hop))

    def encode_waveform(self, waveform: Tensor) -> Tensor:
        """(2, samples) at ``self.rate`` -> (2, samples / hop, C_a) normalised latents: each channel a batch item of
        the mono VAE, its posterior mean, ``(latents - latents_mean) / latents_std``."""
        with torch.no_grad():
            posterior = self.model.encode(waveform.to(self.device)[:, None]).latent_dist  # (2, 1, samples) in
            latents = posterior.mode().float().cpu()  # (2, C_a, L)
        return ((latents - self.mean) / self.std).transpose(1, 2).contiguous()  # (2, L, C_a)

    def encode_clip(self, path: str | Path, first_frame: int, source_frames: float,
                    source_fps: float | None = None) -> Tensor:
        """The sound of the window of the clip at ``path`` that starts at source frame ``first_frame`` and spans
        ``source_frames`` source frames -> (2, L, C_a) latents; times at ``source_fps`` (None: the file's rate)."""
        fps = float(source_fps or video_rate(path))
        count = self.latent_count(float(source_frames) / fps)
        waveform = read_waveform(path, first_frame / fps, count * self.hop / self.rate, self.rate, STEREO)
        return self.encode_waveform(waveform)  # (2, L, C_a)

    def describe(self) -> dict:
        """What a shard records of its audio latents (``audio_vae`` metadata)."""
        return {"class": AUDIO_VAE_CLASS, "path": str(self.folder.resolve()), "sample_rate": self.rate,
                "hop_length": self.hop, "latent_channels": int(self.model.config.latent_channels)}


def decode_stereo(latents: Tensor, audio_vae) -> Tensor:
    """One sample's normalised latents (2, L, C_a) -> its waveform (2, L x hop) at the VAE's ``sampling_rate``, as
    ``MiniMaxH3AudioDecodeStep`` decodes: the stereo channels two batch items ``(2, C_a, L)`` of the mono VAE,
    ``latents x latents_std + latents_mean`` per channel, ``decode``, its ``(2, 1, samples)`` as one stereo track."""
    parameter = next(audio_vae.parameters())
    mean = torch.tensor(audio_vae.config.latents_mean, device=parameter.device).view(1, -1, 1)  # (1, C_a, 1)
    std = torch.tensor(audio_vae.config.latents_std, device=parameter.device).view(1, -1, 1)
    rows = latents.to(parameter.device).transpose(1, 2)  # (2, C_a, L): the pipeline's audio_latents
    rows = rows * std + mean
    audio = audio_vae.decode(rows.to(parameter.dtype), return_dict=False)[0]  # (2, 1, samples)
    return audio.float().permute(1, 0, 2)[0]  # (2, samples)
