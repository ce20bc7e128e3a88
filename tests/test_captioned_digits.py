"""The text-to-video demo's data (``data=captioned_moving_digits``): captions that say what the video shows, a text
encoder built and saved beside the data that reproduces the stored embeddings, and the whole path end to end --
``train.py experiment=captioned_moving_digits``, then ``infer.py prompts=[...]`` from the newest run, with videos
written as GIF and MP4."""

from __future__ import annotations

import importlib.util
import threading

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ringdit.data.captioned_moving_digits import (DIRECTIONS, CaptionedMovingDigits, CaptionedMovingDigitsDataModule,
                                                  build_once, parse_caption)
from ringdit.common.errors import ConfigError
from ringdit.media.text import TextEncoder
from tests.helpers import REPO, read_mp4, run


def judge():
    """benchmarks/digits_accuracy.py, the demo's judge (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("digits_accuracy", REPO / "benchmarks" / "digits_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_video_shows_its_caption():
    videos = CaptionedMovingDigits(200, frames=5, canvas=12, seed=3)
    direction_of = judge().direction_of
    seen = set()
    for i in range(len(videos)):
        digit, glyph, direction, corners = videos.described_motion(i)
        assert parse_caption(videos.caption(i)) == (digit, direction)
        video = (videos[i][0][0].numpy() + 1) / 2  # (T, H, W) in [0, 1]
        for frame, (row, col) in zip(video, corners):  # the whole glyph, where the motion says, nothing else
            assert np.array_equal(frame[row:row + 8, col:col + 8], videos.glyphs[glyph])
            assert frame.sum() == pytest.approx(videos.glyphs[glyph].sum())
        step = np.diff(corners, axis=0)  # (T - 1, 2): one pixel a frame (12 - 8 = 4 over 4 steps) that way
        assert (step == np.array(DIRECTIONS[direction])).all()
        assert direction_of(video) == direction  # the judge reads the direction from the pixels alone
        seen.add((digit, direction))
    assert len(seen) == 40  # every digit in every direction
    assert parse_caption("a red fox") is None and parse_caption("a 3 moving sideways") is None


def test_the_saved_text_encoder_reproduces_the_stored_embeddings(tmp_path):
    data = CaptionedMovingDigitsDataModule(str(tmp_path / "a"), num_videos=24, frames=5, canvas=12)
    info = data.describe()
    assert "latent_scale" not in info and info["channels"] == 1 and info["image_size"] == [5, 12, 12]
    shard = load_file(info["source"]["path"])
    captions = data.captions()
    encoder = TextEncoder(info["text_encoder"]["path"], info["text_encoder"]["tokenizer"],
                          max_len=info["text_encoder"]["max_len"])
    encoded = encoder(captions)
    assert torch.equal(encoded["text"], shard["text"]) and torch.equal(encoded["text_mask"], shard["text_mask"])
    assert encoded["text_mask"].sum(1).tolist() == [5] * len(captions)  # "a 3 moving left </s>"
    assert torch.equal(encoder([""])["text"], shard["null_text"])
    # seeded: another cache folder builds the same encoder; different words give different embeddings
    again = CaptionedMovingDigitsDataModule(str(tmp_path / "b"), num_videos=24, frames=5, canvas=12)
    assert torch.equal(load_file(again.describe()["source"]["path"])["text"], shard["text"])
    three, seven = encoder(["a 3 moving left", "a 7 moving left"])["text"]
    assert (three - seven).abs().max() > 0.1


@pytest.mark.parametrize("setting, message", [
    ({"canvas": 10, "frames": 5}, "data.canvas=10 leaves 2 pixels to move in but 5 frames need 4; use data.canvas >= 12"),
    ({"text_len": 4}, "data.text_len=4 cuts the captions"),
    ({"num_videos": 0}, "data.num_videos must be a positive integer, got 0"),
    ({"frames": 2.5}, "data.frames must be a positive integer, got 2.5"),
])
def test_bad_settings_are_named(tmp_path, setting, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CaptionedMovingDigitsDataModule(str(tmp_path), **setting)
    assert not any(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.timeout(600)
def test_train_then_sample_videos_from_prompts(tmp_path):
    logs = tmp_path / "outputs"
    tiny = ["data.num_videos=32", "model.config.num_layers=1", "model.config.ffn_dim=32", "trainer.max_steps=2",
            "logger=csv", "scheduler=constant", "callbacks.model_checkpoint.every_n_train_steps=2",
            "trainer.val_check_interval=2", "callbacks.sample_grid.steps=2", "callbacks.sample_grid.per_class=1",
            "callbacks.sample_grid.max_classes=2"]
    env = {"HF_HUB_OFFLINE": "1"}
    train_dir = logs / "train" / "runs" / "demo"
    run("train.py", train_dir, "experiment=captioned_moving_digits", f"paths.log_dir={logs}", *tiny, env=env)
    preview = train_dir / "samples" / "step_0000002.gif"  # the held-out prompts' preview grid
    assert iio.imread(preview).shape[0] == 5  # frames

    out = tmp_path / "infer"  # no ckpt_path: the newest run under paths.log_dir
    run("infer.py", out, f"paths.log_dir={logs}", "num_samples=3", "diffusion.sampling.steps=2",
        "prompts=['a 3 moving left','a 7 moving down']", env=env)
    samples = np.load(out / "samples.npz")
    assert samples["images"].shape == (3, 5, 12, 12, 1) and samples["images"].dtype == np.uint8
    assert list(samples["captions"]) == ["a 3 moving left", "a 7 moving down", "a 3 moving left"]
    assert read_mp4(out / "sample-001.mp4").shape == (5, 12, 12, 3)
    assert (out / "sample-002.gif").is_file() and (out / "samples.gif").is_file()


def test_two_processes_building_the_same_set_at_once_both_get_it(tmp_path):
    """Two runs (or two test workers) starting on an unbuilt cache at once: each builds in a folder of its own, the
    first rename wins, the second drops its copy -- neither writes into the other's folder or deletes its result."""
    folder = tmp_path / "cache" / "captioned_moving_digits-x"
    both_building = threading.Barrier(2)
    errors = []

    def build(partial):
        (partial / "videos.safetensors").write_text(threading.current_thread().name)
        both_building.wait(timeout=30)  # both are mid-build before either renames

    def run_one():
        try:
            build_once(folder, build)
        except Exception as error:  # noqa: BLE001 -- collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=run_one, name=f"build{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert (folder / "videos.safetensors").read_text() in {"build0", "build1"}
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no temporary folder left


def test_a_foreign_folder_in_the_way_is_named_and_its_advice_works(tmp_path):
    name = "captioned_moving_digits-num_videos24-frames5-canvas12-text_len8-text_dim32-seed0"
    (tmp_path / name).mkdir()
    (tmp_path / name / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=f"{name} exists without its videos.safetensors; remove it and run again"):
        CaptionedMovingDigitsDataModule(str(tmp_path), num_videos=24, frames=5, canvas=12)
    assert (tmp_path / name / "notes.txt").read_text() == "mine"  # not deleted
    assert [p.name for p in tmp_path.iterdir()] == [name]  # the refused build left nothing
    (tmp_path / name / "notes.txt").unlink()
    (tmp_path / name).rmdir()  # the advice
    assert CaptionedMovingDigitsDataModule(str(tmp_path), num_videos=24, frames=5, canvas=12).describe()
