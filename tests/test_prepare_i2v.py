"""``python -m ringdit.prepare task=i2v``: each clip's first-frame conditioning for image-to-video, checked against
diffusers' own ``WanImageToVideoPipeline`` (its ``prepare_latents`` with and without ``expand_timesteps``, its
``encode_image``) on a tiny random Wan VAE and CLIP vision model; ``encode_image_condition`` (infer.py image=) gives
the same rows; buckets, the images left out, bad settings and the tile-parallel VAE on two ranks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("imageio")

from PIL import Image  # noqa: E402

from ringdit.data.text_latents import IMAGE_KEYS, TextLatentsDataModule  # noqa: E402
from ringdit.common.errors import ConfigError  # noqa: E402
from ringdit.media.encode_folder import encode_folder  # noqa: E402
from ringdit.media.frames import fit, read_video  # noqa: E402
from ringdit.media.image_condition import encode_image_condition  # noqa: E402
from tests.distributed import run_command_ranks  # noqa: E402
from tests.helpers import TEXT_LEN, first_frame, write_video  # noqa: E402

# fp32 on the CPU: the prepared rows come from batches of 2 (slicing: one sample at a time through the VAE), the
# references from batches of 1; the same kernels, but convolution and matmul paths may reorder sums by batch
CLOSE = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def clips(tmp_path) -> Path:
    """Two 32 x 24 clips (6 and 10 frames) with sidecar captions."""
    folder = tmp_path / "clips"
    folder.mkdir()
    for name, frames, seed, caption in (("a", 6, 1, "a red fox running"), ("b", 10, 2, "a blue cat")):
        write_video(folder / f"{name}.mp4", frames, seed=seed)
        (folder / f"{name}.txt").write_text(caption)
    return folder


def read_shard(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from tests.helpers import read_prepared

    return read_prepared(path)


def test_i2v_shards_match_the_pipeline(models, clip_folder, clips, tmp_path):
    """image_latents = the pipeline's latent_condition with expand_timesteps (Wan 2.2 TI2V) = the VAE's encoding of
    the first frame alone; image_condition = its latent_condition of [first frame ; zeros] (Wan 2.1 I2V);
    image_embeds = its encode_image; all normalised as the pipeline does. encode_image_condition gives the same."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionModel

    out = tmp_path / "out"
    report = encode_folder(str(clips), str(out), str(models["wan"]), str(models["wan"]), size=[16, 24],
                           frames=5, max_text_len=TEXT_LEN, batch_size=2, task="i2v",
                           image_encoder=str(clip_folder), progress=False)
    assert report.samples == 2 and report.shards_written == 1 and report.stills == []
    tensors, metadata = read_shard(out / "shard-00000.safetensors")
    assert tensors["latents"].shape == (2, 16, 2, 2, 3)  # (N, C, 1 + (5 - 1) / 4, 16 / 8, 24 / 8)
    assert tensors["image_latents"].shape == (2, 16, 1, 2, 3)
    assert tensors["image_condition"].shape == (2, 16, 2, 2, 3)
    assert tensors["image_embeds"].shape == (2, 17, 16)  # 1 + (32 / 8)^2 patch tokens, hidden size 16
    assert metadata["task"] == "i2v"
    assert json.loads(metadata["image_encoder"])["path"] == str((clip_folder / "image_encoder").resolve())

    vae = AutoencoderKLWan.from_pretrained(models["wan"] / "vae")  # untiled: the pipeline's own encode
    common = dict(tokenizer=None, text_encoder=None, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                  image_processor=CLIPImageProcessor.from_pretrained(clip_folder / "image_processor"),
                  image_encoder=CLIPVisionModel.from_pretrained(clip_folder / "image_encoder"))
    i2v = WanImageToVideoPipeline(**common)
    ti2v = WanImageToVideoPipeline(**common, expand_timesteps=True)
    mean, std = (torch.tensor(vae.config[key]).view(1, -1, 1, 1, 1) for key in ("latents_mean", "latents_std"))
    cpu = torch.device("cpu")
    for row, name in enumerate(["a.mp4", "b.mp4"]):
        first = read_video(clips / name, 16, 24, 5)[:, 0]  # (3, H, W) in [-1, 1]: the first frame its bucket shows
        with torch.no_grad():
            _, condition = i2v.prepare_latents(first[None], 1, 16, 16, 24, 5, torch.float32, cpu)  # mask (4) ; it
            _, alone, _ = ti2v.prepare_latents(first[None], 1, 16, 16, 24, 5, torch.float32, cpu)
            direct = (vae.encode(first[None, :, None]).latent_dist.mode() - mean) / std  # one frame, alone
            embeds = i2v.encode_image(fit(first_frame(clips / name), 16, 24), cpu)
        assert condition.shape == (1, 4 + 16, 2, 2, 3) and alone.shape == (1, 16, 1, 2, 3)
        torch.testing.assert_close(tensors["image_condition"][row], condition[0, 4:], **CLOSE)
        torch.testing.assert_close(tensors["image_latents"][row], alone[0], **CLOSE)
        torch.testing.assert_close(tensors["image_latents"][row], direct[0], **CLOSE)
        torch.testing.assert_close(tensors["image_embeds"][row], embeds[0], **CLOSE)
    # the later latent frames encode zeros, not the clip (a tiny random VAE barely tells them apart: 6e-3 here)
    assert (tensors["image_condition"][:, :, 1:] - tensors["latents"][:, :, 1:]).abs().max() > 1e-3

    # infer.py image=: the same function on the raw first frames (cropped by the same rule) gives the same rows
    cond = encode_image_condition([first_frame(clips / n) for n in ("a.mp4", "b.mp4")],
                                  vae_folder=json.loads(metadata["vae"])["path"], frames=5, size=(16, 24),
                                  image_encoder=str(clip_folder))
    assert sorted(cond) == sorted(IMAGE_KEYS)
    for key in IMAGE_KEYS:
        torch.testing.assert_close(cond[key], tensors[key], **CLOSE)

    data = TextLatentsDataModule(str(out), batch_size=1, val_fraction=0.5)  # the reader takes them as they are
    sample_cond = data.build_dataset()[1][1]
    for key in IMAGE_KEYS:
        torch.testing.assert_close(sample_cond[key], tensors[key][1])


