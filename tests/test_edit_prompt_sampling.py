"""Sampling an edit model trained on prompts prepared with ``prompt_template=qwenimage_edit``: infer.py ``image=`` and
the server's ``POST /v1/images/edits`` encode each sample's prompt -- and its negative prompt -- with the sample's
reference picture through Qwen2.5-VL, equal to what ``QwenImageEditPipeline``'s own call encodes for that prompt and
image (``tests.edit_helpers.pipeline_encoding``); the server's command holds infer.py's numbers; a prompt that would
be encoded without its picture is refused in one line, whose advice works."""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from ringdit.media.text import TextEncoder
from tests.edit_helpers import pipeline_encoding, save_edit_folder, write_edit_pairs
from tests.helpers import compose_config, in_process, run

os.environ["HF_HUB_OFFLINE"] = "1"
TEXT_LEN = 40
HF = {"HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def edit_run(models, tmp_path_factory) -> SimpleNamespace:
    """(image, reference, caption) triples prepared with the tiny Qwen2.5-VL edit encoder and reference=, and
    qwenimage_edit_tiny trained on them for one step by train.py: its checkpoint, the encoder folder, the
    references."""
    from ringdit.prepare import main as prepare

    root = tmp_path_factory.mktemp("edit_sampling")
    encoder = save_edit_folder(root / "encoder")
    images, references, data = root / "images", root / "references", root / "data"
    write_edit_pairs(images, references)
    prepare([f"input={images}", f"out={data}", f"vae={models['flux']}", f"text_encoder={encoder}", "size=16",
             f"max_text_len={TEXT_LEN}", "prompt_template=qwenimage_edit", f"reference={references}"])
    run("train.py", root / "run", "model=qwenimage_edit_tiny", "data=text_latents", f"data.path={data}",
        "data.batch_size=2", "data.val_fraction=0.5", "trainer.max_steps=1", "logger=csv", "scheduler=constant",
        "callbacks.model_checkpoint.every_n_train_steps=1", env=HF)
    return SimpleNamespace(ckpt=root / "run" / "checkpoints" / "last.ckpt", encoder=encoder, references=references)


def upright(path: Path) -> Image.Image:
    with Image.open(path) as opened:
        return ImageOps.exif_transpose(opened).convert("RGB")


def assert_pipeline_states(states: dict, i: int, expected: torch.Tensor) -> None:
    """Row ``i`` of ``states`` (text (N, L, D), text_mask (N, L)) is ``expected`` (l, D) on its real tokens, zero
    after them."""
    length = len(expected)
    assert states["text_mask"][i].tolist() == [True] * length + [False] * (TEXT_LEN - length)
    torch.testing.assert_close(states["text"][i, :length], expected, rtol=1e-5, atol=1e-6)
    assert not states["text"][i, length:].any()


def test_infer_encodes_each_prompt_and_its_negative_with_its_reference(edit_run, tmp_path):
    """infer.py image=<folder> prompts=[..] negative_prompt=..: sample i's prompt (i % 2) and the negative prompt each
    encoded with sample i's reference (i % 4), as QwenImageEditPipeline's call encodes them; every sample guided away
    from its own negative."""
    from ringdit.sampling.conditions import sample_conditions
    from ringdit.spec import InferSpec

    prompts = ["a blue cat", "a red fox"]
    quoted = "prompts=[" + ", ".join(f'"{prompt}"' for prompt in prompts) + "]"
    spec = InferSpec.from_config(compose_config(
        "infer", tmp_path / "spec", f"ckpt_path={edit_run.ckpt}", f"image={edit_run.references}", quoted,
        "num_samples=5", "negative_prompt=a green field"))
    conditions, captions, negative, per_sample = sample_conditions(spec)
    assert captions == [prompts[i % 2] for i in range(5)] and negative is None
    negatives, given = per_sample
    assert given.tolist() == [True] * 5
    encoder = TextEncoder(edit_run.encoder, max_len=TEXT_LEN, prompt_template="qwenimage_edit")
    for i in range(5):
        picture = upright(edit_run.references / f"{i % 4}.png")
        assert_pipeline_states(conditions, i, pipeline_encoding(encoder, "QwenImageEditPipeline", prompts[i % 2],
                                                                picture))
        assert_pipeline_states(negatives, i, pipeline_encoding(encoder, "QwenImageEditPipeline", "a green field",
                                                               picture))
    # the pictures matter: the same negative prompt with two references, two encodings; sample 4 is sample 0's
    assert not torch.allclose(negatives["text"][0], negatives["text"][1])
    torch.testing.assert_close(negatives["text"][4], negatives["text"][0], rtol=0, atol=0)


def test_the_server_encodes_an_edit_as_infer_does(edit_run, tmp_path):
    """POST /v1/images/edits: the command the ranks sample holds infer.py's prompt and negative states for the same
    prompt and reference (the negative: the empty prompt with the picture, as the pipeline encodes it), and its
    pixels are infer.py's for the same seed."""
    import httpx

    from ringdit.sampling.conditions import sample_conditions
    from ringdit.spec import InferSpec
    from tests.serving import AUTH, KEY, pixels_of, serving

    reference = edit_run.references / "1.png"
    sample = ["prompts=[a blue cat]", "num_samples=1", "diffusion.sampling.steps=2", "seed=11"]
    run("infer.py", tmp_path / "infer", f"ckpt_path={edit_run.ckpt}", f"image={reference}", *sample, env=HF)
    expected = np.asarray(Image.open(tmp_path / "infer" / "sample-000.png"))
    spec = InferSpec.from_config(compose_config("infer", tmp_path / "spec", f"ckpt_path={edit_run.ckpt}",
                                                f"image={reference}", *sample))
    conditions, _, _, (negatives, _) = sample_conditions(spec)
    encoder = TextEncoder(edit_run.encoder, max_len=TEXT_LEN, prompt_template="qwenimage_edit")
    assert_pipeline_states(negatives, 0, pipeline_encoding(encoder, "QwenImageEditPipeline", "", upright(reference)))
    with serving(tmp_path / "serve", f"ckpt_path={edit_run.ckpt}", f"api_key={KEY}",
                 "diffusion.sampling.steps=2") as server:
        commands, command_of = [], server.rank0.sample_command
        server.rank0.sample_command = lambda jobs, sampler: commands.append(command_of(jobs, sampler)) or commands[-1]
        answer = httpx.post(server.url + "/v1/images/edits", headers=AUTH, timeout=120,
                            json={"prompt": "a blue cat", "image": base64.b64encode(reference.read_bytes()).decode(),
                                  "seed": 11})
        assert answer.status_code == 200, answer.text
        np.testing.assert_array_equal(pixels_of(answer.json()["data"][0]), expected)  # infer.py's, exactly
    command = commands[-1]
    for key in ("text", "text_mask", "reference"):
        torch.testing.assert_close(command["condition"][key], conditions[key], rtol=0, atol=0)
    for key in ("text", "text_mask"):
        torch.testing.assert_close(command["negative"][key], negatives[key], rtol=0, atol=0)


def test_a_prompt_without_its_picture_is_refused_in_one_line(edit_run, tmp_path):
    """negative_prompt= on the held-out prompts without image=: the negative cannot be encoded without a picture --
    one line naming the fix, before any rank starts; following it (image=) samples."""
    settings = [f"ckpt_path={edit_run.ckpt}", "negative_prompt=blurry", "num_samples=1",
                "diffusion.sampling.steps=1"]
    proc, _ = in_process("infer.py", f"hydra.run.dir={tmp_path / 'refused'}", *settings, env=HF)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert re.search(r"^Error: prompts: the data's text encoder \(prompt_template=qwenimage_edit\) encodes each prompt "
                     r"with its reference image, but no image was given for 1 prompts; pass the reference picture "
                     r"\(infer.py image=<file>, the server's images/edits image\)$", proc.stderr, re.M), proc.stderr
    run("infer.py", tmp_path / "advice", *settings, f"image={edit_run.references / '0.png'}", env=HF)
    assert (tmp_path / "advice" / "sample-000.png").is_file()
