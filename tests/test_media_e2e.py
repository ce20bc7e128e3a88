"""Captioned videos -> ``ringdit.prepare`` -> ``train.py model=wan_tiny data=text_latents`` -> ``infer.py prompts=``:
the prompts are encoded with the data's text encoder and the samples decoded with the data's VAE (both found from
the checkpoint), written as MP4 + GIF beside samples.npz. Tiny random models, nothing downloaded."""

from __future__ import annotations

import numpy as np
import pytest

from ringdit.media.encode_folder import encode_folder
from tests.helpers import TEXT_LEN, read_mp4, run, write_video

CAPTIONS = ["a red fox running", "a blue cat", "green field", "a red sky"]


@pytest.mark.timeout(900)  # three stages, two of them new processes importing diffusers
def test_prepare_train_and_sample_from_prompts(models, tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    for i in range(8):
        write_video(clips / f"{i}.mp4", 5, seed=i, size=(40, 32))
        (clips / f"{i}.txt").write_text(CAPTIONS[i % 4])
    data = tmp_path / "data"
    report = encode_folder(str(clips), str(data), str(models["wan"]), str(models["wan"]), size=32, frames=5,
                           max_text_len=TEXT_LEN, shard_size=4, progress=False)
    assert report.samples == 8 and report.shards_written == 2

    env = {"HF_HUB_OFFLINE": "1"}
    run("train.py", tmp_path / "run", "experiment=wan_tiny", "data=text_latents", f"data.path={data}",
        "model.config.in_channels=16", "model.config.out_channels=16",  # the tiny Wan VAE's z_dim
        "data.batch_size=4", "data.val_fraction=0.25", "trainer.max_steps=2", "logger=csv", "scheduler=constant",
        "callbacks.model_checkpoint.every_n_train_steps=2", "trainer.val_check_interval=2",
        "callbacks.sample_grid.steps=2", "callbacks.sample_grid.per_class=1", env=env)
    out = tmp_path / "infer"
    run("infer.py", out, f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}", "num_samples=3",
        "diffusion.sampling.steps=2", "prompts=['a red fox running','a blue cat']", "negative_prompt=sky", env=env)

    samples = np.load(out / "samples.npz")
    assert samples["latents"].shape == (3, 16, 2, 4, 4)  # (N, C, 1 + (5 - 1) / 4, 32 / 8, 32 / 8)
    assert list(samples["captions"]) == ["a red fox running", "a blue cat", "a red fox running"]
    assert read_mp4(out / "sample-002.mp4").shape == (5, 32, 32, 3)
    assert (out / "sample-000.gif").is_file() and (out / "samples.gif").is_file()
