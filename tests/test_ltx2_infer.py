"""LTX-2 end to end on the sampling side: a tiny LTX-2 trained one step on synthetic video + audio latents previews
its samples with their sound (MP4s with an AAC track, in samples/ and in wandb), infer.py samples video and audio
together and writes each MP4 with its sound track and the audio latents in samples.npz, and an audio VAE of another
sample rate is refused in one line before anything starts (its advice, the model's own audio VAE, samples). The
audio VAE and vocoder are tiny random diffusers ``AutoencoderKLLTX2Audio`` / ``LTX2Vocoder`` in an LTX-2 pipeline
folder's layout (vae/, audio_vae/, vocoder/)."""

from __future__ import annotations

import os
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from tests.helpers import assert_refused, fail_fast, run
from tests.ltx2_helpers import save_ltx2_video_vae

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RUN = ["model=ltx2_tiny", "data=synthetic_text_latents", "data.audio=[2,5,2]", "data.num_samples=8",
       "data.batch_size=4", "trainer.max_steps=1", "scheduler=constant", "optimizer=sgd", "optimizer.lr=0.1"]


def save_audio_decoder(folder: Path, sample_rate: int) -> Path:
    """audio_vae/ and vocoder/ of an LTX-2 pipeline folder: the audio VAE of diffusers' LTX-2 pipeline tests (2 latent
    channels x 8 / 4 = 2 mel bins: ltx2_tiny's audio_in_channels 4) at ``sample_rate``, and a vocoder of its mel bins."""
    import diffusers
    from diffusers.pipelines.ltx2 import LTX2Vocoder

    torch.manual_seed(0)
    diffusers.AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=sample_rate, mel_hop_length=160, is_causal=True, mel_bins=8,
    ).save_pretrained(folder / "audio_vae")
    LTX2Vocoder(in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                output_sampling_rate=sample_rate).save_pretrained(folder / "vocoder")
    return folder


@pytest.fixture(scope="module")
def ltx2_folders(tmp_path_factory) -> dict[str, Path]:
    """An LTX-2 pipeline-shaped folder (the tiny video VAE of diffusers' LTX-2 tests: 4 latent channels, 2x; its
    16 kHz audio VAE and vocoder) and one whose audio VAE works at 24 kHz."""
    root = tmp_path_factory.mktemp("ltx2")
    save_ltx2_video_vae(root / "ltx2" / "vae")
    return {"ltx2": save_audio_decoder(root / "ltx2", 16000), "other": save_audio_decoder(root / "other", 24000)}


def sound_of(video: Path) -> tuple[int, str, int]:
    """(video frames, the audio codec, its sample rate) of an MP4; a ValueError when it has no sound track."""
    with av.open(str(video)) as container:
        if not container.streams.audio:
            raise ValueError(f"{video} has no audio track")
        audio = container.streams.audio[0]
        frames = sum(1 for _ in container.decode(video=0))
        return frames, audio.codec_context.name, audio.rate


@pytest.fixture(scope="module")
def trained(ltx2_folders, tmp_path_factory) -> Path:
    """One SGD step, previewed at it (2 sampler steps, 1 sample a prompt) with the sound, logged to wandb."""
    run_dir = tmp_path_factory.mktemp("ltx2_run")
    folder = ltx2_folders["ltx2"]
    run("train.py", run_dir, *RUN, "logger=wandb", "callbacks.sample_grid.every_n_steps=1",
        "callbacks.sample_grid.per_class=1", "callbacks.sample_grid.max_classes=2", "callbacks.sample_grid.steps=2",
        f"callbacks.sample_grid.vae={folder}", f"callbacks.sample_grid.audio_vae={folder}")
    return run_dir


def test_previews_carry_their_sound_locally_and_in_wandb(trained):
    local = sorted((trained / "samples" / "step_0000001").glob("*.mp4"))
    logged = sorted(trained.glob("wandb/offline-run-*/files/media/videos/*.mp4"))
    assert len(local) == 2 and len(logged) == 2, (local, logged)
    for video in local + logged:  # 3 latent frames: 5 video frames through the 2x VAE
        assert sound_of(video) == (5, "aac", 16000), video


