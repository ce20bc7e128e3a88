"""The data sources behind ``data=``: image folders, pre-encoded latents, procedural moving-digit videos -- each unit
tested against values built independently in the test, then run end to end through train.py (and infer.py)."""

from __future__ import annotations

import importlib.util
import pickle

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from PIL import Image
from safetensors.torch import save_file
from sklearn.datasets import load_digits

from ringdit.commands.cli import register_resolvers
from ringdit.spec import build_on_meta, model_config
from ringdit.data import ImageFolderDataModule, LatentsDataModule, MovingDigits, MovingDigitsDataModule
from ringdit.data.image_folder import resize_center_crop
from ringdit.data.moving_digits import bounce
from tests.helpers import CONF, GOOD, LABELS, TINY, fail_fast, logged_losses, run, solid, write_classes, write_latents

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)
PIXEL = 1 / 127.5  # one uint8 step in [-1, 1]


def bands(width: int, height: int, vertical: bool = True) -> Image.Image:
    """Three equal bands red | green | blue, left to right (``vertical``) or top to bottom."""
    pixels = np.zeros((height, width, 3), np.uint8)
    n = width if vertical else height
    for i, colour in enumerate((RED, GREEN, BLUE)):
        span = slice(i * n // 3, (i + 1) * n // 3)
        if vertical:
            pixels[:, span] = colour
        else:
            pixels[span, :] = colour
    return Image.fromarray(pixels)


# ---- image_folder -------------------------------------------------------------------------------------------------


def test_image_folder_classes_formats_shapes_and_range(tmp_path):
    write_classes(tmp_path, {"dog": 2, "cat": 2})  # written unsorted: ids must follow the sorted names
    for ext in ("JPG", "jpeg", "bmp", "gif", "webp"):
        solid(GREEN).save(tmp_path / "cat" / f"more.{ext}", format={"JPG": "JPEG", "jpeg": "JPEG"}.get(ext, ext))
    (tmp_path / "cat" / "nested").mkdir()
    solid(BLUE).save(tmp_path / "cat" / "nested" / "deep.png")
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    (tmp_path / ".cache").mkdir()  # hidden: not a class
    solid(RED).save(tmp_path / ".cache" / "x.png")

    data = ImageFolderDataModule(root=str(tmp_path), image_size=8, channels=3)
    assert data.class_names == ["cat", "dog"] and data.num_classes == 2
    assert data.describe() == {"channels": 3, "image_size": [8, 8], "num_classes": 2, "class_names": ["cat", "dog"]}
    assert data.skipped == []
    labels = [label for _, label in data.samples]
    assert labels.count(0) == 2 + 5 + 1 and labels.count(1) == 2
    dataset = data.build_dataset()
    for i in range(len(dataset)):
        x, label = dataset[i]
        assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and label.dtype == torch.int64
        assert -1 <= x.min() and x.max() <= 1
    dog = dataset[[i for i, (_, label) in enumerate(data.samples) if label == 1][0]][0]
    torch.testing.assert_close(dog, torch.full((3, 8, 8), 0 / 127.5 - 1))  # dog was written with grey level 0
    assert ImageFolderDataModule(root=str(tmp_path), image_size=[6, 10]).image_size == (6, 10)


def test_resize_center_crop_keeps_the_centre():
    # 60 x 20 -> shorter side 10 -> 30 x 10 -> the centre 10 columns are the green band (bicubic blurs 2 px per edge)
    wide = np.asarray(resize_center_crop(bands(60, 20), 10, 10), np.int16)  # (H, W, 3)
    assert wide.shape == (10, 10, 3)
    assert (wide[:, 2:8] == GREEN).all()
    np.testing.assert_allclose(wide[:, ::-1, 2], wide[:, :, 0], atol=1)  # centred: red left edge = blue right edge
    tall = np.asarray(resize_center_crop(bands(20, 60, vertical=False), 10, 10), np.int16)
    assert tall.shape == (10, 10, 3) and (tall[2:8] == GREEN).all()
    # the shorter side already fits: a pure crop, exact
    assert (np.asarray(resize_center_crop(bands(30, 10), 10, 10)) == GREEN).all()
    # a non-square target is covered, then cropped: 30 x 90 -> 10 x 30, rows 12..17 of the green rows 10..20
    flat = np.asarray(resize_center_crop(bands(30, 90, vertical=False), 5, 10), np.int16)
    assert flat.shape == (5, 10, 3) and (flat == GREEN).all()
    # truncation never leaves the image smaller than the target
    assert resize_center_crop(solid(RED, (7, 3)), 4, 4).size == (4, 4)


def test_image_folder_grayscale(tmp_path):
    (tmp_path / "a").mkdir()
    solid((255, 255, 255)).save(tmp_path / "a" / "white.png")
    solid(0, mode="L").save(tmp_path / "a" / "black.png")
    Image.new("RGBA", (12, 10), (255, 255, 255, 128)).save(tmp_path / "a" / "alpha.png")
    data = ImageFolderDataModule(root=str(tmp_path), image_size=[4, 6], channels=1)
    assert data.channels == 1 and data.image_size == (4, 6)
    images = {path.rsplit("/", 1)[-1]: data.build_dataset()[i][0] for i, (path, _) in enumerate(data.samples)}
    assert all(x.shape == (1, 4, 6) for x in images.values())
    torch.testing.assert_close(images["white.png"], torch.ones(1, 4, 6))
    torch.testing.assert_close(images["black.png"], -torch.ones(1, 4, 6))
    torch.testing.assert_close(images["alpha.png"], torch.ones(1, 4, 6))  # colour kept, alpha dropped


def test_unreadable_images_are_skipped_and_counted(tmp_path, caplog):
    write_classes(tmp_path, {"a": 2, "b": 1})
    (tmp_path / "a" / "garbage.png").write_bytes(b"not a png" * 20)
    (tmp_path / "b" / "empty.jpg").write_bytes(b"")
    png = (tmp_path / "a" / "0.png").read_bytes()
    (tmp_path / "b" / "truncated.png").write_bytes(png[: len(png) // 2])
    with caplog.at_level("WARNING"):
        data = ImageFolderDataModule(root=str(tmp_path), image_size=8)
    assert len(data.samples) == 3
    assert sorted(p.rsplit("/", 1)[-1] for p in data.skipped) == ["empty.jpg", "garbage.png", "truncated.png"]
    assert "skipped 3 unreadable image file(s)" in caplog.text and "garbage.png" in caplog.text


def _no_classes(root):
    solid(RED).save(root / "loose.png")


def _no_images(root):
    (root / "cat").mkdir()
    (root / "cat" / "readme.txt").write_text("x")


def _only_broken(root):
    (root / "cat").mkdir()
    for name in ("x.png", "y.jpg"):
        (root / "cat" / name).write_bytes(b"\x00" * 64)


@pytest.mark.parametrize(("setup", "kwargs", "message"), [
    (None, {"root": None}, "data.root is not set"),
    (None, {"root": "{root}/missing"}, "data.root={root}/missing does not exist"),
    (_no_classes, {"root": "{root}/loose.png"}, "data.root={root}/loose.png is a file, not a folder"),
    (_no_classes, {"root": "{root}"}, "data.root={root} has no class sub-folders"),
    (_no_images, {"root": "{root}"}, "data.root={root}: no image files (png, jpg"),
    (_only_broken, {"root": "{root}"}, "data.root={root}: none of its 2 image files could be read"),
    (_no_images, {"root": "{root}", "image_size": 0},
     "data.image_size must be a positive int or [height, width], got 0"),
    (_no_images, {"root": "{root}", "image_size": [8, 8, 8]}, "data.image_size must be"),
    (_no_images, {"root": "{root}", "channels": 4}, "data.channels must be 3 (RGB) or 1 (grayscale), got 4"),
])
def test_image_folder_errors_name_the_setting(tmp_path, setup, kwargs, message):
    if setup:
        setup(tmp_path)
    kwargs = {k: v.format(root=tmp_path) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError) as error:
        ImageFolderDataModule(**kwargs)
    assert message.format(root=tmp_path) in str(error.value)


# ---- latents ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "npy"])
def test_latents_images_with_class_names(tmp_path, fmt):
    latents = np.random.default_rng(0).standard_normal((10, 4, 8, 6)).astype(np.float32)
    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    data = LatentsDataModule(path=str(write_latents(tmp_path, latents, labels, ["a", "b", "c"], fmt)), scale=0.5)
    assert data.describe() == {"channels": 4, "image_size": [8, 6], "num_classes": 3, "class_names": ["a", "b", "c"],
                               "latent_scale": 0.5}
    dataset = data.build_dataset()
    assert len(dataset) == 10
    for i in (0, 7):
        x, label = dataset[i]
        assert x.dtype == torch.float32 and label.dtype == torch.int64 and int(label) == labels[i]
        torch.testing.assert_close(x, torch.from_numpy(latents[i]) * 0.5, rtol=0, atol=0)
    x, _ = pickle.loads(pickle.dumps(dataset))[7]  # what a spawned DataLoader worker receives, after a read
    torch.testing.assert_close(x, torch.from_numpy(latents[7]) * 0.5, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["safetensors", "npy"])
def test_latents_video_half_precision_without_names(tmp_path, fmt):
    latents = np.random.default_rng(1).standard_normal((6, 2, 4, 8, 8)).astype(np.float16)
    labels = np.array([0, 4, 1, 4, 2, 3], dtype=np.int32)
    data = LatentsDataModule(path=str(write_latents(tmp_path, latents, labels, fmt=fmt)))
    assert data.channels == 2 and data.image_size == (4, 8, 8)
    assert data.num_classes == 5 and data.class_names == ["0", "1", "2", "3", "4"]  # max label + 1
    x, label = data.build_dataset()[1]
    assert x.shape == (2, 4, 8, 8) and x.dtype == torch.float32 and int(label) == 4
    torch.testing.assert_close(x, torch.from_numpy(latents[1].astype(np.float32)), rtol=0, atol=0)


@pytest.mark.parametrize(("fmt", "latents", "labels", "names", "message"), [
    ("safetensors", GOOD[:, 0], LABELS, None, "latents have shape (10, 8, 8); expected (N, C, H, W)"),
    ("npy", GOOD[:, None, None], LABELS, None, "latents have shape (10, 1, 1, 4, 8, 8); expected"),
    ("npy", GOOD, LABELS[:, None], None, "labels have shape (10, 1); expected (N,)"),
    ("safetensors", GOOD, LABELS[:9], None, "latents hold 10 samples (shape (10, 4, 8, 8)) but labels hold 9"),
    ("npy", GOOD[:4], LABELS, None, "latents hold 4 samples (shape (4, 4, 8, 8)) but labels hold 10"),
    ("safetensors", GOOD, LABELS.astype(np.float32), None, "labels are F32; store integer class ids"),
    ("npy", GOOD, LABELS.astype(np.float64), None, "labels.npy holds float64; store integer class ids"),
    ("safetensors", GOOD, LABELS - 1, None, "labels include -1"),
    ("npy", GOOD, LABELS * 3, ["a", "b"], "labels go up to 3 but class_names lists 2 names"),
    ("safetensors", GOOD.astype(np.int64), LABELS, None, "latents are I64; store the encoder's floating-point output"),
])
def test_latents_errors_name_the_path_and_shapes(tmp_path, fmt, latents, labels, names, message):
    path = write_latents(tmp_path, latents, labels, names, fmt)
    with pytest.raises(ValueError) as error:
        LatentsDataModule(path=str(path))
    assert f"data.path={path}" in str(error.value) and message in str(error.value)


def test_latents_file_errors(tmp_path):
    def error_of(**kwargs) -> str:
        with pytest.raises(ValueError) as error:
            LatentsDataModule(**kwargs)
        return str(error.value)

    assert "data.path is not set" in error_of(path=None)
    assert f"data.path={tmp_path}/nope.safetensors does not exist" in error_of(path=f"{tmp_path}/nope.safetensors")
    (tmp_path / "model.pt").write_bytes(b"x")
    assert f"data.path={tmp_path}/model.pt is a .pt file" in error_of(path=f"{tmp_path}/model.pt")
    assert f"data.path={tmp_path} has no latents.npy" in error_of(path=str(tmp_path))
    save_file({"latents": torch.zeros(2, 1, 4, 4)}, tmp_path / "x.safetensors")
    assert "has no tensor 'labels' (it holds ['latents'])" in error_of(path=f"{tmp_path}/x.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"garbage!")
    assert "is not a readable .safetensors file" in error_of(path=f"{tmp_path}/bad.safetensors")
    folder = write_latents(tmp_path, GOOD, LABELS, fmt="npy")
    (folder / "class_names.json").write_text("[cat, dog]")
    assert "class_names.json is not valid JSON" in error_of(path=str(folder))
    assert "data.scale must be a positive number" in error_of(path=str(folder), scale=0)


# ---- moving_digits --------------------------------------------------------------------------------------------------


def test_bounce_is_a_reflection_inside_the_walls():
    positions = bounce(np.array([0.0, 7.0]), np.array([3.0, 3.0]), frames=6, limit=8)
    np.testing.assert_allclose(positions[:, 0], [0, 3, 6, 7, 4, 1])  # 9 -> 7: reflected at the far wall
    np.testing.assert_allclose(positions[:, 1], [7, 6, 3, 0, 3, 6])  # 10 -> 6, then 16 -> 0 off the near wall
    rng = np.random.default_rng(0)
    for _ in range(200):
        limit = int(rng.integers(1, 30))
        path = bounce(rng.uniform(0, limit, 2), rng.uniform(-3 * limit, 3 * limit, 2), 50, limit)
        assert path.min() >= 0 and path.max() <= limit
    assert (bounce(np.zeros(2), np.ones(2), 4, 0) == 0).all()  # the digit fills the canvas: it cannot move


def test_moving_digits_videos_draw_the_labelled_glyph_inside_the_canvas():
    data = MovingDigitsDataModule(frames=6, canvas=20, num_videos=200, seed=3)
    assert data.describe() == {"channels": 1, "image_size": [6, 20, 20], "num_classes": 10,
                               "class_names": [str(d) for d in range(10)]}
    dataset = data.build_dataset()
    digits = load_digits()
    bounced = 0
    for i in range(len(dataset)):
        x, label = dataset[i]
        digit, glyph, corners = dataset.motion(i)
        assert x.shape == (1, 6, 20, 20) and x.dtype == torch.float32 and label.dtype == torch.int64
        assert int(label) == digit == digits.target[glyph]
        assert corners.min() >= 0 and corners.max() <= 20 - 8  # the whole glyph stays on the canvas
        expected = -torch.ones(6, 20, 20)  # background -1, the glyph's 0..16 mapped to [-1, 1]
        for t, (row, col) in enumerate(corners):
            expected[t, row : row + 8, col : col + 8] = torch.from_numpy(digits.images[glyph] / 8.0 - 1.0)
        torch.testing.assert_close(x[0], expected)
        steps = np.diff(corners, axis=0)  # (T - 1, 2)
        assert np.abs(steps).max() <= 3  # at most 2 px per frame (+1 from rounding)
        bounced += bool((np.diff(np.sign(steps), axis=0) != 0).any())
    assert bounced > 20, f"only {bounced} of 200 videos bounced off a wall"


def test_moving_digits_are_deterministic_per_seed_and_index():
    first = MovingDigits(num_videos=50, frames=4, canvas=16, seed=7)
    again = MovingDigits(num_videos=1000, frames=4, canvas=16, seed=7)  # more videos: the first 50 are unchanged
    other = MovingDigits(num_videos=50, frames=4, canvas=16, seed=8)
    for i in (0, 13, 49):
        torch.testing.assert_close(first[i][0], again[i][0], rtol=0, atol=0)
        assert int(first[i][1]) == int(again[i][1])
    assert not all(torch.equal(first[i][0], other[i][0]) for i in range(5))
    assert not torch.equal(first[0][0], first[1][0])
    assert len({int(first[i][1]) for i in range(50)}) == 10  # every digit appears
    with pytest.raises(IndexError):
        first[50]


def test_moving_digits_scaled_glyphs():
    dataset = MovingDigitsDataModule(frames=2, canvas=24, digit_scale=2, num_videos=4).build_dataset()
    x, _ = dataset[0]
    _, glyph, corners = dataset.motion(0)
    row, col = corners[0]
    block = x[0, 0, row : row + 16, col : col + 16]  # (16, 16): each glyph pixel repeated 2 x 2
    torch.testing.assert_close(block[::2, ::2], torch.from_numpy(load_digits().images[glyph] / 8.0 - 1.0).float())
    torch.testing.assert_close(block[1::2, 1::2], block[::2, ::2])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"canvas": 7}, "data.canvas=7 is smaller than the digit (8 x data.digit_scale=1 = 8 pixels)"),
    ({"canvas": 20, "digit_scale": 3}, "data.canvas=20 is smaller than the digit (8 x data.digit_scale=3 = 24"),
    ({"frames": 0}, "data.frames must be a positive integer, got 0"),
    ({"num_videos": 2.5}, "data.num_videos must be a positive integer, got 2.5"),
    ({"digit_scale": 0}, "data.digit_scale must be a positive integer, got 0"),
])
def test_moving_digits_errors_name_the_setting(kwargs, message):
    with pytest.raises(ValueError) as error:
        MovingDigitsDataModule(**kwargs)
    assert message in str(error.value)


