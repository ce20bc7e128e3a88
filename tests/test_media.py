"""ringdit.media and ``python -m ringdit.prepare`` with tiny random VAEs and text encoders built from config (no
downloads): what lands in the shards is checked against encoding the same pixels and prompts directly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("imageio")

from PIL import Image  # noqa: E402

from ringdit.data.text_latents import TextLatentsDataModule  # noqa: E402
from ringdit.common.errors import ConfigError  # noqa: E402
from ringdit.media.encode_folder import encode_folder  # noqa: E402
from ringdit.media.frames import fit, read_image, read_video  # noqa: E402
from ringdit.media.text import TextEncoder  # noqa: E402
from ringdit.media.vae import VAE  # noqa: E402
from tests.helpers import TEXT_LEN, fail_fast, write_video

os.environ["HF_HUB_OFFLINE"] = "1"
REPO = Path(__file__).resolve().parents[1]


def colour_image(seed: int, size=(40, 24)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture
def image_folder(tmp_path) -> Path:
    """Four captioned PNGs (sidecar .txt) and one corrupt PNG with a caption."""
    folder = tmp_path / "images"
    folder.mkdir()
    for i, caption in enumerate(["a red fox", "a blue cat running", "green field", "a red sky"]):
        colour_image(i).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(caption + "\n")
    (folder / "img9.png").write_bytes(b"not a png at all")
    (folder / "img9.txt").write_text("a broken file")
    return folder


@pytest.fixture
def video_folder(tmp_path) -> Path:
    """Two MP4s long enough for 5 frames at stride 2, one too short, captions in metadata.jsonl (``caption``)."""
    folder = tmp_path / "videos"
    (folder / "clips").mkdir(parents=True)
    write_video(folder / "clips" / "a.mp4", 10, seed=1)
    write_video(folder / "clips" / "b.mp4", 12, seed=2)
    write_video(folder / "clips" / "short.mp4", 4, seed=3)
    rows = [{"file_name": "clips/a.mp4", "caption": "a red fox running"},
            {"file_name": "clips/b.mp4", "caption": "a blue cat"},
            {"file_name": "clips/short.mp4", "caption": "sky"}]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def read_shard(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from tests.helpers import read_prepared

    return read_prepared(path)


def test_prepare_images_with_sidecar_captions(models, image_folder, tmp_path):
    """Shards hold exactly the normalised VAE latents and masked text states of each file; the corrupt file is
    skipped and counted; the result loads as data=text_latents."""
    out = tmp_path / "out"
    report = encode_folder(str(image_folder), str(out), str(models["flux"]), str(models["flux"]), size=16,
                           max_text_len=TEXT_LEN, shard_size=2, batch_size=2, progress=False)
    assert report.unreadable == [str(image_folder / "img9.png")] and report.too_short == []
    assert report.samples == 4 and report.shards_written == 2  # shard 2 held only img9: not written
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert sorted(p.name for p in (out / "text").iterdir()) == ["shard-00000.safetensors", "shard-00001.safetensors"]

    tensors, metadata = read_shard(out / "shard-00000.safetensors")
    assert json.loads(metadata["captions"]) == ["a red fox", "a blue cat running"]
    vae = VAE(models["flux"])
    info = json.loads(metadata["vae"])
    assert info["class"] == "AutoencoderKL" and info["shift"] == [pytest.approx(0.1)] * 4
    assert info["scale"] == [0.5] * 4
    pixels = torch.stack([read_image(image_folder / f"img{i}.png", 16, 16) for i in range(2)])
    raw = vae.model.encode(pixels).latent_dist.mode()
    torch.testing.assert_close(tensors["latents"], (raw - 0.1) * 0.5)  # normalised
    assert tensors["latents"].shape == (2, 4, 8, 8)  # 16 px / 2 (two blocks)

    encoder = TextEncoder(models["flux"], max_len=TEXT_LEN)
    tokens = encoder.tokenizer(["a red fox"], padding="max_length", max_length=TEXT_LEN, return_tensors="pt")
    direct = encoder.model(**tokens).last_hidden_state[0]
    real = int(tokens.attention_mask.sum())  # "a red fox </s>" = 4
    assert real == 4 and tensors["text_mask"][0].tolist() == [True] * 4 + [False] * 4
    torch.testing.assert_close(tensors["text"][0, :real], direct[:real])
    assert tensors["text"][0, real:].abs().max() == 0  # zero after the real tokens
    assert tensors["pooled"].shape == (2, 16) and tensors["null_text"].shape == (1, TEXT_LEN, 16)
    null = encoder([""])
    torch.testing.assert_close(tensors["null_text"], null["text"])
    assert tensors["null_text_mask"].sum() == 1  # the empty prompt is just </s>

    data = TextLatentsDataModule(str(out), batch_size=2, val_fraction=0.25)
    assert data.describe()["text_len"] == TEXT_LEN and data.channels == 4 and data.image_size == (8, 8)
    assert data.captions() == ["a red fox", "a blue cat running", "green field", "a red sky"]
    described = data.describe()  # what a checkpoint keeps: infer.py finds the VAE and text encoder from it
    assert described["vae"]["class"] == "AutoencoderKL" and described["vae"]["path"] == str(models["flux"] / "vae")
    assert described["text_encoder"]["path"] == str(models["flux"] / "text_encoder")
    assert described["text_encoder"]["max_len"] == TEXT_LEN


def test_prepare_videos_with_metadata_and_resume(models, video_folder, tmp_path):
    """Videos: first ``frames`` frames at the stride, Wan normalisation, too-short clip counted; re-running skips
    finished shards and only re-encodes a missing one."""
    out = tmp_path / "out"
    settings = dict(caption_column="caption", size=[16, 24], frames=5, frame_stride=2, max_text_len=TEXT_LEN,
                    shard_size=1, progress=False)
    report = encode_folder(str(video_folder), str(out), str(models["wan"]), str(models["wan"]), **settings)
    assert report.samples == 2 and report.shards_written == 2 and report.too_short == [
        str(video_folder / "clips" / "short.mp4")]
    tensors, metadata = read_shard(out / "shard-00000.safetensors")
    assert tensors["latents"].shape == (1, 16, 2, 2, 3)  # (N, C, 1 + (5 - 1) / 4, 16 / 8, 24 / 8)
    vae = VAE(models["wan"])
    pixels = read_video(video_folder / "clips" / "a.mp4", 16, 24, 5, 2)  # frames 0, 2, 4, 6, 8
    assert pixels.shape == (3, 5, 16, 24)
    raw = vae.model.encode(pixels[None]).latent_dist.mode()
    mean, std = (torch.tensor(vae.model.config[k]).view(1, -1, 1, 1, 1) for k in ("latents_mean", "latents_std"))
    torch.testing.assert_close(tensors["latents"], (raw - mean) / std, rtol=1e-5, atol=1e-5)  # as WanPipeline
    assert json.loads(metadata["bucket"])["frames"] == 5
    assert "pooled" not in tensors  # T5 has no pooled output

    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = encode_folder(str(video_folder), str(out), str(models["wan"]), str(models["wan"]), **settings)
    assert again.shards_written == 0 and again.shards_skipped == 2  # shard 2 (the short clip) was never written
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    (out / "shard-00001.safetensors").unlink()
    third = encode_folder(str(video_folder), str(out), str(models["wan"]), str(models["wan"]), **settings)
    assert third.shards_written == 1 and (out / "shard-00001.safetensors").exists()
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == stamps["shard-00000.safetensors"]


def test_ranks_split_the_shards(models, image_folder, tmp_path):
    """Rank r of W writes shards r, r + W, ...; together they write what one process writes."""
    out = tmp_path / "out"
    common = dict(size=16, max_text_len=TEXT_LEN, shard_size=1, progress=False)
    first = encode_folder(str(image_folder), str(out), str(models["flux"]), str(models["flux"]), rank=0, world_size=2,
                          **common)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["shard-00000.safetensors", "shard-00002.safetensors"]
    assert first.unreadable == [str(image_folder / "img9.png")]  # img9 is shard 4: rank 0's
    encode_folder(str(image_folder), str(out), str(models["flux"]), str(models["flux"]), rank=1, world_size=2, **common)
    assert len(list(out.glob("*.safetensors"))) == 4


def test_prepare_errors_name_the_setting(models, image_folder, video_folder, tmp_path):
    def run(folder, vae, **kwargs):
        return encode_folder(str(folder), str(tmp_path / "out"), str(vae), str(models["flux"]), size=16,
                             max_text_len=TEXT_LEN, progress=False, **kwargs)

    with pytest.raises(ConfigError, match="input=.*missing is not a folder"):
        run(tmp_path / "missing", models["flux"])
    (image_folder / "img2.txt").unlink()
    with pytest.raises(ConfigError, match="img2.png has no caption; add a caption file img2.txt"):
        run(image_folder, models["flux"])
    with pytest.raises(ConfigError, match="row 1 has columns .* caption column 'text'"):
        run(video_folder, models["wan"])  # the captions are in 'caption', not the default 'text'
    with pytest.raises(ConfigError, match="is an image VAE .AutoencoderKL. but input=.* holds videos"):
        run(video_folder, models["flux"], caption_column="caption")
    with pytest.raises(ConfigError, match="not a diffusers VAE folder: no config.json"):
        run(video_folder, models["not_a_vae"], caption_column="caption")
    no_weights = tmp_path / "no_weights"  # a config without safetensors weights (.bin pickles are refused)
    no_weights.mkdir()
    (no_weights / "config.json").write_text((models["wan"] / "vae" / "config.json").read_text())
    with pytest.raises(ConfigError, match="cannot load AutoencoderKLWan weights from .*safetensors"):
        VAE(no_weights)
    with pytest.raises(ConfigError, match=r"frames=6 is not a frame count AutoencoderKLWan takes: 1 \+ k x 4 .*; the "
                                          r"nearest valid counts are 5 and 9"):
        run(video_folder, models["wan"], caption_column="caption", frames=6)
    with pytest.raises(ConfigError, match="size=12x12: .* multiples of the VAE's downsampling factor 8"):
        encode_folder(str(video_folder), str(tmp_path / "o"), str(models["wan"]), str(models["wan"]), size=12,
                      caption_column="caption", frames=5, progress=False)
    with pytest.raises(ConfigError, match="max_text_len=32 is longer than CLIPTextModel takes .16 positions"):
        TextEncoder(models["flux"], max_len=32)


def test_prepare_cli_one_line_error_and_success(models, image_folder, tmp_path, capsys):
    """The command line (run in this process): exit 2 with one line for a setting mistake, checked before any model
    is loaded; a run prints its counts."""
    from ringdit.prepare import main

    settings = [f"input={image_folder}", f"out={tmp_path / 'out'}", f"vae={models['flux']}",
                f"text_encoder={models['flux']}", "size=16", f"max_text_len={TEXT_LEN}"]
    bad, _ = fail_fast("-m ringdit.prepare", *settings, f"input={tmp_path / 'nowhere'}")
    assert bad.returncode == 2 and bad.stderr.startswith(f"Error: input={tmp_path / 'nowhere'} is not a folder")
    assert "Traceback" not in bad.stderr
    with pytest.raises(SystemExit) as exit_info:
        main([*settings, "resolution=16"])  # the former name of size
    assert exit_info.value.code == 2 and "no setting named 'resolution'; did you mean size?" in \
        capsys.readouterr().err
    main(settings)
    printed = capsys.readouterr().out
    assert "prepared 4 samples into 1 new shards" in printed and "skipped 1 unreadable files" in printed


def test_a_corrupt_clip_is_skipped_and_named(models, video_folder, tmp_path):
    """A clip that cannot be decoded (cut off in the middle, as an interrupted copy leaves it) is left out of its
    shard and named in the report and the summary; the good clips are prepared."""
    clip = video_folder / "clips" / "b.mp4"
    clip.write_bytes(clip.read_bytes()[: clip.stat().st_size // 3])
    report = encode_folder(str(video_folder), str(tmp_path / "out"), str(models["wan"]), str(models["wan"]),
                           caption_column="caption", size=[16, 24], frames=5, frame_stride=2,
                           max_text_len=TEXT_LEN, shard_size=1, progress=False)
    assert report.unreadable == [str(clip)] and report.samples == 1
    assert f"skipped 1 unreadable files ({clip})" in report.summary()


def test_fit_centre_crops_then_resizes():
    wide = Image.new("RGB", (30, 10))
    wide.paste((255, 0, 0), (10, 0, 20, 10))  # a red middle third
    out = np.asarray(fit(wide, 8, 8))
    assert out.shape == (8, 8, 3) and (out[..., 0] > 200).all()  # only the middle square is kept


# ---- buckets (the bucket choice itself: tests/test_prepare_buckets.py) ----------------------------------------------


@pytest.fixture
def mixed_folder(tmp_path) -> Path:
    """Landscape and portrait PNGs, clips of 6 and 10 frames (32 x 24), one of 3 frames, one corrupt PNG."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    for name, size in (("wide0.png", (48, 16)), ("wide1.png", (50, 18)), ("tall.png", (16, 48))):
        colour_image(len(name) + size[0], size).save(folder / name)
    write_video(folder / "clip5.mp4", 6, seed=1)
    write_video(folder / "clip9.mp4", 10, seed=2)
    write_video(folder / "short.mp4", 3, seed=3)
    (folder / "broken.png").write_bytes(b"not a png at all")
    for i, path in enumerate(sorted(folder.iterdir())):
        path.with_suffix(".txt").write_text(["a red fox", "a blue cat running", "green field", "a red sky"][i % 4])
    return folder