def test_infer_writes_each_video_with_its_sound_and_the_audio_latents(trained, ltx2_folders, tmp_path):
    folder = ltx2_folders["ltx2"]
    ckpt = trained / "checkpoints" / "last.ckpt"
    run("infer.py", tmp_path, f"ckpt_path={ckpt}", "num_samples=2", "diffusion.sampling.steps=2",
        "diffusion.sampling.cfg_scale=2", f"vae={folder}", f"audio_vae={folder}")
    with np.load(tmp_path / "samples.npz") as stored:
        latents, audio = stored["latents"], stored["audio"]
    assert latents.shape == (2, 4, 3, 8, 8) and audio.shape[:2] == (2, 1) and audio.shape[3] == 4
    assert np.isfinite(audio).all() and np.abs(audio).max() > 0
    for i in range(2):
        assert sound_of(tmp_path / f"sample-{i:03d}.mp4") == (5, "aac", 16000)
    # decoded again later, as python -m ringdit.media.decode does, with the sound
    from ringdit.common.errors import ConfigError
    from ringdit.media.decode import decode_samples
    from ringdit.media.decode import main as decode

    decode([str(tmp_path / "samples.npz"), f"vae={folder}", f"audio_vae={folder}", f"out={tmp_path / 'later'}",
            f"hydra.run.dir={tmp_path / 'decode'}"])
    assert sound_of(tmp_path / "later" / "sample-001.mp4") == (5, "aac", 16000)
    np.savez(tmp_path / "silent.npz", latents=latents)  # a model without sound: nothing for audio_vae= to decode
    with pytest.raises(ConfigError, match=r"audio_vae=.*: samples=.*silent.npz holds no 'audio' latents \(its model "
                                          r"samples no sound\); drop audio_vae="):
        decode_samples(tmp_path / "silent.npz", folder, audio_vae=folder)


def test_an_audio_vae_of_another_sample_rate_is_refused_before_anything_starts(trained, ltx2_folders, tmp_path):
    other, folder = ltx2_folders["other"], ltx2_folders["ltx2"]
    ckpt = trained / "checkpoints" / "last.ckpt"
    proc, seconds = fail_fast("infer.py", f"ckpt_path={ckpt}", f"vae={folder}", f"audio_vae={other}",
                              f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, rf"audio_vae={other}: the audio VAE works at 24000 Hz with a mel hop of 160, the model's "
                         rf"audio at 16000 Hz .*; use the audio VAE of the model's own pipeline", seconds=seconds)
    # the previews' audio VAE, refused by train.py before any rank starts
    proc, seconds = fail_fast("train.py", *RUN, f"callbacks.sample_grid.audio_vae={other}",
                              f"hydra.run.dir={tmp_path / 'train_refused'}")
    assert_refused(proc, rf"callbacks.sample_grid.audio_vae={other}: the audio VAE works at 24000 Hz", seconds=seconds)
    # the advice: the model's own pipeline's audio VAE (trained() previews with it, and it samples here)
    proc, _ = fail_fast("infer.py", f"ckpt_path={ckpt}", f"vae={folder}", f"audio_vae={folder}",
                        "num_samples=1", "diffusion.sampling.steps=1", f"hydra.run.dir={tmp_path / 'advice'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sound_of(tmp_path / "advice" / "sample-000.mp4")[1:] == ("aac", 16000)


def test_the_server_answers_videos_with_their_sound_as_infer_writes_them(trained, ltx2_folders, models, tmp_path):
    """POST /v1/videos on the served LTX-2 (prompts encoded by a tiny T5 of the data's 16-dim text): the MP4 has the
    AAC track, and its frames equal infer.py's for the same prompt and seed (one writer: ``write_sample``)."""
    import httpx

    from tests.serving import AUTH, KEY, finished_video, serving, video_frames

    folder = ltx2_folders["ltx2"]
    common = [f"ckpt_path={trained / 'checkpoints' / 'last.ckpt'}", f"vae={folder}", f"audio_vae={folder}",
              f"text_encoder={models['wan']}", "diffusion.sampling.steps=2"]
    run("infer.py", tmp_path / "infer", *common, "prompts=[a red fox]", "num_samples=1", "seed=4")
    with serving(tmp_path / "serve", *common, f"api_key={KEY}") as server:
        job = httpx.post(server.url + "/v1/videos", json={"prompt": "a red fox", "seed": 4}, headers=AUTH).json()
        content = finished_video(server.url, job["id"], headers=AUTH)
    (tmp_path / "served.mp4").write_bytes(content)
    assert sound_of(tmp_path / "served.mp4") == (5, "aac", 16000)
    np.testing.assert_array_equal(video_frames(content), video_frames(tmp_path / "infer" / "sample-000.mp4"))
