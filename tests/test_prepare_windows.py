"""``python -m ringdit.prepare frame_extraction=... source_fps=...``: which frames of a clip become samples
(ringdit/media/windows.py), checked against musubi-tuner's documented windows and against encoding the same frames
directly."""

from __future__ import annotations

import json
import os
from fractions import Fraction

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("av")


from ringdit.common.errors import ConfigError  # noqa: E402
from ringdit.media.encode_folder import encode_folder  # noqa: E402
from ringdit.media.frames import read_frames  # noqa: E402
from ringdit.media.vae import VAE  # noqa: E402
from ringdit.media.windows import Extraction, Timeline, extraction, timeline  # noqa: E402
from tests.helpers import TEXT_LEN, fail_fast, write_video  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"


def test_windows_are_musubi_tuners():
    """musubi-tuner's dataset_config.md diagrams, a 40-frame clip: chunk 13 -> 0, 13, 26; slide stride 10 -> 0, 10,
    20 (13 frames) and 0, 10 (25); uniform 4 -> 0, 9, 18, 27 (13) and 0, 5, 10, 15 (25); head / full: 0."""
    assert Extraction("chunk").starts(40, 13) == [0, 13, 26]
    assert Extraction("chunk").starts(40, 25) == [0]
    assert Extraction("slide", window_stride=10).starts(40, 13) == [0, 10, 20]
    assert Extraction("slide", window_stride=10).starts(40, 25) == [0, 10]
    assert Extraction("uniform", frame_sample=4).starts(40, 13) == [0, 9, 18, 27]
    assert Extraction("uniform", frame_sample=4).starts(40, 25) == [0, 5, 10, 15]
    assert Extraction("uniform", frame_sample=1).starts(40, 13) == [0]
    assert Extraction("head").starts(40, 13) == Extraction("full").starts(40, 13) == [0]
    for mode in ("head", "chunk", "uniform"):
        assert Extraction(mode, frame_sample=3).starts(12, 13) == []  # no window fits


def test_source_fps_resamples_by_time():
    """Timeline frame t is the source frame nearest to t / fps seconds: 30 -> 16 fps takes 0, 2, 4, 6, 8, 9, 11, ...
    (every 1.875 frames), 8 -> 16 shows each frame twice, 29.97 is exact; frame_stride strides the resampled clip;
    the length counts the timeline frames whose source frame exists."""
    down = Timeline(1, Fraction(30), 16)
    assert down.indices(0, 9) == [0, 2, 4, 6, 8, 9, 11, 13, 15]  # floor(t * 15 / 8 + 1/2)
    assert down.length(30) == 16 and down.source_index(15) == 28 and down.source_index(16) == 30
    up = Timeline(1, Fraction(8), 16)
    assert up.indices(0, 6) == [0, 1, 1, 2, 2, 3] and up.length(3) == 5  # t = 0..4 -> 0, 1, 1, 2, 2
    assert Timeline(2, Fraction(32), 16).indices(1, 3) == [4, 8, 12]
    assert Timeline(3).indices(2, 3) == [6, 9, 12] and Timeline(3).length(10) == 4  # 0, 3, 6, 9 as before
    ntsc = timeline(1, 29.97, None, 24, "vae")
    assert ntsc.step == Fraction(2997, 2400) and ntsc.source_index(2400) == 2997  # no drift after 100 s


@pytest.mark.parametrize("settings, message", [
    (dict(frame_extraction="middle"), r"frame_extraction='middle' is not one of head, chunk, slide, uniform, full"),
    (dict(frame_extraction="slide"), r"window_stride=None must be a positive whole number"),
    (dict(frame_extraction="slide", window_stride=0), r"window_stride=0 must be a positive whole number"),
    (dict(frame_extraction="uniform", frame_sample=-2), r"frame_sample=-2 must be a positive whole number"),
    (dict(frame_extraction="head", frame_sample=2), r"frame_sample=2 is frame_extraction=uniform's windows"),
    (dict(frame_extraction="chunk", window_stride=2), r"window_stride=2 is the step between frame_extraction=slide"),
    (dict(frame_extraction="full", bucketed=False), r"frame_extraction=full takes each clip whole"),
])
def test_extraction_errors_name_the_setting(settings, message):
    arguments = dict(frame_extraction="head", window_stride=None, frame_sample=None, bucketed=True) | settings
    with pytest.raises(ConfigError, match=message):
        extraction(**arguments)