def test_prepare_buckets_auto_mixes_images_and_videos(models, mixed_folder, tmp_path):
    """buckets=auto: one folder, one bucket per shard, >= 3 latent shapes; images are one-frame videos for the Wan
    VAE, clips get the longest 1 + 4k frames they have; too-short and corrupt files are named; a re-run rewrites
    nothing, and a changed input with shards there is refused."""
    out = tmp_path / "out"
    settings = dict(buckets="auto", size=32, frames=9, shard_size=2, max_text_len=TEXT_LEN, progress=False)
    report = encode_folder(str(mixed_folder), str(out), str(models["wan"]), str(models["wan"]), **settings)
    # auto at 32 px (step 16): 16x48, 16x64, 32x32, 48x16, 64x16; ordered by frames, height, width
    assert report.unreadable == [str(mixed_folder / "broken.png")]
    assert report.too_short == [str(mixed_folder / "short.mp4")]  # 3 frames < 5
    assert report.samples == 5 and report.shards_written == 4
    assert "; by bucket: 16x48x1: 2 samples, 48x16x1: 1 samples, 32x32x5: 1 samples, 32x32x9: 1 samples" in \
        report.summary()
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["buckets.json"] + [f"shard-0000{i}.safetensors"
                                                                                      for i in range(4)]
    expected = [  # (captions' files, latents shape (N, C, T', H', W'), bucket)
        (["wide0.png", "wide1.png"], (2, 16, 1, 2, 6), (16, 48, 1)),
        (["tall.png"], (1, 16, 1, 6, 2), (48, 16, 1)),
        (["clip5.mp4"], (1, 16, 2, 4, 4), (32, 32, 5)),  # 6 frames -> 5
        (["clip9.mp4"], (1, 16, 3, 4, 4), (32, 32, 9)),  # 10 frames -> 9 (frames=9 caps)
    ]
    vae = VAE(models["wan"])
    for i, (files, shape, (height, width, count)) in enumerate(expected):
        tensors, metadata = read_shard(out / f"shard-{i:05d}.safetensors")
        assert tensors["latents"].shape == shape
        bucket = json.loads(metadata["bucket"])
        assert (bucket["height"], bucket["width"], bucket["frames"]) == (height, width, count)
        assert bucket["frame_stride"] == (1 if count > 1 else None)
        assert json.loads(metadata["captions"]) == [(mixed_folder / f).with_suffix(".txt").read_text() for f in files]
    tensors, _ = read_shard(out / "shard-00003.safetensors")
    direct = vae.encode(read_video(mixed_folder / "clip9.mp4", 32, 32, 9)[None])
    torch.testing.assert_close(tensors["latents"], direct, rtol=1e-5, atol=1e-5)
    tensors, _ = read_shard(out / "shard-00001.safetensors")
    direct = vae.encode(read_image(mixed_folder / "tall.png", 48, 16)[None])  # an image -> (C, 1, H', W')
    torch.testing.assert_close(tensors["latents"], direct, rtol=1e-5, atol=1e-5)
    plan = json.loads((out / "buckets.json").read_text())
    assert [(s["bucket"], s["files"]) for s in plan["shards"]] == [
        ("16x48x1", ["wide0.png", "wide1.png"]), ("48x16x1", ["tall.png"]), ("32x32x5", ["clip5.mp4"]),
        ("32x32x9", ["clip9.mp4"])]

    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = encode_folder(str(mixed_folder), str(out), str(models["wan"]), str(models["wan"]), **settings)
    assert again.shards_written == 0 and again.shards_skipped == 4 and again.samples == 0
    assert "prepared 0 samples into 0 new shards (4 already done)" in again.summary()
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps  # nothing rewritten, the plan neither

    colour_image(7, (48, 16)).save(mixed_folder / "wide2.png")
    (mixed_folder / "wide2.txt").write_text("green field")
    with pytest.raises(ConfigError, match=r"out=.*: the shards there were planned differently \(shard 1 was 1 files "
                                          r"of 48x16x1, now 1 of 16x48x1\): the input folder or the bucket settings "
                                          r"changed; prepare into a new out= folder") as error:
        encode_folder(str(mixed_folder), str(out), str(models["wan"]), str(models["wan"]), **settings)
    assert "\n" not in str(error.value)
    (mixed_folder / "wide2.png").unlink()
    with pytest.raises(ConfigError, match="out=.* holds shards prepared with buckets .buckets.json.; pass the "
                                          "buckets= setting they were made with"):
        encode_folder(str(mixed_folder), str(out), str(models["wan"]), str(models["wan"]),
                      **{**settings, "buckets": None})


