"""``ringdit.load``: a resident sampler in the caller's process. Its samples are infer.py's for the same settings and
seed (a DiT checkpoint), and WanPipeline's own for the same noise and prompt (a diffusers pipeline folder); every
bad argument is one ``ConfigError`` line naming it, whose advice works."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import ringdit
from ringdit.common.errors import ConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "a red fox running"


@pytest.fixture(scope="module")
def dit(tiny_checkpoint):
    return ringdit.load(tiny_checkpoint, device="cpu")


def test_a_dit_checkpoint_samples_what_infer_samples(dit, tiny_checkpoint, tmp_path):
    """Loaded once, called several times: each call equals infer.py's samples.npz for the same labels, steps, guidance
    and seed (infer.py run in this process, one batch of the same samples)."""
    settings = {"labels": [3, 7, 3], "steps": 2, "cfg_scale": 2.0, "seed": 5}
    folder = ringdit.sample(ringdit.config("infer", [
        f"ckpt_path={tiny_checkpoint}", "labels=[3,7,3]", "num_samples=3", "diffusion.sampling.steps=2",
        "diffusion.sampling.cfg_scale=2.0", "seed=5"], run_dir=tmp_path / "infer"))
    expected = torch.from_numpy(np.load(folder / "samples.npz")["images"])  # uint8 (3, 8, 8, 1)
    ours = dit(**settings, output="tensor")
    assert ours.dtype == torch.uint8 and ours.shape == expected.shape
    assert torch.equal(ours, expected)
    assert torch.equal(dit(**settings, output="tensor"), ours)  # again: the same model, the same samples
    assert not torch.equal(dit(**{**settings, "seed": 6}, output="tensor"), ours)  # another seed, other noise
    images = dit(labels=["3"], steps=2)
    assert len(images) == 1 and images[0].size == (8, 8)  # PIL images


def test_a_pipeline_folder_samples_what_the_pipeline_returns(wan_pipeline_folder):
    """A WanPipeline folder with prompts: the pipeline's latents for the same noise (ringdit's for seed 4, sample 0),
    prompt and defaults (its text encoder, UniPC, guidance); fp32, to 1e-5 of the largest value as
    tests/test_pipeline_folders.py's infer.py check. The videos come decoded by the folder's VAE, as PIL frames."""
    import diffusers

    from ringdit.common.seeding import Stream, seed_of
    from ringdit.diffusion.samplers import initial_noise

    pipe = ringdit.load(wan_pipeline_folder, device="cpu", size=(16, 16), frames=5)  # its default: 480 x 832
    ours = pipe(prompts=[PROMPT], steps=3, seed=4, output="latents").double()
    pipeline = diffusers.WanPipeline.from_pretrained(wan_pipeline_folder)
    noise = initial_noise((16, 2, 2, 2), [seed_of(Stream.INFERENCE, 4, 0)])
    theirs = pipeline(prompt=PROMPT, height=16, width=16, num_frames=5, num_inference_steps=3, latents=noise,
                      output_type="latent").frames.double()
    assert ours.shape == theirs.shape == (1, 16, 2, 2, 2)
    assert (ours - theirs).abs().max() / theirs.abs().max() < 1e-5
    videos = pipe(prompts=[PROMPT, "a 3 moving left"], size=(32, 16), frames=9, steps=3, seed=4)
    assert len(videos) == 2 and len(videos[0]) == 9 and videos[0][0].size == (16, 32)  # PIL: (W, H)
    with pytest.raises(ConfigError, match=r"^labels= was given, but this is a text-conditioned model: pass "
                                          r"prompts=\[\.\.\.\] instead"):
        pipe(labels=[3])


@pytest.mark.parametrize("arguments, message, fix", [
    ({"prompts": ["a 3"]}, r"prompts= was given, but this is a class-conditional model: pass labels=\[\.\.\.\] "
                           r"instead, e.g. labels=\[3, 7\]", {"labels": [3, 7]}),
    ({"labels": []}, r"labels must be a non-empty list, got \[\]; pass e.g. labels=\[3, 7\]", {"labels": [3, 7]}),
    ({"labels": [3], "steps": 0}, r"steps must be a positive integer, got 0", {"labels": [3], "steps": 1}),
    ({"labels": [3], "cfg_scale": -1.0}, r"cfg_scale", {"labels": [3], "cfg_scale": 1.0}),
    ({"labels": [3], "seed": -1}, r"seed must be an integer from 0 to 2\*\*32 - 1", {"labels": [3], "seed": 1}),
    ({"labels": [3], "size": (5, 8)}, r"size=\[5, 8\]: the height 5 is not a multiple of 2", {"labels": [3],
                                                                                            "size": (6, 8)}),
    ({"labels": [3], "size": 8}, r"size=8 is not \(H, W\)", {"labels": [3], "size": (8, 8)}),
    ({"labels": [3], "frames": 5}, r"frames=5: the model makes images .*; drop frames", {"labels": [3]}),
    ({"labels": [12]}, r"labels: class id 12 is out of range; this model has classes 0\.\.9; pass class ids 0\.\.9",
     {"labels": [9]}),
    ({"labels": [3], "output": "jpg"}, r"output must be one of pil \| tensor \| latents, got 'jpg'",
     {"labels": [3], "output": "pil"}),
    ({"labels": [3], "output": "latents"}, r"output='latents': this model samples pixels .*; pass output='pil' or "
                                           r"output='tensor'", {"labels": [3], "output": "tensor"}),
    ({"labels": [3], "negative_prompt": "blurry"}, r"negative_prompt='blurry': give one string with prompts=",
     {"labels": [3]}),
])
def test_a_bad_call_is_one_line_naming_the_argument(dit, arguments, message, fix):
    with pytest.raises(ConfigError, match=message) as refused:
        dit(**{"steps": 1, **arguments})
    assert "\n" not in str(refused.value)
    assert len(dit(**{"steps": 1, **fix})) == len(fix["labels"])  # the advice works


def test_a_bad_load_is_one_line_naming_the_argument(tiny_checkpoint, tmp_path):
    for arguments, message in (
        ({"ckpt_path": tmp_path / "missing.ckpt"}, r"ckpt_path: checkpoint .*missing\.ckpt' does not exist"),
        ({"ckpt_path": 3}, r"ckpt_path must be a checkpoint path \(a str or a pathlib\.Path\), got 3"),
        ({"ckpt_path": tiny_checkpoint, "device": "tpu9"}, r"device='tpu9' is not a torch device; pass "
                                                           r"device='cpu'"),
        ({"ckpt_path": tiny_checkpoint, "weights": "best"}, r"weights must be one of ema \| model, got 'best'"),
        ({"ckpt_path": tiny_checkpoint, "vae": 5}, r"vae must be a folder or file path"),
    ):
        with pytest.raises(ConfigError, match=message) as refused:
            ringdit.load(**arguments)
        assert "\n" not in str(refused.value), refused.value
    assert ringdit.load(tiny_checkpoint, device="cpu", weights="model")(labels=[1], steps=1)  # the fixes work
