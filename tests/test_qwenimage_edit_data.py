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
from tests.edit_helpers import write_edit_pairs, write_image


def test_prepare_writes_each_images_reference_latents(models, tmp_path):
    """Two images whose references are each other's files: each shard row's ``reference`` is the other row's latents
    (read and encoded by the same path); a reference twice the size (the same ratio) is read at its image's size."""
    from safetensors.torch import load_file

    from ringdit.prepare import main as prepare
    from ringdit.media.control_pixels import encode_reference

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
    with Image.open(references / "0.png") as picture:  # infer.py image='s encoding is prepare's
        infer_encoded = encode_reference([picture], vae=str(models["flux"] / "vae"), size=(16, 16))
    torch.testing.assert_close(infer_encoded, shard["reference"][:1], rtol=1e-5, atol=1e-6)
    write_image(references / "1.png", (32, 32), seed=5)  # another picture, twice the size: read at 16 x 16
    prepare([f"input={images}", f"out={tmp_path / 'again'}", f"vae={models['flux']}",
             f"text_encoder={models['flux']}", "size=16", "max_text_len=8", f"reference={references}"])
    again = load_file(next((tmp_path / "again").glob("shard-*.safetensors")))
    assert again["reference"].shape == (2, 4, 8, 8)
    assert not torch.allclose(again["reference"][1], shard["reference"][1])


def test_prepare_refuses_a_missing_or_mismatched_reference(tmp_path):
    """Before any model loads: one line naming reference= and the image; its advice fixes it."""
    from ringdit.media.control_pixels import find_references
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


# ---- prepare -> train.py (LoRA) -> infer.py image=: the whole way of an edit model -----------------------------------


@pytest.mark.timeout(600)
def test_an_edit_model_trains_on_prepared_triples_and_samples_with_image(models, tmp_path):
    """(image, reference, caption) triples prepared with reference=, qwenimage_edit_tiny trained on them by train.py
    (one step; a LoRA of a random base cannot be sampled: LoRA training is proven in test_qwenimage_edit.py), then
    infer.py image=<a reference> prompts=[..] samples (the reference encoded as prepare encodes it: test above), and
    the server's /v1/images/edits with that reference as base64 gives infer.py's pixels for the same seed, exactly; a
    reference of another aspect ratio is refused in one line before any rank starts (the server: a 400 naming image),
    and an edit model without image= (prompts given) too."""
    import base64

    import httpx

    from ringdit.prepare import main as prepare
    from tests.helpers import TEXT_LEN, run
    from tests.serving import AUTH, KEY, pixels_of, serving

    images, references, data = tmp_path / "images", tmp_path / "references", tmp_path / "data"
    write_edit_pairs(images, references)
    prepare([f"input={images}", f"out={data}", f"vae={models['flux']}", f"text_encoder={models['flux']}", "size=16",
             f"max_text_len={TEXT_LEN}", f"reference={references}"])
    run("train.py", tmp_path / "run", "model=qwenimage_edit_tiny", "data=text_latents", f"data.path={data}",
        "data.batch_size=2", "data.val_fraction=0.5", "trainer.max_steps=1", "logger=csv",
        "scheduler=constant", "callbacks.model_checkpoint.every_n_train_steps=1", env={"HF_HUB_OFFLINE": "1"})
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    sample = ["prompts=[a blue cat]", "num_samples=1", "diffusion.sampling.steps=2", "seed=11"]
    write_image(tmp_path / "wide.png", (32, 16), seed=3)
    run("infer.py", tmp_path / "infer", f"ckpt_path={ckpt}", f"image={references / '1.png'}", *sample,
        env={"HF_HUB_OFFLINE": "1"})
    expected = np.asarray(Image.open(tmp_path / "infer" / "sample-000.png"))  # decoded with the data's VAE, seed 11
    with serving(tmp_path / "serve", f"ckpt_path={ckpt}", f"api_key={KEY}", "diffusion.sampling.steps=2") as server:
        reference = base64.b64encode((references / "1.png").read_bytes()).decode()
        answer = httpx.post(server.url + "/v1/images/edits", headers=AUTH, timeout=120,
                            json={"prompt": "a blue cat", "image": reference, "seed": 11})
        assert answer.status_code == 200, answer.text
        np.testing.assert_array_equal(pixels_of(answer.json()["data"][0]), expected)  # infer.py's, exactly
        wide = base64.b64encode((tmp_path / "wide.png").read_bytes()).decode()
        answer = httpx.post(server.url + "/v1/images/edits", headers=AUTH, timeout=120,
                            json={"prompt": "a blue cat", "image": wide, "seed": 11})
        assert answer.status_code == 400 and "image is 32x16 but the samples are 16x16" in answer.text, answer.text
    with pytest.raises(AssertionError, match=r"image=.*wide.png is 32x16 \(W x H\) but the samples are 16x16: a "
                                             r"different aspect ratio"):
        run("infer.py", tmp_path / "wide", f"ckpt_path={ckpt}", f"image={tmp_path / 'wide.png'}", *sample)
    with pytest.raises(AssertionError, match=r"ckpt_path=.* give the first frame\(s\) with image="):
        run("infer.py", tmp_path / "none", f"ckpt_path={ckpt}", *sample)


def test_training_an_edit_model_on_data_without_references_is_refused_and_the_advice_composes():
    """model=qwenimage_edit* on data without 'reference' latents: one line naming the fix; the data it names
    (data=synthetic_text_latents data.reference=true) holds them."""
    from ringdit.data.synthetic_text_latents import synthetic_text_latents
    from ringdit.models.diffusers.data_checks import check_image_data
    from ringdit.models.diffusers.families import get_family

    family = get_family("qwenimage_edit")
    with pytest.raises(ConfigError, match=r"model.family=qwenimage_edit edits a reference image but the data has no "
                                          r"'reference' .*data=synthetic_text_latents data.reference=true"):
        check_image_data({}, family, {"image_keys": []})
    data = synthetic_text_latents(2, frames=0, reference=True)
    assert data["image"]["reference"].shape == data["latents"].shape == (2, 4, 8, 8)
    check_image_data({}, family, {"image_keys": list(data["image"])})
    with pytest.raises(ConfigError, match="data.reference=true needs images: set data.frames=0"):
        synthetic_text_latents(2, frames=3, reference=True)