@pytest.mark.parametrize("source_fps", [0, -30, "nan", "inf", "fast", True])
def test_source_fps_not_positive_is_one_line(source_fps):
    with pytest.raises(ConfigError, match=rf"source_fps={source_fps!r} must be the clips' frame rate, a positive "):
        timeline(1, source_fps, 16, None, "vae")


def test_fps_is_needed_where_the_vae_does_not_tell():
    with pytest.raises(ConfigError, match=r"source_fps=30 resamples .* pass fps=<the model's rate>"):
        timeline(1, 30, None, None, "some/vae")
    with pytest.raises(ConfigError, match=r"fps=16 is the model's frame rate that source_fps resamples"):
        timeline(1, None, 16, None, "some/vae")
    assert timeline(1, 30, 16, None, "some/vae").fps == 16  # the advice, followed


@pytest.fixture
def clips(tmp_path):
    """Two captioned clips: a 13-frame one and a 4-frame one."""
    folder = tmp_path / "clips"
    folder.mkdir()
    write_video(folder / "long.mp4", 13, seed=1)
    (folder / "long.txt").write_text("a red fox running")
    write_video(folder / "short.mp4", 4, seed=2)
    (folder / "short.txt").write_text("a blue cat")
    return folder


def shard(path):
    from tests.helpers import read_prepared

    return read_prepared(path)


def test_chunk_windows_and_source_fps_encode_those_frames(models, clips, tmp_path):
    """frame_extraction=chunk with frames=5: the 13-frame clip is 2 samples (frames 0-4 and 5-9, same caption), the
    4-frame clip is too short (skipped, counted); with source_fps=16 -> fps=8 the windows are of every other frame.
    Each sample's latents are the VAE's of exactly those frames."""
    vae = VAE(models["wan"])
    frames = read_frames(clips / "long.mp4", 16, 24, list(range(13)))  # (3, 13, H, W): every frame, as prepare fits

    def encoded(indices):
        return vae.encode(frames[:, indices][None])[0]

    settings = dict(size=[16, 24], frames=5, max_text_len=TEXT_LEN, progress=False)
    report = encode_folder(str(clips), str(tmp_path / "chunk"), str(models["wan"]), str(models["wan"]),
                           frame_extraction="chunk", **settings)
    assert report.samples == 2 and report.too_short == [str(clips / "short.mp4")]
    tensors, metadata = shard(tmp_path / "chunk" / "shard-00000.safetensors")
    assert json.loads(metadata["captions"]) == ["a red fox running"] * 2
    assert json.loads(metadata["bucket"])["starts"] == [0, 5]
    torch.testing.assert_close(tensors["latents"][0], encoded(list(range(5))), rtol=0, atol=0)
    torch.testing.assert_close(tensors["latents"][1], encoded(list(range(5, 10))), rtol=0, atol=0)

    with pytest.raises(ConfigError, match=r"shard-00000.safetensors was prepared with frame_extraction=chunk, but now "
                                          r"frame_extraction=head: its latents are other frames; resume with the "):
        encode_folder(str(clips), str(tmp_path / "chunk"), str(models["wan"]), str(models["wan"]), **settings)

    report = encode_folder(str(clips), str(tmp_path / "fps"), str(models["wan"]), str(models["wan"]),
                           frame_extraction="uniform", frame_sample=2, source_fps=16, fps=8, **settings)
    tensors, metadata = shard(tmp_path / "fps" / "shard-00000.safetensors")
    bucket = json.loads(metadata["bucket"])
    assert (bucket["source_fps"], bucket["fps"], bucket["starts"]) == (16.0, 8, [0, 2])  # 7 timeline frames: 0, 2
    torch.testing.assert_close(tensors["latents"][0], encoded([0, 2, 4, 6, 8]), rtol=0, atol=0)
    torch.testing.assert_close(tensors["latents"][1], encoded([4, 6, 8, 10, 12]), rtol=0, atol=0)


