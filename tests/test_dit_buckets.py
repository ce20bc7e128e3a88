"""Buckets for the class-conditional DiT: ``data=image_folder data.buckets=auto`` (each image at the bucket of nearest
aspect ratio, prepare's rule) and ``data=latents`` folders of ``.safetensors`` files (one latent shape per file).

The DiT runs any grid its patch divides, with the sin-cos table of that grid: the same numbers as a DiT built for
it. Through train.py: a two-bucket latents folder whose token counts (15, 35) divide neither 2 nor 4 trains the same
SGD steps and weights at ring 2 as in one process; an image folder with buckets trains.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from ringdit.data import ImageFolderDataModule, LatentsDataModule
from ringdit.common.errors import ConfigError
from ringdit.media.buckets import Buckets, auto_sizes
from ringdit.models import sincos_pos_embed
from tests.helpers import (
    SGD,
    TINY,
    LazyRuns,
    assert_refused,
    assert_same_numbers,
    fail_fast,
    logged_losses,
    model_weights,
    run,
    solid,
    tiny_dit,
)

# ---- the DiT at other grids ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("video, built, other", [(False, 8, (6, 10)), (False, (6, 10), (10, 14)),
                                                 (True, (4, 8, 8), (2, 6, 10)), (True, (2, 6, 10), (6, 4, 8))])
def test_the_dit_at_a_grid_it_was_not_built_for_is_the_dit_built_for_that_grid(video, built, other):
    """Only ``pos_embed`` depends on ``input_size``; at another grid the DiT computes that grid's table, so in fp64
    (both add the same fp32 table) the outputs are bit for bit those of a DiT built for the grid, same weights."""
    model = tiny_dit(video=video, input_size=built).double()
    native = tiny_dit(video=video, input_size=other).double()
    state = {key: value for key, value in model.state_dict().items() if key != "pos_embed"}
    assert native.load_state_dict(state, strict=False).missing_keys == ["pos_embed"]
    assert model.pos_embed.shape != native.pos_embed.shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 3, *other, generator=g, dtype=torch.float64)
    t, y = torch.tensor([3.0, 500.0, 999.0]), torch.tensor([1, 4, 10])  # 10: the null class
    out = model(x, t, y)
    assert out.shape == (3, 6, *other)
    assert torch.equal(out, native(x, t, y))


def original_2d(embed_dim: int, height: int, width: int) -> np.ndarray:
    """facebookresearch/DiT's get_2d_sincos_pos_embed, transcribed in numpy, its grid_size an (h, w) pair: the
    original takes one int (square grids), and its meshgrid (w first) and flattening carry over to h x w unchanged."""
    def one_d(dim, pos):
        omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid = np.stack(np.meshgrid(np.arange(width, dtype=np.float32), np.arange(height, dtype=np.float32)))
    return np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)


def test_a_token_keeps_its_position_embedding_in_every_bucket():
    """The table of a larger grid, cut to a smaller one, is the smaller grid's table (image and video): a token at
    (t, h, w) is embedded the same in every bucket. The 2-D table is the original formula's on rectangles too."""
    np.testing.assert_allclose(sincos_pos_embed(64, (3, 5))[0].numpy(), original_2d(64, 3, 5).astype(np.float32),
                               atol=1e-6)
    big = sincos_pos_embed(64, (6, 10))[0].reshape(6, 10, 64)
    assert torch.equal(big[:3, :5], sincos_pos_embed(64, (3, 5))[0].reshape(3, 5, 64))
    video = sincos_pos_embed(64, (4, 6, 10))[0].reshape(4, 6, 10, 64)
    assert torch.equal(video[:2, :3, :5], sincos_pos_embed(64, (2, 3, 5))[0].reshape(2, 3, 5, 64))
    # a quarter of the channels encode time only; the rest are the frame's 2-D table
    assert torch.equal(video[1, :, :, 16:], sincos_pos_embed(48, (6, 10))[0].reshape(6, 10, 48))
    assert (video[2, :, :, :16] == video[2, 0, 0, :16]).all()


# ---- data=image_folder data.buckets ------------------------------------------------------------------------------


