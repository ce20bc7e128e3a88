"""The tiny LTX-2 folders and clips the LTX-2 prepare tests share: a pipeline-shaped folder (video VAE, audio VAE,
text encoder), clips with a sound track, a video VAE that decodes, and train.py's refusal check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import WORDS, prepare_train

RATE, FPS, FRAMES, SIZE = 22050, 24, 17, 64  # the clips' sound rate (resampled to the VAE's 16 kHz) and video


def tiny_audio_vae(folder: Path, sample_rate: int = 16000):
    """LTX-2's audio VAE, tiny and random: 2 latent channels x 2 latent mel bins (8 mel bins, 4x down in time and
    mel, as the real one's 8 x 16 of 64) = model=ltx2_tiny's audio_in_channels 4; its latents_mean / std set away
    from 0 / 1 so that the normalisation is seen."""
    from diffusers import AutoencoderKLLTX2Audio

    torch.manual_seed(0)
    model = AutoencoderKLLTX2Audio(base_channels=4, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=1,
                                   in_channels=2, resolution=32, latent_channels=2, mel_bins=8,
                                   sample_rate=sample_rate, mel_hop_length=160)
    model.latents_mean.copy_(torch.randn(4) * 0.1)
    model.latents_std.copy_(torch.rand(4) + 0.5)
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module")
def ltx2(tmp_path_factory) -> tuple[Path, dict]:
    """A pipeline-shaped LTX-2 folder: vae/ (AutoencoderKLLTX2Video, 8x in space and time, 4 channels: model=ltx2_tiny's
    in_channels), audio_vae/, and a tiny T5 as its text encoder (16 features: ltx2_tiny's caption_channels)."""
    from diffusers import AutoencoderKLLTX2Video
    from transformers import T5Config, T5EncoderModel

    from ringdit.media.text import word_level_tokenizer

    root = tmp_path_factory.mktemp("ltx2") / "LTX-2"
    torch.manual_seed(0)
    video = AutoencoderKLLTX2Video(
        latent_channels=4, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False), decoder_spatio_temporal_scaling=(True, True, True),
        downsample_type=("spatiotemporal",) * 4, decoder_inject_noise=(False,) * 4, patch_size=1)
    video.latents_mean.copy_(torch.randn(4) * 0.1)
    video.latents_std.copy_(torch.rand(4) + 0.5)
    video.save_pretrained(root / "vae")
    audio = tiny_audio_vae(root / "audio_vae")
    T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=16, d_ff=32, d_kv=4, num_layers=1, num_heads=2)
                   ).save_pretrained(root / "text_encoder")
    word_level_tokenizer(WORDS).save_pretrained(root / "tokenizer")
    return root, {"video": video.eval(), "audio": audio}


def write_clip(path: Path, seed: int, sound: bool = True, fps: int = FPS, seconds: float = 1.0) -> None:
    """A random clip with a two-tone stereo sound track (its pitch by seed) and a caption beside it."""
    from ringdit.media.writing import write_mp4

    rng = np.random.default_rng(seed)
    t = np.arange(int(RATE * seconds)) / RATE
    wave = np.stack([np.sin(2 * np.pi * (220 + 110 * seed) * t), np.sin(2 * np.pi * (330 + 55 * seed) * t)]) * 0.5
    frames = rng.integers(0, 256, (int(fps * seconds), SIZE, SIZE, 3), dtype=np.uint8)
    write_mp4(frames, path, fps=fps, audio=(wave, RATE) if sound else None)
    path.with_suffix(".txt").write_text(" ".join(WORDS[seed % len(WORDS)] for _ in range(3)))


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("clips")
    for seed in range(4):
        write_clip(folder / f"clip{seed}.mp4", seed)
    return folder


def assert_refused(tmp_path: Path, overrides: list[str], message: str) -> None:
    """train.py's checks (``train.prepare``, what runs before any rank starts) refuse ``overrides`` with the regex
    ``message``, and no checkpoint is written."""
    import re

    from hydra.errors import InstantiationException

    with pytest.raises((ValueError, InstantiationException)) as raised:
        prepare_train(overrides, tmp_path / "run")
    assert re.search(message, f"{raised.value} {raised.value.__cause__}"), raised.value
    assert not (tmp_path / "run" / "checkpoints").exists()


def save_ltx2_video_vae(folder: Path) -> Path:
    """The tiny LTX-2 video VAE of diffusers' LTX-2 tests (4 latent channels, 2x), which decodes: infer.py writes its
    samples through it."""
    import diffusers

    torch.manual_seed(0)
    diffusers.AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False).save_pretrained(folder)
    return folder
