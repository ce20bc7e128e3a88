"""LTX-2's sound: audio latents decoded as LTX2Pipeline decodes them (tiny random audio VAE and vocoder of diffusers'
own LTX-2 pipeline tests), written as the AAC track of an MP4 beside its video (PyAV), and an audio VAE of another
sample rate or latent width than the transformer's refused in one line."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ringdit.common.errors import ConfigError
from ringdit.media.audio import check_audio_vae, decode_audio, latent_mel_bins, vocoder_rate
from ringdit.media.writing import write_mp4
from tests.helpers import architecture

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_audio_vae(sample_rate=16000, latent_channels=2):
    import diffusers

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=latent_channels, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=sample_rate, mel_hop_length=160, is_causal=True, mel_bins=8)
    # a normalisation that is not the identity, so that the test sees it applied per feature
    g = torch.Generator().manual_seed(2)
    vae.latents_mean.copy_(torch.randn(vae.latents_mean.shape, generator=g) * 0.3)
    vae.latents_std.copy_(torch.rand(vae.latents_std.shape, generator=g) + 0.5)
    return vae.double()


def tiny_vocoder():
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(0)
    return LTX2Vocoder(in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                       upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                       leaky_relu_negative_slope=0.1, output_sampling_rate=16000).double()


def test_decoded_audio_equals_the_pipelines_decode_in_both_latent_layouts():
    """The training layout (B, C, L, M) and sampling's (B, 1, L, C x M) decode to LTX2Pipeline's waveform: its
    _denormalize_audio_latents on the packed latents, _unpack_audio_latents, the audio VAE's decode, the vocoder."""
    from diffusers import LTX2Pipeline

    vae, vocoder = tiny_audio_vae(), tiny_vocoder()
    latents = torch.randn(1, 2, 18, latent_mel_bins(vae), generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)  # (B, C, L, M)
    packed = LTX2Pipeline._pack_audio_latents(latents)  # (B, L, C * M)
    with torch.no_grad():
        expected = LTX2Pipeline._denormalize_audio_latents(packed, vae.latents_mean, vae.latents_std)
        expected = LTX2Pipeline._unpack_audio_latents(expected, 18, num_mel_bins=latent_mel_bins(vae))
        expected = vocoder(vae.decode(expected, return_dict=False)[0])  # (B, 2, samples)
        for layout in (latents, packed[:, None]):
            assert torch.equal(decode_audio(layout, vae, vocoder), expected)
    assert expected.shape[:2] == (1, 2) and expected.abs().max() > 0


def test_an_mp4_carries_its_sound_track(tmp_path):
    """17 frames at 24 fps with a stereo tone of the same duration at 16 kHz: one H.264 and one AAC stream, the tone's
    samples (AAC adds its priming and pads its last frame: a frame of 1024 samples at most on each side)."""
    import av

    frames = (np.random.default_rng(0).random((17, 32, 32, 3)) * 255).astype(np.uint8)
    samples = round(17 / 24 * 16000)
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(samples) / 16000)
    path = write_mp4(frames, tmp_path / "clip.mp4", fps=24, audio=(np.stack([tone, -tone]), 16000))
    with av.open(str(path)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert (video.frames, audio.codec_context.name, audio.rate, audio.channels) == (17, "aac", 16000, 2)
        decoded = sum(frame.samples for frame in container.decode(audio))
    assert samples <= decoded <= samples + 2 * 1024, decoded


def test_an_audio_vae_of_another_sample_rate_or_width_is_refused_and_the_advice_decodes():
    config = architecture("ltx2_tiny")
    with pytest.raises(ConfigError) as refused:
        check_audio_vae(tiny_audio_vae(sample_rate=24000), config, setting="audio_vae=/models/other")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("audio_vae=/models/other: the audio VAE works at 24000 Hz with "
                                                      "a mel hop of 160, the model's audio at 16000 Hz"), message
    with pytest.raises(ConfigError, match="4 channels x 2 mel bins = 8 per frame, the model takes "
                                          "model.config.audio_in_channels=4"):
        check_audio_vae(tiny_audio_vae(latent_channels=4), config)
    vae = tiny_audio_vae()  # the advice: the audio VAE of the model's own pipeline (16 kHz, 2 x 2 per frame)
    check_audio_vae(vae, config)
    with torch.no_grad():
        waveform = decode_audio(torch.zeros(1, 1, 5, config["audio_in_channels"], dtype=torch.float64), vae,
                                tiny_vocoder())
    assert waveform.shape[:2] == (1, 2) and vocoder_rate(tiny_vocoder()) == 16000