def write_mixed_images(root) -> dict[str, tuple[int, int]]:
    """Landscape, portrait and square images in two classes, and a JPEG stored landscape whose EXIF says it is
    turned upright as a portrait; returns file name -> its upright (height, width)."""
    sizes = {}
    for k, (name, files) in enumerate({"a": {"wide": (40, 20), "tall": (20, 40), "square": (30, 30)},
                                       "b": {"wide2": (44, 22), "square2": (32, 32), "square3": (50, 50)}}.items()):
        (root / name).mkdir(parents=True)
        for i, (stem, (w, h)) in enumerate(files.items()):
            solid((40 * k + 10 * i,) * 3, (w, h)).save(root / name / f"{stem}.png")
            sizes[f"{stem}.png"] = (h, w)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees on display: 40 x 20 stored, 20 x 40 shown
    solid((200, 100, 0), (40, 20)).save(root / "b" / "rotated.jpg", exif=exif)
    sizes["rotated.jpg"] = (40, 20)
    return sizes


def kind(shape) -> str:
    return "wide" if shape[1] > shape[0] else "tall" if shape[0] > shape[1] else "square"


def file_name(path: str) -> str:
    return path.rsplit("/", 1)[1]


def test_image_folder_auto_buckets_place_each_image_by_its_aspect_ratio(tmp_path):
    sizes = write_mixed_images(tmp_path)
    data = ImageFolderDataModule(root=str(tmp_path), image_size=32, buckets="auto", val_fraction=0)
    info = data.describe()
    shapes = [tuple(b["shape"]) for b in info["buckets"]]
    # area <= 32 x 32, multiples of 8 px, ratios of 1:4 .. 4:1; 2:1 images go to 24 x 40 (the nearest ratio, 5:3)
    assert info["buckets"] == [{"shape": [32, 32], "samples": 3}, {"shape": [24, 40], "samples": 2},
                               {"shape": [40, 24], "samples": 2}]  # the most frequent first, then by shape
    assert info["image_size"] == [32, 32]  # the most frequent bucket: the model's default grid, previews
    assert all(h * w <= 32 * 32 and h % 8 == 0 and w % 8 == 0 for h, w in shapes)
    data.setup()
    dataset = data.train_set
    for position, index in enumerate(dataset.indices):
        x, label = dataset[position]
        shape = data.bucket_shapes[data.sample_buckets[index]]
        assert tuple(x.shape) == (3, *shape) and x.dtype == torch.float32 and -1 <= x.min() <= x.max() <= 1
        assert kind(shape) == kind(sizes[file_name(data.samples[index][0])])  # the EXIF-turned JPEG: tall
        assert int(label) == data.samples[index][1]
    data.set_patch_shape((2, 2))
    assert data.batch_sizes() == [64, 64, 64]  # data.batch_size for every bucket without tokens_per_batch


def test_image_folder_bucket_list_step_and_token_budget(tmp_path, caplog):
    sizes = write_mixed_images(tmp_path)
    with caplog.at_level(logging.WARNING):
        data = ImageFolderDataModule(root=str(tmp_path), image_size=[16, 24], buckets=[[16, 24], [24, 16], [16, 16],
                                                                                        [32, 32]], tokens_per_batch=48)
    assert "leaving out 32x32, larger in area than data.image_size=[16, 24]" in caplog.text
    assert {tuple(b["shape"]) for b in data.describe()["buckets"]} == {(16, 24), (24, 16), (16, 16)}
    with pytest.raises(ConfigError, match=r"data.tokens_per_batch=48 is smaller than one sample of the largest "
                                          r"bucket \[16, 24\] \(96 tokens\)"):
        data.set_patch_shape((2, 2))  # 96 and 64 tokens a sample
    data = ImageFolderDataModule(root=str(tmp_path), image_size=32, buckets="auto", bucket_step=16)
    rule = Buckets(tuple(auto_sizes(32 * 32, 16)), None)  # prepare's rule, ringdit/media/buckets.py
    upright = [sizes[file_name(path)] for path, _ in data.samples]
    assert data.sample_shapes == [(b.height, b.width) for b in (rule.choose(h, w) for h, w in upright)]
    assert {(16, 48), (32, 32)} <= set(data.bucket_shapes)
    data = ImageFolderDataModule(root=str(tmp_path), image_size=32, buckets="auto", tokens_per_batch=500)
    data.set_patch_shape((2, 2))  # 256 and 240 tokens a sample
    assert data.batch_sizes() == [1 if shape == (32, 32) else 2 for shape in data.bucket_shapes]
    from omegaconf import OmegaConf  # what Hydra passes for data.buckets=[[16,24],[24,16]]

    listed = ImageFolderDataModule(root=str(tmp_path), image_size=[16, 24], buckets=OmegaConf.create([[16, 24],
                                                                                                     "24x16"]))
    assert listed.bucket_shapes == [(16, 24), (24, 16)]
    plain = ImageFolderDataModule(root=str(tmp_path), image_size=[6, 10])  # no buckets: one shape, as before
    assert "buckets" not in plain.describe() and plain.bucket_shapes is None
    assert {tuple(plain.build_dataset()[i][0].shape) for i in range(len(plain.samples))} == {(3, 6, 10)}