def test_prepare_bucket_list_image_vae_and_ranks(models, image_folder, tmp_path):
    """A list of [H, W] with an image VAE (no T): each image to the nearest ratio; ranks split the shards and
    together write what one process writes, each probing every file."""
    out = tmp_path / "out"
    colour_image(5, (24, 40)).save(image_folder / "tall.png")  # portrait 40 x 24 (H x W)
    (image_folder / "tall.txt").write_text("a red sky")
    common = dict(buckets=[[8, 16], [16, 8], [12, 12]], size=16, max_text_len=TEXT_LEN, shard_size=2,
                  progress=False)
    first = encode_folder(str(image_folder), str(out), str(models["flux"]), str(models["flux"]), rank=0,
                          world_size=2, **common)
    second = encode_folder(str(image_folder), str(out), str(models["flux"]), str(models["flux"]), rank=1,
                           world_size=2, **common)
    assert first.unreadable == [str(image_folder / "img9.png")] and second.unreadable == []  # probed: rank 0 tells
    # the 24 x 40 (H x W) images -> 8x16 (ratio 0.6 nearest 0.5): shards 0, 1; tall.png -> 16x8: shard 2
    assert first.buckets == {"8x16": 2, "16x8": 1} and second.buckets == {"8x16": 2}
    shapes = [read_shard(out / f"shard-{i:05d}.safetensors")[0]["latents"].shape for i in range(3)]
    assert shapes == [(2, 4, 4, 8), (2, 4, 4, 8), (1, 4, 8, 4)]  # 2x downsampling, no T
    assert json.loads(read_shard(out / "shard-00002.safetensors")[1]["bucket"])["frames"] is None


