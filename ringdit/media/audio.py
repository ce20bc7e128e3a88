"""Sound beside the video: LTX-2's audio latents decoded to a waveform (its audio VAE's mel spectrogram, then its
vocoder), as ``LTX2Pipeline`` decodes them, and the check that an audio VAE fits the transformer it decodes for.

    waveform = decode_audio(latents, audio_vae, vocoder)   # (B, channels, samples), at vocoder_rate(vocoder)
    write_mp4(frames, path, fps, audio=(waveform[i], vocoder_rate(vocoder)))  # ringdit.media.writing
"""

from __future__ import annotations

import torch

from ringdit.common.errors import ConfigError

Tensor = torch.Tensor


def latent_mel_bins(audio_vae) -> int:
    """The mel bins of one audio latent frame: the VAE's mel bins over its mel compression (LTX2Pipeline's)."""
    return audio_vae.config.mel_bins // audio_vae.mel_compression_ratio


def check_audio_vae(audio_vae, config: dict, setting: str = "audio_vae") -> None:
    """A ConfigError unless ``audio_vae`` (an ``AutoencoderKLLTX2Audio``) decodes the audio latents of a transformer of
    ``config``: the same sample rate and mel hop (the model's audio RoPE times its tokens in seconds of them), and
    latent channels x mel bins = audio_in_channels."""
    vae, rate, hop = audio_vae.config, config["audio_sampling_rate"], config["audio_hop_length"]
    if vae.sample_rate != rate or vae.mel_hop_length != hop:
        raise ConfigError(f"{setting}: the audio VAE works at {vae.sample_rate} Hz with a mel hop of "
                          f"{vae.mel_hop_length}, the model's audio at {rate} Hz with a hop of {hop} "
                          f"(model.config.audio_sampling_rate / audio_hop_length): its latents would be another "
                          f"duration than the model's; use the audio VAE of the model's own pipeline")
    width = vae.latent_channels * latent_mel_bins(audio_vae)
    if width != config["audio_in_channels"]:
        raise ConfigError(f"{setting}: the audio VAE's latents have {vae.latent_channels} channels x "
                          f"{latent_mel_bins(audio_vae)} mel bins = {width} per frame, the model takes "
                          f"model.config.audio_in_channels={config['audio_in_channels']}; use the audio VAE of the "
                          f"model's own pipeline")


def decode_audio(latents: Tensor, audio_vae, vocoder) -> Tensor:
    """Audio latents ``(B, C, L, M)`` -- or sampling's ``(B, 1, L, C * M)``: the same tokens -- on the audio VAE's
    normalised scale -> the waveform ``(B, channels, samples)``, as LTX2Pipeline decodes: per-feature
    denormalisation of the packed ``(B, L, C * M)`` latents, unpacked to the VAE's ``(B, C, L, M)``, its mel
    spectrogram, the vocoder."""
    packed = latents.transpose(1, 2).flatten(2)  # (B, L, C * M), the pipeline's packing
    mean, std = (t.to(packed) for t in (audio_vae.latents_mean, audio_vae.latents_std))
    packed = packed * std + mean
    unpacked = packed.unflatten(2, (-1, latent_mel_bins(audio_vae))).transpose(1, 2)  # (B, C, L, M)
    dtype = next(audio_vae.parameters()).dtype
    mel = audio_vae.decode(unpacked.to(dtype), return_dict=False)[0]
    return vocoder(mel.to(next(vocoder.parameters()).dtype))


def vocoder_rate(vocoder) -> int:
    """The sample rate of the vocoder's waveform."""
    return int(vocoder.config.output_sampling_rate)
