"""MiniMax-H3's video VAE (``AutoencoderKLMiniMaxH3``) as a VAE kind: its frame rhythm (17n + 5 frames -> 5n + 2
latent frames, which no single temporal factor describes) is the modular pipeline's, a clip length it cannot take is
refused by ``python -m ringdit.prepare`` in one line naming frames= and the nearest valid lengths (the advice
followed), and the latents prepare stores are the VAE's own encode of the ImageNet-normalised pixels, normalised by
its latents_mean / latents_std as MiniMaxH3ModularPipeline does; decoding inverts both. Tiny random VAE."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("av")

from ringdit.common.errors import ConfigError  # noqa: E402
from ringdit.media.encode_folder import encode_folder  # noqa: E402
from ringdit.media.vae import VAE  # noqa: E402
from ringdit.models.frame_rule import FrameRule  # noqa: E402
from tests.helpers import WORDS, read_prepared  # noqa: E402
from tests.minimax_h3_helpers import MEAN, STD, tiny_vae  # noqa: E402

FPS, FRAMES, SIZE = 24, 22, 32  # 22 = 17 + 5 frames -> 7 latent frames; 32 px -> 4 latent cells (8x)
@pytest.fixture(scope="module")
def minimax(tmp_path_factory) -> tuple[Path, object, Path]:
    """A pipeline-shaped folder (vae/, a tiny T5 text encoder and its tokenizer) and a folder of 4 random clips."""
    from transformers import T5Config, T5EncoderModel

    from ringdit.media.text import word_level_tokenizer
    from ringdit.media.writing import write_mp4

    root = tmp_path_factory.mktemp("minimax") / "MiniMax-H3"
    vae = tiny_vae(root / "vae")
    T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=16, d_ff=32, d_kv=4, num_layers=1, num_heads=2)
                   ).save_pretrained(root / "text_encoder")
    word_level_tokenizer(WORDS).save_pretrained(root / "tokenizer")
    clips = tmp_path_factory.mktemp("clips")
    rng = np.random.default_rng(0)
    for seed in range(2):
        write_mp4(rng.integers(0, 256, (FRAMES, SIZE, SIZE, 3), dtype=np.uint8), clips / f"clip{seed}.mp4", fps=FPS)
        (clips / f"clip{seed}.txt").write_text(" ".join(WORDS[seed] for _ in range(3)))
    return root, vae, clips


def test_the_frame_rule_is_the_modular_pipelines():
    """17n + 5 frames, 5n + 2 latent frames: the modular pipeline's video_latent_num_frames for every count it takes,
    its align_num_frames as the nearest count above any other; a transformer's temporal patch divides the count."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import align_num_frames, video_latent_num_frames

    rule = FrameRule(4, chunk=17, chunk_latents=5, chunk_drop=3)
    for frames in range(1, 300):
        latent = rule.latent_frames(frames)
        if frames % 17 == 5:
            assert latent == video_latent_num_frames(frames, 17, 5), frames
        else:
            assert latent is None, frames
            assert rule.nearest(frames)[-1] == align_num_frames(frames, 17, 5), frames
    assert FrameRule(4, patch=2, chunk=17, chunk_latents=5, chunk_drop=3).latent_frames(22) is None  # 7 latents
    assert FrameRule(4, patch=2, chunk=17, chunk_latents=5, chunk_drop=3).latent_frames(39) == 12


def test_vae_encodes_as_the_pipeline_and_decodes_back(minimax):
    """VAE.encode of [-1, 1] pixels = (the VAE's posterior mode of the ImageNet-normalised [0, 1] pixels - mean) /
    std (encode_vae_condition's normalisation, the mode where it samples); the latent count is the rule's;
    VAE.decode = the pipeline's decode (latents * std + mean, decoded, * ImageNet std + mean, clamped to [0, 1]) in
    [-1, 1]; describe() records the chunks."""
    root, model, _ = minimax
    codec = VAE(root, device="cpu")
    torch.manual_seed(1)
    pixels = torch.rand(1, 3, FRAMES, SIZE, SIZE) * 2 - 1  # (1, 3, 22, 32, 32)
    imagenet_mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1, 1)
    imagenet_std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1, 1)
    mean, std = torch.tensor(MEAN).view(1, 4, 1, 1, 1), torch.tensor(STD).view(1, 4, 1, 1, 1)
    with torch.no_grad():
        raw = model.encode(((pixels + 1) / 2 - imagenet_mean) / imagenet_std).latent_dist.mode()
        expected = (raw - mean) / std
        latents = codec.encode(pixels)
        assert latents.shape == (1, 4, codec.frame_rule.latent_frames(FRAMES), 4, 4) == (1, 4, 7, 4, 4)
        torch.testing.assert_close(latents, expected, rtol=1e-5, atol=1e-5)
        decoded = model.decode(latents * std + mean).sample * imagenet_std + imagenet_mean
        torch.testing.assert_close(codec.decode(latents), decoded.clamp(0, 1) * 2 - 1, rtol=1e-5, atol=1e-5)
    assert codec.describe()["chunks"] == {"chunk": 17, "chunk_latents": 5, "chunk_drop": 3}


def prepare(root: Path, clips: Path, out: Path, frames: int):
    return encode_folder(str(clips), str(out), str(root), str(root), size=SIZE, frames=frames, max_text_len=8,
                         progress=False)


def test_prepare_refuses_a_length_the_vae_cannot_take_and_the_advice_works(minimax, tmp_path):
    """frames=21: one line naming frames=21, the 17n + 5 rule and the nearest valid lengths 5 and 22; frames=22 (the
    advice) prepares every clip, its latents the VAE's encode (7 latent frames of 4 x 4)."""
    from ringdit.media.frames import read_frames

    root, _, clips = minimax
    with pytest.raises(ConfigError) as refused:
        prepare(root, clips, tmp_path / "bad", frames=21)
    message = str(refused.value)
    assert "\n" not in message and "frames=21" in message and "17 x n + 5" in message, message
    assert "nearest valid counts are 5 and 22" in message, message
    report = prepare(root, clips, tmp_path / "out", frames=22)
    assert report.samples == 2
    tensors, _ = read_prepared(tmp_path / "out" / "shard-00000.safetensors")
    assert tensors["latents"].shape == (2, 4, 7, 4, 4)
    clip = sorted(clips.glob("*.mp4"))[1]
    pixels = read_frames(clip, SIZE, SIZE, list(range(FRAMES)), "the clip")[None]  # (1, 3, 22, 32, 32)
    torch.testing.assert_close(tensors["latents"][1:2], VAE(root).encode(pixels), rtol=1e-5, atol=1e-5)


def test_sampling_sizes_follow_the_chunk_rule(minimax):
    """infer.py's sizes for data of this VAE (its shards' vae record): 7 latent frames are 22 video frames, frames=22
    samples 7 latent frames, frames=21 is refused naming the nearest valid counts 5 and 22."""
    from ringdit.sampling.sizes import SampleSizes

    root, _, _ = minimax
    sizes = SampleSizes.of({"image_size": [7, 4, 4], "vae": VAE(root).describe()}, patch=(1, 2, 2))
    assert sizes.user_size((7, 4, 4)) == ([32, 32], 22) and sizes.user_size((2, 4, 4)) == ([32, 32], 5)
    assert sizes.shape(frames=22)[0] == 7 and sizes.shape(frames=39)[0] == 12
    with pytest.raises(ConfigError, match="frames=21 .*17 x n \\+ 5.*nearest valid counts are 5 and 22"):
        sizes.shape(frames=21)