def test_prepare_bucket_errors_are_one_line(models, image_folder, video_folder, tmp_path):
    def run(folder, vae, **kwargs):
        return encode_folder(str(folder), str(tmp_path / "out"), str(vae), str(models["flux"]),
                             max_text_len=TEXT_LEN, progress=False, **{"size": 16, **kwargs})

    cases = [
        (dict(buckets="square"), r"buckets='square' is not null, auto or a list of \[H, W\]"),
        (dict(buckets=[[20, 32]], caption_column="caption"),
         r"buckets: \[20, 32\] is not a multiple of AutoencoderKLWan's downsampling factor 8"),
        (dict(buckets="auto", frame_buckets=[6], frames=9, caption_column="caption"),
         r"frame_buckets: 6 is not a frame count AutoencoderKLWan encodes \(1 \+ k \* 4"),
        (dict(buckets="auto", size=8, caption_column="caption"),
         r"size=8 \(8x8\) is smaller than the smallest bucket buckets=auto can make, 16x16"),
        (dict(frame_buckets=[5]), r"frame_buckets=\[5\] needs buckets=auto or a list of \[H, W\]"),
        (dict(bucket_step=16), r"bucket_step=16 is the size step of buckets=auto, but buckets=null; pass buckets=auto"),
    ]
    for settings, message in cases:
        folder = video_folder if "caption_column" in settings else image_folder
        with pytest.raises(ConfigError, match=message) as error:
            run(folder, models["wan"], **settings)
        assert "\n" not in str(error.value)
    write_video(image_folder / "clip.mp4", 5)
    (image_folder / "clip.txt").write_text("a red fox")
    with pytest.raises(ConfigError, match=r"mixes videos \(clip.mp4\) and images .*pass buckets=auto"):
        run(image_folder, models["wan"])