def test_slide_with_buckets_and_the_plan(models, clips, tmp_path):
    """With buckets each clip's windows are its bucket's frame count long (the longest it has: 9 of 13, 1 of 4 with
    frame_buckets=[1, 5, 9]); slide by 2 gives the 13-frame clip windows at 0, 2, 4; buckets.json lists each window."""
    report = encode_folder(str(clips), str(tmp_path / "out"), str(models["wan"]), str(models["wan"]), size=16,
                           frames=9, buckets="auto", frame_buckets=[1, 5, 9], frame_extraction="slide",
                           window_stride=2, max_text_len=TEXT_LEN, progress=False)
    assert report.buckets == {"16x16x1": 2, "16x16x9": 3}  # the 4-frame clip: two 1-frame windows
    plan = json.loads((tmp_path / "out" / "buckets.json").read_text())
    assert [s["files"] for s in plan["shards"]] == [["short.mp4", "short.mp4@2"],
                                                   ["long.mp4", "long.mp4@2", "long.mp4@4"]]


def test_a_window_longer_than_every_clip_is_one_line(models, clips, tmp_path):
    """frames=17 over clips of 13 and 4 frames: exit code 2 and one line naming frames=; its advice (frames=1)
    prepares."""
    common = [f"input={clips}", f"vae={models['wan']}", f"text_encoder={models['wan']}", "size=16",
              f"max_text_len={TEXT_LEN}"]
    result, _ = fail_fast("-m ringdit.prepare", *common, f"out={tmp_path / 'a'}", "frames=17")
    assert result.returncode == 2, result.stderr
    line = next(line for line in result.stderr.splitlines() if line.startswith("Error: "))
    assert "frames=17: the window is longer than every clip" in line and "e.g. frames=1" in line
    result, _ = fail_fast("-m ringdit.prepare", *common, f"out={tmp_path / 'b'}", "frames=1")
    assert result.returncode == 0, result.stderr
    result, _ = fail_fast("-m ringdit.prepare", *common, f"out={tmp_path / 'c'}", "source_fps=0")
    assert result.returncode == 2 and "source_fps=0 must be the clips' frame rate" in result.stderr


def test_the_models_fps_from_the_vaes_pipeline_folder(tmp_path):
    """fps=null: the rate of the family whose transformer model_index.json names (Wan 2.1 16; Wan 2.2 TI2V-5B, the
    same class with expand_timesteps, 24; HunyuanVideo 1.5 24), from the pipeline folder or its vae/; an image
    model's folder tells none."""
    from ringdit.media.windows import pipeline_fps

    (tmp_path / "vae").mkdir()
    for index, rate in (({"transformer": ["diffusers", "WanTransformer3DModel"]}, 16),
                        ({"transformer": ["diffusers", "WanTransformer3DModel"], "expand_timesteps": True}, 24),
                        ({"transformer": ["diffusers", "HunyuanVideo15Transformer3DModel"]}, 24),
                        ({"transformer": ["diffusers", "FluxTransformer2DModel"]}, None)):
        (tmp_path / "model_index.json").write_text(json.dumps(index))
        assert pipeline_fps(str(tmp_path), "vae") == pipeline_fps(str(tmp_path / "vae"), None) == rate
    assert timeline(1, 30, None, pipeline_fps(str(tmp_path / "vae"), None) or 16, "vae").fps == 16
