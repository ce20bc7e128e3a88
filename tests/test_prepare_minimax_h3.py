"""``python -m ringdit.prepare`` for MiniMax-H3 (``vae=`` / ``audio_vae=`` its pipeline folder): each clip's video
latents from ``AutoencoderKLMiniMaxH3`` (tests/test_minimax_h3_vae.py), its sound resampled by PyAV to the audio
VAE's 32 kHz stereo and encoded channel by channel by the mono ``AutoencoderKLMiniMaxH3Audio`` as
MiniMaxH3ModularPipeline encodes a reference soundtrack (posterior mean, ``(latents - mean) / std``, channel-major),
L = round(frames / 24 x 40) latents as the pipeline counts them; the shards train ``model=minimax_h3_tiny`` through
train.py. Tiny random VAEs and Qwen3-VL (``prompt_template=minimax_h3``: its hidden_states[50] of the bare caption,
tests/test_minimax_h3_prompt.py)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("av")

from ringdit.media.audio_latents import read_waveform  # noqa: E402
from ringdit.media.encode_folder import encode_folder  # noqa: E402
from tests.helpers import WORDS, logged_losses, prepare_train, read_prepared, run  # noqa: E402
from tests.minimax_h3_helpers import AUDIO_MEAN, AUDIO_STD, tiny_audio_vae, tiny_qwen3_vl, tiny_vae  # noqa: E402

RATE, FPS, FRAMES, SIZE = 22050, 24, 22, 32  # the clips' sound (resampled to 32 kHz) and video: 7 x 4 x 4 latents
@pytest.fixture(scope="module")
def minimax(tmp_path_factory) -> tuple[Path, object, Path]:
    """A pipeline-shaped MiniMax-H3 folder (vae/, audio_vae/, a tiny Qwen3-VL text_encoder/ of 16 features:
    minimax_h3_tiny's text_dim, tokenizer/) and 4 random clips of 22 frames with a two-tone stereo sound track each
    (its pitch by seed)."""
    from ringdit.media.writing import write_mp4

    root = tmp_path_factory.mktemp("minimax") / "MiniMax-H3"
    tiny_vae(root / "vae")
    audio = tiny_audio_vae(root / "audio_vae")
    tiny_qwen3_vl(root)
    clips = tmp_path_factory.mktemp("clips")
    rng = np.random.default_rng(0)
    t = np.arange(RATE) / RATE
    for seed in range(4):
        wave = np.stack([np.sin(2 * np.pi * (220 + 110 * seed) * t), np.sin(2 * np.pi * (330 + 55 * seed) * t)]) / 2
        frames = rng.integers(0, 256, (FPS, SIZE, SIZE, 3), dtype=np.uint8)  # one second
        write_mp4(frames, clips / f"clip{seed}.mp4", fps=FPS, audio=(wave, RATE))
        (clips / f"clip{seed}.txt").write_text(" ".join(WORDS[5 + seed] for _ in range(3)))
    return root, audio, clips


def prepare(root: Path, clips: Path, out: Path):
    return encode_folder(str(clips), str(out), str(root), str(root), size=SIZE, frames=FRAMES, max_text_len=8,
                         audio_vae=str(root), prompt_template="minimax_h3", progress=False)


def test_prepare_stores_the_audio_latents_as_the_pipeline_encodes_a_soundtrack(minimax, tmp_path):
    """Every clip's row: audio (2, 37, 8) -- L = audio_latent_num_frames(22) = round(22 / 24 x 40) = 37, the model's
    audio_frames(7 latent frames) -- equal to the pipeline's recipe on the clip's window of sound (PyAV-resampled
    32 kHz stereo, 37 x 800 samples): the mono VAE's posterior mean of each channel, normalised; each clip its own
    sound; the audio VAE recorded."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

    from ringdit.models.diffusers.minimax_h3 import audio_frames

    root, audio_vae, clips = minimax
    assert prepare(root, clips, tmp_path / "out").samples == 4
    tensors, metadata = read_prepared(tmp_path / "out" / "shard-00000.safetensors")
    length = audio_latent_num_frames(FRAMES)
    assert length == audio_frames(7) == 37
    assert tensors["latents"].shape == (4, 4, 7, 4, 4) and tensors["audio"].shape == (4, 2, length, 8)
    assert tensors["text"].shape == (4, 8, 16) and json.loads(metadata["text_encoder"])["prompt_template"] == \
        "minimax_h3"
    recorded = json.loads(metadata["audio_vae"])
    assert (recorded["class"], recorded["sample_rate"], recorded["hop_length"]) == ("AutoencoderKLMiniMaxH3Audio",
                                                                                    32000, 800)
    clip = sorted(clips.glob("*.mp4"))[1]
    wave = read_waveform(clip, 0.0, length * 800 / 32000, 32000, 2)  # (2, 29600)
    with torch.no_grad():  # MiniMaxH3ModularPipeline's reference-soundtrack encode (its ref2va condition step)
        latents = audio_vae.encode(wave[:, None], return_dict=False)[0].mode().float().transpose(1, 2)  # (2, 37, 8)
    expected = (latents - torch.tensor(AUDIO_MEAN).view(1, 1, -1)) / torch.tensor(AUDIO_STD).view(1, 1, -1)
    torch.testing.assert_close(tensors["audio"][1], expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(tensors["audio"][0], tensors["audio"][1])  # each clip's own sound


def test_prepared_shards_train_minimax_h3_tiny_through_train_py(minimax, tmp_path):
    """The prepared folder trains model=minimax_h3_tiny for 2 steps (video and audio denoised together in one packed
    sequence), in this process: two finite losses logged."""
    root, _, clips = minimax
    prepare(root, clips, tmp_path / "data")
    run("train.py", tmp_path / "run", "model=minimax_h3_tiny", "data=text_latents", f"data.path={tmp_path / 'data'}",
        "data.batch_size=2", "data.val_fraction=0", "trainer.max_steps=2", "logger=csv", "callbacks=none",
        "trainer.log_every_n_steps=1")
    losses = logged_losses(tmp_path / "run")
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses.values()), losses


def test_audio_of_another_latent_rate_is_refused_before_any_rank_and_the_advice_works(minimax, tmp_path):
    """Shards whose sound an audio VAE at 16 kHz encoded (20 latents a second) for MiniMax-H3 (40): one line naming the
    data, the rates and the advice, from train.py's checks before any rank starts; prepared again with the model's
    own 32 kHz audio VAE (the advice), the same model takes them."""
    root, _, clips = minimax
    other = tmp_path / "MiniMax-H3-16k"
    shutil.copytree(root, other, ignore=shutil.ignore_patterns("audio_vae"))
    tiny_audio_vae(other / "audio_vae", sampling_rate=16000)
    prepare(other, clips, tmp_path / "data16")
    common = ["model=minimax_h3_tiny", "data=text_latents", "data.batch_size=2", "data.val_fraction=0"]
    with pytest.raises(ValueError) as raised:
        prepare_train([*common, f"data.path={tmp_path / 'data16'}"], tmp_path / "refused")
    message = f"{raised.value} {raised.value.__cause__}"
    assert re.search(r"data16: the audio latents were encoded by AutoencoderKLMiniMaxH3Audio at 16000 Hz \(20 "
                     r"latents a second.*at 40 latents a second.*audio VAE of the model's own pipeline", message), message
    prepare(root, clips, tmp_path / "data32")
    prepare_train([*common, f"data.path={tmp_path / 'data32'}", "logger=none"], tmp_path / "run")