# ---- decoding and writing --------------------------------------------------------------------------------------------


def test_vae_decode_inverts_the_normalisation(models):
    """VAE.decode(VAE.encode(x)) is the raw VAE's decode(encode(x).mode()): shift and scale cancel exactly."""
    for name, pixels in (("wan", torch.rand(1, 3, 5, 16, 16) * 2 - 1), ("flux", torch.rand(2, 3, 16, 16) * 2 - 1)):
        vae = VAE(models[name])
        raw = vae.model.decode(vae.model.encode(pixels).latent_dist.mode()).sample.clamp(-1, 1)
        torch.testing.assert_close(vae.decode(vae.encode(pixels)), raw, rtol=1e-4, atol=1e-4)


def test_decode_samples_writes_videos_and_images(models, tmp_path):
    """samples.npz latents -> MP4 + GIF per video and a GIF grid; PNG per image and a PNG grid; tiles give the same
    shapes; a wrong VAE or a pixel-space samples.npz is a one-line error."""
    import imageio.v3 as iio

    from ringdit.media.decode import decode_samples, main

    video = tmp_path / "video"
    video.mkdir()
    latents = np.random.default_rng(0).standard_normal((2, 16, 2, 2, 3)).astype(np.float32)  # (N, C, T', H', W')
    np.savez(video / "samples.npz", latents=latents, labels=np.zeros(2, np.int64))
    written = decode_samples(video / "samples.npz", models["wan"])
    assert {p.name for p in written} == {"samples.gif", "sample-000.mp4", "sample-000.gif", "sample-001.mp4",
                                         "sample-001.gif"}
    frames = iio.imread(video / "sample-001.mp4", plugin="pyav")
    assert frames.shape == (5, 16, 24, 3)  # 1 + (2 - 1) * 4 frames of (2 * 8, 3 * 8) pixels
    with Image.open(video / "sample-000.gif") as gif:
        assert gif.n_frames == 5 and gif.size == (24, 16)
    tiled = decode_samples(video / "samples.npz", models["wan"], tmp_path / "tiled", tile=16)
    assert iio.imread(tiled[1], plugin="pyav").shape == frames.shape

    image = tmp_path / "run lr=1e-4, [2]"  # the first argument is samples=, whatever its characters
    image.mkdir()
    np.savez(image / "samples.npz", latents=np.zeros((3, 4, 4, 4), np.float32))
    main([str(image / "samples.npz"), f"vae={models['flux']}", f"out={tmp_path / 'pictures'}"])
    assert sorted(p.name for p in (tmp_path / "pictures").iterdir()) == [
        "sample-000.png", "sample-001.png", "sample-002.png", "samples.png"]
    with Image.open(tmp_path / "pictures" / "sample-002.png") as picture:
        assert picture.size == (8, 8) and picture.mode == "RGB"

    with pytest.raises(ConfigError, match="latents have 4 channels but vae=.* has 16; decode with the VAE"):
        decode_samples(image / "samples.npz", models["wan"])
    np.savez(tmp_path / "pixels.npz", images=np.zeros((1, 8, 8, 3), np.uint8))
    with pytest.raises(ConfigError, match="no 'latents': it was sampled in pixel space"):
        decode_samples(tmp_path / "pixels.npz", models["wan"])