def test_i2v_buckets_leave_images_out(models, clips, tmp_path):
    """With buckets every bucket's clips get their own frame count's condition; images (1-frame buckets) are left
    out, counted, named and planned as such; no image encoder: no image_embeds; a resume with task=t2v is refused."""
    colour = np.random.default_rng(7).integers(0, 256, (24, 32, 3), dtype=np.uint8)
    Image.fromarray(colour).save(clips / "still.png")
    (clips / "still.txt").write_text("green field")
    out = tmp_path / "out"
    settings = dict(buckets=[[16, 24]], size=[16, 24], frames=9, max_text_len=TEXT_LEN, progress=False)
    report = encode_folder(str(clips), str(out), str(models["wan"]), str(models["wan"]), task="i2v", **settings)
    assert report.stills == [str(clips / "still.png")] and report.samples == 2 and report.shards_written == 2
    assert "task=i2v: left out 1 images or 1-frame clips, which have no video to condition on their first frame " \
           f"({clips / 'still.png'})" in report.summary()
    assert report.buckets == {"16x24x5": 1, "16x24x9": 1}
    assert json.loads((out / "buckets.json").read_text())["skipped"]["stills"] == ["still.png"]
    for shard, frames in (("shard-00000", 5), ("shard-00001", 9)):  # each bucket: its clips' frame count
        tensors, _ = read_shard(out / f"{shard}.safetensors")
        latent_frames = 1 + (frames - 1) // 4
        assert tensors["latents"].shape == (1, 16, latent_frames, 2, 3) and "image_embeds" not in tensors
        assert tensors["image_condition"].shape == tensors["latents"].shape  # [first ; frames - 1 zeros] encoded
        assert tensors["image_latents"].shape == (1, 16, 1, 2, 3)

    with pytest.raises(ConfigError, match=r"out=.* holds shards prepared with task=i2v \(shard-00000.safetensors\), "
                                          r"but task=t2v; pass task=i2v to resume them"):
        encode_folder(str(clips), str(out), str(models["wan"]), str(models["wan"]), **settings)