@pytest.mark.parametrize("kwargs, message", [
    ({"buckets": "square"}, r"data.buckets='square' is not null, auto or a list of \[H, W\]; pass data.buckets=null"),
    ({"buckets": [[16, 16], [8]]}, r"data.buckets: the entry \[8\] is not an \[H, W\] pair"),
    ({"buckets": [[64, 64]]}, r"data.buckets: every size \(64x64\) is larger in area than data.image_size=\[32, 32\]"),
    ({"buckets": "auto", "bucket_step": 0}, r"data.bucket_step must be a positive integer, got 0"),
    ({"buckets": "auto", "bucket_step": 40}, r"data.image_size=\[32, 32\] \(1024 px\) is smaller than the smallest "
                                             r"bucket data.buckets=auto can make, 40x40"),
])
def test_image_folder_bucket_settings_are_refused_in_one_line(tmp_path, kwargs, message):
    write_mixed_images(tmp_path)
    with pytest.raises(ConfigError, match=message):
        ImageFolderDataModule(root=str(tmp_path), image_size=32, **kwargs)


def test_an_undecodable_image_is_replaced_by_one_of_its_bucket(tmp_path):
    """A file the scan passed but that cannot be decoded stands in by the next decodable image of the same bucket,
    so a batch of one bucket keeps one shape."""
    write_mixed_images(tmp_path)
    noise = np.random.default_rng(0).integers(0, 255, (64, 128, 3), dtype=np.uint8)  # wide: H 64, W 128
    jpeg = io.BytesIO()
    Image.fromarray(noise).save(jpeg, "JPEG")
    broken = tmp_path / "a" / "broken.jpg"  # sorts before a/square.png, a/tall.png, a/wide.png
    broken.write_bytes(jpeg.getvalue()[: len(jpeg.getvalue()) // 2])
    with Image.open(broken) as image:
        image.verify()  # the scan's check passes: only decoding finds it
    data = ImageFolderDataModule(root=str(tmp_path), image_size=32, buckets="auto")
    paths = [path for path, _ in data.samples]
    index, wide = paths.index(str(broken)), paths.index(str(tmp_path / "a" / "wide.png"))
    assert data.sample_shapes[index] == data.sample_shapes[wide] == (24, 40)
    dataset = data.build_dataset()
    x, label = dataset[index]
    expected_x, expected_label = dataset[wide]  # not a/square.png, the next file, of another bucket
    assert torch.equal(x, expected_x) and label == expected_label


# ---- data=latents folders ------------------------------------------------------------------------------------------


def write_file(path, latents: np.ndarray, labels: np.ndarray, names=None):
    metadata = {"class_names": json.dumps(names)} if names is not None else None
    save_file({"latents": torch.from_numpy(latents), "labels": torch.from_numpy(labels)}, path, metadata=metadata)


def latents_of(rng, count: int, *shape: int) -> np.ndarray:
    return rng.standard_normal((count, *shape)).astype(np.float32)


def test_a_latents_folder_of_two_shapes_is_two_buckets(tmp_path):
    rng = np.random.default_rng(0)
    files = {"a.safetensors": latents_of(rng, 6, 4, 6, 10), "b.safetensors": latents_of(rng, 10, 4, 10, 14),
             "c.safetensors": latents_of(rng, 2, 4, 6, 10)}
    labels = {name: np.arange(len(z)) % 3 for name, z in files.items()}
    for name, z in files.items():
        write_file(tmp_path / name, z, labels[name], ["x", "y", "z"] if name == "b.safetensors" else None)
    data = LatentsDataModule(path=str(tmp_path), scale=0.5, val_fraction=0.25)
    assert data.describe() == {"channels": 4, "image_size": [10, 14], "num_classes": 3, "class_names": ["x", "y", "z"],
                               "buckets": [{"shape": [10, 14], "samples": 10}, {"shape": [6, 10], "samples": 8}],
                               "latent_scale": 0.5}
    rows = [(name, i) for name in sorted(files) for i in range(len(files[name]))]  # the files in name order
    dataset = data.build_dataset()
    assert len(dataset) == len(rows) == 18
    for index, (name, i) in enumerate(rows):
        x, label = dataset[index]
        assert tuple(x.shape[1:]) == data.bucket_shapes[data.sample_buckets[index]] == files[name].shape[2:]
        torch.testing.assert_close(x, torch.from_numpy(files[name][i]) * 0.5, rtol=0, atol=0)
        assert int(label) == labels[name][i]
    data.setup()
    assert sum(len(m) for m in data._members(data.val_set)) == 4
    budget = LatentsDataModule(path=str(tmp_path), tokens_per_batch=50)
    budget.set_patch_shape((2, 2))  # 15 and 35 tokens a sample
    assert budget.batch_sizes() == [3, 1]  # bucket order: first appearance, (6, 10) then (10, 14)


def test_a_latents_folder_of_videos_and_the_older_layouts(tmp_path):
    rng = np.random.default_rng(1)
    (tmp_path / "videos").mkdir()
    write_file(tmp_path / "videos" / "short.safetensors", latents_of(rng, 3, 2, 2, 6, 10), np.zeros(3, np.int64))
    write_file(tmp_path / "videos" / "long.safetensors", latents_of(rng, 2, 2, 4, 6, 10), np.ones(2, np.int64))
    data = LatentsDataModule(path=str(tmp_path / "videos"))
    assert data.describe()["buckets"] == [{"shape": [2, 6, 10], "samples": 3}, {"shape": [4, 6, 10], "samples": 2}]
    assert data.class_names == ["0", "1"] and data.image_size == (2, 6, 10)
    # a folder with latents.npy stays the npy layout, whatever else it holds; a single file stays one shape
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "latents.npy", latents_of(rng, 4, 2, 8, 8))
    np.save(tmp_path / "npy" / "labels.npy", np.arange(4))
    write_file(tmp_path / "npy" / "other.safetensors", latents_of(rng, 2, 2, 6, 10), np.zeros(2, np.int64))
    for path in (tmp_path / "npy", tmp_path / "videos" / "long.safetensors"):
        info = LatentsDataModule(path=str(path)).describe()
        assert "buckets" not in info and info["image_size"] in ([8, 8], [4, 6, 10])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no latents.npy; .* or .safetensors files"):
        LatentsDataModule(path=str(tmp_path / "empty"))


MIXES = {
    "channels": ({"shape": (5, 6, 10)}, r"b.safetensors has latent channels 5 but a.safetensors has 4; .*encode "
                                        r"every file with the same VAE"),
    "image and video": ({"shape": (4, 2, 6, 10)}, r"b.safetensors has latent dims \(image vs video\) 3 but "
                                                  r"a.safetensors has 2; .*store images as 1-frame videos"),
    "class names": ({"names": ["x", "w"]}, r"b.safetensors has class_names \['x', 'w'\] but a.safetensors has "
                                           r"\['x', 'y'\]; .*give every file the same class_names"),
}


def write_unmixable(folder, case: str) -> None:
    folder.mkdir(exist_ok=True)
    other = MIXES[case][0]
    write_file(folder / "a.safetensors", np.zeros((2, 4, 6, 10), np.float32), np.arange(2), ["x", "y"])
    write_file(folder / "b.safetensors", np.zeros((2, *other.get("shape", (4, 10, 6))), np.float32), np.arange(2),
               other.get("names", ["x", "y"]))


@pytest.mark.parametrize("case", list(MIXES))
def test_latent_files_that_cannot_be_mixed_are_refused(tmp_path, case):
    write_unmixable(tmp_path, case)
    with pytest.raises(ConfigError, match=f"^data.path={re.escape(str(tmp_path))}: {MIXES[case][1]}"):
        LatentsDataModule(path=str(tmp_path))


def test_every_latent_file_is_checked_as_a_single_file_is(tmp_path):
    write_file(tmp_path / "a.safetensors", np.zeros((2, 4, 6, 10), np.float32), np.arange(2), ["x", "y"])
    bad = np.zeros((3, 4, 10, 6), np.float32)
    bad[1, 0, 0, 0] = np.nan
    write_file(tmp_path / "b.safetensors", bad, np.arange(3) % 2)
    with pytest.raises(ValueError, match=rf"data.path={re.escape(str(tmp_path / 'b.safetensors'))}: 1 of 3 latent "
                                         rf"samples hold NaN or Inf values, the first is sample 1"):
        LatentsDataModule(path=str(tmp_path))
    write_file(tmp_path / "b.safetensors", np.zeros((3, 4, 10, 6), np.float32), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"b.safetensors: labels go up to 2 but class_names lists 2 names"):
        LatentsDataModule(path=str(tmp_path))  # a.safetensors' names hold for the files without any


def test_unmixable_latent_files_are_refused_before_any_rank_starts(tmp_path):
    write_unmixable(tmp_path / "data", "channels")
    proc, seconds = fail_fast("train.py", "data=latents", f"data.path={tmp_path / 'data'}", "ring_degree=2",
                              f"hydra.run.dir={tmp_path / 'run'}")
    assert_refused(proc, MIXES["channels"][1], seconds=seconds, run_dir=tmp_path / "run")


# ---- through train.py --------------------------------------------------------------------------------------------

LATENT_BUCKETS = {"a.safetensors": (20, (4, 6, 10)), "b.safetensors": (12, (4, 10, 14))}  # 15 and 35 tokens
RUN = [*TINY, *SGD, "data=latents", "data.batch_size=4", "data.val_fraction=0.125", "trainer.max_steps=4",
       "trainer.val_check_interval=4"]


def logged(run_dir, key: str) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row.get(key)}