def test_decode_writes_videos_at_the_rate_infer_stored(models, tmp_path):
    """infer.py stores its model's frame rate in samples.npz; decode writes the MP4s at it (fps= overrides), and a
    stored rate that is not a positive integer is one line whose advice works."""
    import av

    from ringdit.media.decode import decode_samples

    def rate(path):
        with av.open(str(path)) as container:
            return container.streams.video[0].average_rate

    latents = np.random.default_rng(0).standard_normal((1, 16, 2, 2, 3)).astype(np.float32)
    np.savez(tmp_path / "samples.npz", latents=latents, fps=np.asarray(24))
    decode_samples(tmp_path / "samples.npz", models["wan"])
    assert rate(tmp_path / "sample-000.mp4") == 24
    decode_samples(tmp_path / "samples.npz", models["wan"], tmp_path / "given", fps=12)
    assert rate(tmp_path / "given" / "sample-000.mp4") == 12
    np.savez(tmp_path / "samples.npz", latents=latents, fps=np.asarray(-3))
    with pytest.raises(ConfigError, match=r"its 'fps' is array\(-3\), not a positive integer; pass fps=16"):
        decode_samples(tmp_path / "samples.npz", models["wan"], tmp_path / "bad")
    decode_samples(tmp_path / "samples.npz", models["wan"], tmp_path / "bad", fps=16)  # the advice
    assert rate(tmp_path / "bad" / "sample-000.mp4") == 16