# ---- configs and end to end -----------------------------------------------------------------------------------------


def test_new_config_options_compose_into_a_model(tmp_path):
    """The yaml defaults instantiate, and their data fits the model it is meant for (shapes only, on meta)."""
    write_classes(tmp_path / "images", {"a": 1, "b": 1})
    path = write_latents(tmp_path, GOOD, LABELS)
    cases = {
        ("data=moving_digits", "model=dit_video"): 256,  # 4 x 8 x 8 tokens: what the preset is for
        ("data=image_folder", f"data.root={tmp_path / 'images'}", "model=dit_s"): 256,  # 32 x 32 RGB, 2x2 patches
        ("data=latents", f"data.path={path}", "model=dit_s"): 16,  # 8 x 8 latents, 2x2 patches
    }
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for overrides, tokens in cases.items():
            cfg = compose("train", overrides=list(overrides))
            data = instantiate(cfg.data)
            model = build_on_meta(model_config(cfg.model, data.describe()))
            assert model.in_channels == data.channels and model.pos_embed.shape[1] == tokens, overrides


def test_train_reports_a_missing_root_before_spawning(tmp_path):
    proc, _ = fail_fast("train.py", "data=image_folder", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.root is not set" in proc.stderr


def checkpoint_data(run_dir) -> dict:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    return ckpt["hyper_parameters"]["data"]


def test_train_on_an_image_folder(tmp_path):
    root = tmp_path / "images"
    for name, colour in (("red", RED), ("blue", BLUE)):
        (root / name).mkdir(parents=True)
        for i in range(8):
            solid(tuple(c * (i + 1) // 8 for c in colour), (14, 10)).save(root / name / f"{i}.png")
    run("train.py", tmp_path / "run", *TINY, "data=image_folder", f"data.root={root}", "data.image_size=8",
        "data.val_fraction=0.25")
    assert sorted(logged_losses(tmp_path / "run")) == [0, 1, 2]
    assert checkpoint_data(tmp_path / "run")["class_names"] == ["blue", "red"]


@pytest.mark.parametrize("fmt", ["safetensors", "npy"])
def test_train_on_latents(tmp_path, fmt):
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((40, 4, 8, 8)).astype(np.float32)
    path = write_latents(tmp_path, latents, np.arange(40) % 3, ["x", "y", "z"], fmt)
    run("train.py", tmp_path / "run", *TINY, "data=latents", f"data.path={path}", "data.scale=0.5")
    assert sorted(logged_losses(tmp_path / "run")) == [0, 1, 2]
    info = checkpoint_data(tmp_path / "run")
    assert info["channels"] == 4 and info["class_names"] == ["x", "y", "z"] and info["latent_scale"] == 0.5
    if fmt == "safetensors":  # sampling gives latents in the VAE's scale, not pictures
        run("infer.py", tmp_path / "infer", f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}",
            "num_samples=3", "labels=[z]", "diffusion.sampling.steps=2")
        samples = np.load(tmp_path / "infer" / "samples.npz")
        assert samples["latents"].shape == (3, 4, 8, 8) and samples["latents"].dtype == np.float32
        assert samples["labels"].tolist() == [2, 2, 2] and "images" not in samples
        assert not (tmp_path / "infer" / "samples.png").exists()
        if importlib.util.find_spec("diffusers"):  # vae=: the same latents, also decoded to pictures beside them
            from diffusers import AutoencoderKL

            AutoencoderKL(block_out_channels=[8, 8], down_block_types=["DownEncoderBlock2D"] * 2,
                          up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4,
                          norm_num_groups=4).save_pretrained(tmp_path / "vae")
            run("infer.py", tmp_path / "decoded", f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}",
                "num_samples=3", "labels=[z]", "diffusion.sampling.steps=2", f"vae={tmp_path / 'vae'}",
                env={"HF_HUB_OFFLINE": "1"})
            decoded = np.load(tmp_path / "decoded" / "samples.npz")
            np.testing.assert_array_equal(decoded["latents"], samples["latents"])
            assert sorted(p.name for p in (tmp_path / "decoded").glob("*.png")) == [
                "sample-000.png", "sample-001.png", "sample-002.png", "samples.png"]
            with Image.open(tmp_path / "decoded" / "sample-000.png") as picture:
                assert picture.size == (16, 16)  # 8 x 8 latents, two VAE blocks


@pytest.fixture(scope="module")
def video_run(tmp_path_factory):
    """The video DiT on 4 frames of 8 x 8 (32 tokens), its sequence sharded over a ring of 2 ranks."""
    run_dir = tmp_path_factory.mktemp("video") / "run"
    run("train.py", run_dir, *TINY, "model=dit_video", "data=moving_digits", "ring_degree=2", "data.num_videos=64",
        "data.frames=4", "data.canvas=8")
    return run_dir


def test_train_moving_digits_on_a_ring(video_run):
    assert sorted(logged_losses(video_run)) == [0, 1, 2]
    assert (video_run / "samples" / "step_0000003.gif").is_file()  # the preview grid of a video model animates
    assert checkpoint_data(video_run)["image_size"] == [4, 8, 8]


def test_infer_writes_video_samples(video_run, tmp_path):
    proc = run("infer.py", tmp_path, f"ckpt_path={video_run / 'checkpoints' / 'last.ckpt'}", "num_samples=3",
               "labels=[2,5]", "diffusion.sampling.steps=2")
    assert "wrote 3 samples" in proc.stdout
    samples = np.load(tmp_path / "samples.npz")
    assert samples["images"].shape == (3, 4, 8, 8, 1) and samples["images"].dtype == np.uint8
    assert samples["labels"].tolist() == [2, 5, 2]
    with Image.open(tmp_path / "samples.gif") as gif:
        assert gif.n_frames == 4


def test_data_classes_keeps_those_digits_images_only():
    """data.classes=[3,7]: exactly scikit-learn's images of the digits 3 and 7, in their order, with their labels."""
    from ringdit.data import DigitsDataModule

    digits = load_digits()
    images, labels = DigitsDataModule(classes=[3, 7]).build_dataset().tensors
    kept = np.isin(digits.target, [3, 7])
    assert labels.tolist() == digits.target[kept].tolist()
    assert torch.equal(images[:, 0], torch.from_numpy(digits.images[kept].astype(np.float32) / 8.0 - 1.0))