@pytest.fixture(scope="module")
def latent_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dit_buckets")
    rng = np.random.default_rng(0)
    (root / "data").mkdir()
    for name, (count, shape) in LATENT_BUCKETS.items():
        write_file(root / "data" / name, latents_of(rng, count, *shape), np.arange(count) % 3, ["x", "y", "z"])
    return LazyRuns(root, {"ring1": [], "ring2": ["ring_degree=2"]}, *RUN, f"data.path={root / 'data'}")


def test_dit_sgd_steps_on_latent_buckets_at_ring_2_equal_one_process(latent_runs):
    """tests/test_training.py's test_sgd_steps_equal_one_device on buckets: fp32, a layout only reorders sums, so the
    losses and weights agree to rel 1e-5 / atol 1e-6 (>= 10x the reordering). 15 and 35 tokens split unevenly over 2
    ranks (one rank holds a padded tail), and the step's bucket changes the sequence length."""
    reference, parallel = latent_runs.trained("ring1"), latent_runs.trained("ring2")
    tokens = logged(reference, "train/sample_tokens")
    assert set(tokens.values()) == {15.0, 35.0}, tokens  # the steps did change shape
    assert logged(parallel, "train/sample_tokens") == tokens  # the same bucket sequence on every rank
    losses, expected = logged_losses(parallel), logged_losses(reference)
    assert sorted(losses) == sorted(expected) == [0, 1, 2, 3]
    for step in expected:
        assert losses[step] == pytest.approx(expected[step], rel=1e-5), f"step {step}"
    assert expected[3] != pytest.approx(expected[0], rel=1e-3)  # the steps did change the model
    assert logged(parallel, "val/loss") == pytest.approx(logged(reference, "val/loss"), rel=1e-5)
    assert_same_numbers(model_weights(parallel), model_weights(reference), rtol=1e-5, atol=1e-6, where="ring2")
    data = torch.load(reference / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]["data"]
    assert data["buckets"] == [{"shape": [6, 10], "samples": 20}, {"shape": [10, 14], "samples": 12}]


def test_train_on_an_image_folder_with_auto_buckets(tmp_path):
    write_mixed_images(tmp_path / "images")
    run("train.py", tmp_path / "run", *TINY, "data=image_folder", f"data.root={tmp_path / 'images'}",
        "data.image_size=16", "data.buckets=auto", "data.bucket_step=4", "data.batch_size=2", "data.num_workers=0",
        "trainer.max_steps=2")
    assert sorted(logged_losses(tmp_path / "run")) == [0, 1]
    data = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]["data"]
    assert {tuple(b["shape"]) for b in data["buckets"]} == {(16, 16), (20, 12), (12, 20)}