COMMANDS = {  # module: (required settings, one of them misspelt, what it should be)
    "ringdit.export": (["ckpt_path=last.ckpt"], "ckpt_pth=last.ckpt", "ckpt_path"),
    "ringdit.prepare": (["input=in", "out=out", "vae=vae", "text_encoder=te"], "text_encodr=te", "text_encoder"),
    "ringdit.media.decode": (["samples=s.npz", "vae=vae"], "vea=vae", "vae"),
}


@pytest.mark.parametrize("module", list(COMMANDS))
def test_every_command_is_a_hydra_app(module, tmp_path, capsys, monkeypatch):
    """export, prepare and decode as train.py: --help (the docstring, every setting with its comment), --cfg job,
    one-line errors with exit code 2 (a misspelt key with a hint, a missing ??? value); nothing is written to the
    folder they run in, and HYDRA_FULL_ERROR is the user's again afterwards."""
    import importlib

    main = importlib.import_module(module).main
    required, misspelt, meant = COMMANDS[module]
    config = module.rsplit(".", 1)[-1]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def command(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = main(list(argv)) or 0
        except SystemExit as stop:
            code = stop.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, out, _ = command("--help")
    assert code == 0 and out.startswith(importlib.import_module(module).__doc__.strip().splitlines()[0])
    assert f"{meant}: ???" in out and "#" in out.split("== Settings")[1]  # the settings with their comments
    code, out, _ = command(*required, "--cfg", "job")
    assert code == 0 and all(f"{key}: {value}" in out for key, value in (s.split("=") for s in required))
    code, _, err = command(*required[:-1], misspelt)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2, err
    assert lines[0].startswith(f"Error: no setting named '{misspelt.split('=')[0]}'; did you mean {meant}? "
                               f"(python -m {module} --cfg job lists them")
    code, _, err = command(*required[:-1])
    assert code == 2 and err.startswith(f"Error: {required[-1].split('=')[0]} is required (it is ??? in "
                                        f"conf/{config}.yaml)"), err
    assert list(tmp_path.iterdir()) == [] and "HYDRA_FULL_ERROR" not in os.environ


def test_prompts_encoded_for_sampling(models):
    """A sampling run's prompt encoding (``data_text_encoder`` + ``Codecs.encode``: infer.py's, the server's): the
    data's text length, the empty prompt as the default negative, the width checked, a prompt list required."""
    from ringdit.media.text import data_text_encoder
    from ringdit.sampling.sampler import Codecs

    codecs = Codecs(text_encoder=data_text_encoder({"text_len": TEXT_LEN, "text_dim": 16}, models["wan"]))
    cond, negative = codecs.encode(["a red fox running", "sky"]), codecs.encode([""])
    assert cond["text"].shape == (2, TEXT_LEN, 16) and cond["text_mask"].sum(1).tolist() == [5, 2]
    assert negative["text_mask"].sum() == 1  # "" -> </s>
    with pytest.raises(ConfigError, match="gives 16-dim states but the model was trained on 32-dim text"):
        data_text_encoder({"text_len": TEXT_LEN, "text_dim": 32}, models["wan"])
    with pytest.raises(ConfigError, match=r"prompts must be a non-empty list of strings, got 'a red fox'"):
        codecs.encode("a red fox")


def test_the_same_frames_are_written_to_the_same_mp4_bytes(tmp_path):
    """A sample's MP4 is a function of its pixels (the server's and infer.py's files of one seed compare byte for
    byte): 40 encodes of a 5-frame 32 x 32 clip, with memory churned between them, give one file. With x264's
    macroblock tree on they gave 4 to 10 distinct files."""
    from ringdit.media.writing import write_mp4

    rng = np.random.default_rng(2)  # a decoded sample's look: smooth 4 x 4 blotches around grey, a little grain
    blotches = np.repeat(np.repeat(rng.normal(0, 12, (5, 8, 8, 3)), 4, axis=1), 4, axis=2)
    frames = (119 + blotches + rng.normal(0, 2, blotches.shape)).clip(0, 255).astype(np.uint8)
    written, churn = set(), []
    for i in range(40):
        churn = [*churn[-30:], os.urandom(int(np.random.default_rng(i).integers(1, 200_000)))]
        written.add(write_mp4(frames, tmp_path / f"{i}.mp4").read_bytes())
    assert len(written) == 1
