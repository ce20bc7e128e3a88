"""Something to look at while a model trains and after it samples: latent models preview through their VAE, videos
reach wandb as MP4 files (one per sample, captioned), and ``infer.py logger=wandb`` logs what it wrote. wandb runs
offline here: the files it would upload are checked in its run folder, and PyAV decodes each video."""

from __future__ import annotations

from pathlib import Path

import av
import pytest

from tests.helpers import TINY, assert_refused, fail_fast, run


def wandb_videos(run_dir: Path) -> list[Path]:
    """The MP4 files an offline wandb run under ``run_dir`` holds for upload."""
    return sorted(run_dir.glob("wandb/offline-run-*/files/media/videos/*.mp4"))


def frames_of(video: Path) -> int:
    with av.open(str(video)) as container:
        return sum(1 for _ in container.decode(video=0))


@pytest.fixture(scope="module")
def latent_run(models, tmp_path_factory) -> Path:
    """A tiny Wan on 16-channel latents (3 latent frames: 9 video frames through the tiny Wan VAE), previewed at its
    only step with logger=wandb."""
    run_dir = tmp_path_factory.mktemp("latent_preview")
    run("train.py", run_dir, "experiment=wan_tiny", "data.num_samples=16", "data.channels=16", "data.batch_size=2",
        "model.config.in_channels=16", "model.config.out_channels=16", "trainer.max_steps=1", "logger=wandb",
        "callbacks.sample_grid.every_n_steps=1", "callbacks.sample_grid.per_class=1", "callbacks.sample_grid.steps=2",
        f"callbacks.sample_grid.vae={models['wan']}")
    return run_dir


def test_a_latent_model_previews_through_its_vae_as_videos_in_wandb(latent_run):
    """Each held-out prompt's preview is decoded by the VAE and logged as an MP4 of the decoded frame count."""
    videos = wandb_videos(latent_run)
    assert videos and all(frames_of(video) == 9 for video in videos)
    local = sorted((latent_run / "samples").glob("step_0000001/*.mp4"))
    assert len(local) == len(videos) and (latent_run / "samples" / "step_0000001.gif").exists()


def test_infer_logs_its_decoded_samples_to_wandb(latent_run, models, tmp_path):
    run("infer.py", tmp_path, f"ckpt_path={latent_run / 'checkpoints' / 'last.ckpt'}", "num_samples=2",
        "diffusion.sampling.steps=2",
        f"vae={models['wan']}", "logger=wandb")
    videos = wandb_videos(tmp_path)
    assert len(videos) == 2 and all(frames_of(video) == 9 for video in videos)
    proc, seconds = fail_fast("infer.py", f"ckpt_path={latent_run / 'checkpoints' / 'last.ckpt'}", "logger=csv",
                              f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, r"logger=csv: infer.py logs its samples to wandb only; use logger=wandb or logger=none",
                   seconds=seconds)


def test_pixel_videos_are_logged_as_videos(tmp_path):
    """Moving digits (pixel-space videos): each preview an MP4 of the data's frame count, not its first frame."""
    run("train.py", tmp_path, *TINY, "experiment=moving_digits", "model.hidden_size=32", "model.depth=1",
        "data.batch_size=4", "trainer.max_steps=1", "logger=wandb", "callbacks.sample_grid.every_n_steps=1",
        "callbacks.sample_grid.per_class=1")
    videos = wandb_videos(tmp_path)
    assert videos and all(frames_of(video) == 8 for video in videos)
