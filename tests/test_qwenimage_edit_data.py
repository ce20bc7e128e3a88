"""``python -m ringdit.prepare reference=<folder>``: each image's reference image (same file name stem, the image's
aspect ratio) read at its image's size and encoded by the VAE as the images are, into the shards' ``reference``
latents (Qwen-Image-Edit's); a missing folder, an image without a reference, a reference of another aspect ratio and
a video among the images are refused in one line naming reference= before any model loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ringdit.common.errors import ConfigError


def write_image(path, size, seed):
    """A random RGB image of ``size`` (W, H)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def test_prepare_writes_each_images_reference_latents(models, tmp_path):
    """Two images whose references are each other's files: each shard row's ``reference`` is the other row's latents
    (read and encoded by the same path); a reference twice the size (the same ratio) is read at its image's size."""
    from safetensors.torch import load_file

    from ringdit.prepare import main as prepare

    images, references, out = tmp_path / "images", tmp_path / "references", tmp_path / "data"
    images.mkdir()
    references.mkdir()
    for i, caption in enumerate(["a red fox", "a blue cat"]):
        write_image(images / f"{i}.png", (16, 16), seed=i)
        (images / f"{i}.txt").write_text(caption)
    (references / "0.png").write_bytes((images / "1.png").read_bytes())
    (references / "1.png").write_bytes((images / "0.png").read_bytes())
    prepare([f"input={images}", f"out={out}", f"vae={models['flux']}", f"text_encoder={models['flux']}", "size=16",
             "max_text_len=8", f"reference={references}"])
    shard = load_file(next(out.glob("shard-*.safetensors")))
    assert shard["reference"].shape == shard["latents"].shape == (2, 4, 8, 8)  # the tiny VAE halves
    torch.testing.assert_close(shard["reference"], shard["latents"].flip(0), rtol=1e-5, atol=1e-6)
    write_image(references / "1.png", (32, 32), seed=5)  # another picture, twice the size: read at 16 x 16
    prepare([f"input={images}", f"out={tmp_path / 'again'}", f"vae={models['flux']}",
             f"text_encoder={models['flux']}", "size=16", "max_text_len=8", f"reference={references}"])
    again = load_file(next((tmp_path / "again").glob("shard-*.safetensors")))
    assert again["reference"].shape == (2, 4, 8, 8)
    assert not torch.allclose(again["reference"][1], shard["reference"][1])


def test_prepare_refuses_a_missing_or_mismatched_reference(tmp_path):
    """Before any model loads: one line naming reference= and the image; its advice fixes it."""
    from ringdit.media.control import find_references
    from ringdit.media.folder import list_media
    from tests.helpers import write_video

    images, references = tmp_path / "images", tmp_path / "references"
    images.mkdir()
    references.mkdir()
    write_image(images / "0.png", (24, 16), seed=0)
    (images / "0.txt").write_text("a fox")
    items = list_media(str(images), "text")
    with pytest.raises(ConfigError, match=r"reference=.* has no reference image for 0.png"):
        find_references(str(references), items)
    write_image(references / "0.png", (16, 16), seed=1)
    with pytest.raises(ConfigError, match=r"reference=.*: 0.png is 16x16 \(W x H\) but 0.png is 24x16: a different "
                                          r"aspect ratio; crop the reference to 24:16"):
        find_references(str(references), items)
    write_image(references / "0.png", (48, 32), seed=1)  # the advice: the image's ratio (any size)
    assert find_references(str(references), items) == {images / "0.png": references / "0.png"}
    with pytest.raises(ConfigError, match=r"reference=.*missing is not a folder"):
        find_references(str(tmp_path / "missing"), items)
    write_video(images / "1.mp4", 5, size=(16, 16))
    (images / "1.txt").write_text("a cat")
    with pytest.raises(ConfigError, match=r"reference=.*: 1.mp4 is a video, but a reference image conditions images"):
        find_references(str(references), list_media(str(images), "text"))