def test_i2v_bad_settings_are_one_line(models, clip_folder, clips, tmp_path, capsys):
    """Each refused before any work (nothing written), naming the setting, the value and the fix."""
    from ringdit.prepare import main

    out = tmp_path / "out"

    def run(folder=clips, **kwargs):
        settings = dict(size=[16, 24], frames=5, max_text_len=TEXT_LEN, progress=False) | kwargs
        encode_folder(str(folder), str(out), str(models["wan"]), str(models["wan"]), **settings)

    cases = [
        (dict(task="x2v"), r"task='x2v' is not one of t2v, i2v; pass task=t2v .* or task=i2v"),
        (dict(image_encoder=str(clip_folder)), r"image_encoder=.* but task=t2v; pass task=i2v, or drop image_encoder"),
        (dict(task="i2v", image_encoder=str(tmp_path / "nowhere")), r"image_encoder=.*nowhere does not exist"),
        (dict(task="i2v", image_encoder=str(models["wan"])), r"image_encoder=.* has no config.json"),
        (dict(task="i2v", image_encoder=str(models["wan"] / "text_encoder")),
         r"model_type 't5' is not a CLIP vision model .*; pass a CLIPVisionModel folder"),
        (dict(task="i2v", image_encoder=str(clip_folder), image_processor=str(models["wan"])),
         r"image_processor=.* has no preprocessor_config.json"),
        (dict(task="i2v", image_processor=str(clip_folder)), r"image_processor=.* but image_encoder is not set"),
        (dict(task="i2v", frames=1), r"task=i2v with frames=1: .*pass frames=1 \+ k"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            run(**kwargs)
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (32, 24)).save(images / "x.png")
    (images / "x.txt").write_text("a red sky")
    with pytest.raises(ConfigError, match=r"task=i2v conditions each clip on its first frame, but input=.* holds no "
                                          r"videos \(only images\); pass a folder of clips, or task=t2v"):
        run(images, task="i2v")
    with pytest.raises(SystemExit) as exit_info:  # the command line: one line, exit code 2
        main([f"input={clips}", f"out={out}", f"vae={models['wan']}", f"text_encoder={models['wan']}",
              "task=x2v"])
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and error.startswith("Error: task='x2v' is not one of t2v, i2v")
    assert "pass task=t2v" in error.splitlines()[0] and "Traceback" not in error
    assert not out.exists()


def test_i2v_parallel_vae_two_ranks(models, clip_folder, tmp_path):
    """parallel_vae=true on two ranks (forked, as torchrun starts them): the first frames' extra encodes go through
    the tile-parallel VAE too, and rank 0 writes the one-process shards bit for bit (as
    tests/test_prepare_parallel_vae.py, one thread a rank)."""
    from tests.helpers import TILE, split

    folder = tmp_path / "clips"
    folder.mkdir()
    for name, seed in (("a", 1), ("b", 2)):
        write_video(folder / f"{name}.mp4", 6, seed=seed, size=(64, 48))  # 2 x 3 tiles of 32 px
        (folder / f"{name}.txt").write_text("a red fox")
    settings = dict(input=str(folder), vae=str(models["wan"]), text_encoder=str(models["wan"]),
                    size=[48, 64], frames=5, max_text_len=TEXT_LEN, batch_size=2, tile=TILE, task="i2v",
                    image_encoder=str(clip_folder))
    reference, out = tmp_path / "reference", tmp_path / "parallel"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        encode_folder(out=str(reference), progress=False, **settings)
    finally:
        torch.set_num_threads(threads)
    overrides = [f"{key}={value}".replace(" ", "") for key, value in {**settings, "out": out}.items()]
    done = run_command_ranks("-m ringdit.prepare", (*overrides, "parallel_vae=true"), 2,
                             {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "prepared 2 samples into 1 new shards" in done.stdout, done.stdout
    # one batch, three encodes: the clips, their first frames alone, [first frame ; zeros]
    assert "parallel_vae=true: encoded a share of the VAE tiles of 3 batches" in done.stdout
    header, data = split(out / "shard-00000.safetensors")
    expected_header, expected_data = split(reference / "shard-00000.safetensors")
    assert set(header) >= {"image_latents", "image_condition", "image_embeds"}
    assert (header, data) == (expected_header, expected_data)
