"""infer.py at a chosen shape (``size=[H, W]``, ``frames=N``) and from a prompt file of per-prompt sizes, and preview
grids at a chosen shape: samples do not depend on the layout at token counts that do not divide the sequence-parallel
degree (padded), mixed shapes are batched and written per shape, and every mistake is refused before spawning.

Tiny exports with random weights (nothing trained): a text-to-video Wan whose data records a Wan-style VAE (8x
spatial, 4x temporal: sizes in pixels and video frames), and a pixel-space DiT on 8x8 images (sizes in pixels, which
are its cells)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ringdit.common.errors import ConfigError
from ringdit.sampling import SampleRequests, SampleSizes, read_prompt_file
from tests.helpers import TEXT_LEN, architecture, assert_refused, fail_fast, read_mp4, run

CHANNELS = 16  # the tiny Wan VAE's z_dim (conftest's ``models``)


def save_export(path, model_cfg: dict, data: dict, sampling: dict) -> None:
    """A ringdit .safetensors export of ``model_cfg`` with seeded random weights."""
    from hydra.utils import get_class

    torch.manual_seed(0)
    model = get_class(model_cfg["_target_"])(**{k: v for k, v in model_cfg.items() if k != "_target_"})
    metadata = {"model": model_cfg, "data": data, "objective": {"_target_": "ringdit.diffusion.FlowMatching"},
                "sampling": sampling}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path,
              metadata={k: json.dumps(v) for k, v in metadata.items()} | {"format": "ringdit"})


@pytest.fixture(scope="module")
def exports(models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("exports")
    config = architecture("wan_tiny") | {"in_channels": CHANNELS, "out_channels": CHANNELS}
    shape = [3, 8, 8]  # latent (T, H, W): 9 frames of 64 x 64 pixels
    wan = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "wan", "config": config,
           "input_size": shape, "in_channels": CHANNELS, "text_len": TEXT_LEN, "text_dim": 16}
    vae = {"class": "AutoencoderKLWan", "path": str(models["wan"]), "spatial_compression": 8,
           "temporal_compression": 4, "latent_channels": CHANNELS, "shift": [0.0] * CHANNELS,
           "scale": [1.0] * CHANNELS}
    text_encoder = {"class": "T5EncoderModel", "path": str(models["wan"] / "text_encoder"),
                    "tokenizer": str(models["wan"] / "tokenizer"), "max_len": TEXT_LEN, "dim": 16, "pooled": False}
    data = {"channels": CHANNELS, "image_size": shape, "buckets": [{"shape": shape, "samples": 8}],
            "conditioning": "text", "text_len": TEXT_LEN, "text_dim": 16, "num_classes": 0, "class_names": [],
            "latent_scale": 1.0, "vae": vae, "text_encoder": text_encoder}
    save_export(root / "wan.safetensors", wan, data, {"sampler": "euler", "steps": 3, "cfg_scale": 4.0})
    dit = {"_target_": "ringdit.models.DiT", "input_size": [8, 8], "patch_size": 2, "in_channels": 1,
           "hidden_size": 32, "depth": 1, "num_heads": 2, "num_classes": 2, "learn_sigma": False}
    save_export(root / "dit.safetensors", dit, {"channels": 1, "image_size": [8, 8], "num_classes": 2,
                                                 "class_names": ["a", "b"]}, {"sampler": "euler", "steps": 2})
    return {"wan": root / "wan.safetensors", "dit": root / "dit.safetensors", "root": root}


# two sizes: 48 x 80 px, 9 frames = latent (3, 6, 10) = 3 x 3 x 5 = 45 tokens, odd, so ring 2 pads the tail; the
# second line takes the command line's size=[32,48] frames=5: latent (2, 4, 6) = 12 tokens. Lines 0 and 2 share a
# batch at one process, one with its own negative prompt and one without (the model's empty prompt)
PROMPTS = [{"prompt": "a red fox running", "size": [48, 80], "frames": 9},
           {"prompt": "a blue cat", "negative_prompt": "green field"},
           {"prompt": "a red sky", "size": [48, 80], "frames": 9, "negative_prompt": "a blue sky"}]
# ring 2 x dp 2 (4 processes, about the time of a ring 2 run and a dp 2 run): each replica's ring pads the 45 tokens
# to 2 x 23, and the replicas split the requests (rank 0: samples 0 and 1, rank 1: sample 2, so it has none of the
# second shape: the writer gathers shape by shape). Ulysses 2 pads too: not run here, measured equal to ring 1
LAYOUTS = {"ring1": [], "ring2_dp2": ["ring_degree=2", "dp_degree=2"]}


@pytest.fixture(scope="module")
def prompt_runs(exports) -> dict:
    """infer.py from the prompt file under each layout: 3 samples (lines 0, 1, 2), batch size 2."""
    lines = exports["root"] / "prompts.jsonl"
    lines.write_text("\n".join(json.dumps(line) for line in PROMPTS) + "\n\n")
    runs = {}
    for name, overrides in LAYOUTS.items():
        out = exports["root"] / f"infer_{name}"
        run("infer.py", out, f"ckpt_path={exports['wan']}", f"prompt_file={lines}", "size=[32,48]", "frames=5",
            "num_samples=3", "batch_size=2", *overrides, env={"HF_HUB_OFFLINE": "1"})
        runs[name] = out
    return runs


def test_mixed_sizes_are_written_per_shape_and_decoded(prompt_runs):
    out = prompt_runs["ring1"]
    big, small = np.load(out / "samples-48x80x9.npz"), np.load(out / "samples-32x48x5.npz")
    assert big["latents"].shape == (2, CHANNELS, 3, 6, 10) and small["latents"].shape == (1, CHANNELS, 2, 4, 6)
    assert big["index"].tolist() == [0, 2] and small["index"].tolist() == [1]
    assert list(big["captions"]) == ["a red fox running", "a red sky"] and list(small["captions"]) == ["a blue cat"]
    assert not (out / "samples.npz").exists()
    # decoded with the data's VAE: a grid per shape, and each sample's files under its own number

    assert (out / "samples-48x80x9.gif").is_file() and (out / "samples-32x48x5.gif").is_file()
    assert read_mp4(out / "sample-002.mp4").shape == (9, 48, 80, 3)
    assert read_mp4(out / "sample-001.mp4").shape == (5, 32, 48, 3)
    assert np.isfinite(big["latents"]).all() and not np.allclose(big["latents"][0], big["latents"][1])


def test_samples_at_a_padded_size_do_not_depend_on_the_layout(prompt_runs):
    """fp32: ring 2 reorders each forward's sums (and pads 45 tokens to 2 x 23), data parallel runs other batch sizes:
    ~ulps of latents of max ~4.8 grown by 3 steps at CFG 4 (4 c - 3 u): 1.9e-6 measured, 1e-4 is 50x that (the bound
    of tests/test_diffusers_training.py::test_wan_samples_do_not_depend_on_the_layout)."""
    for name in ("samples-48x80x9.npz", "samples-32x48x5.npz"):
        reference, other = np.load(prompt_runs["ring1"] / name), np.load(prompt_runs["ring2_dp2"] / name)
        assert other["index"].tolist() == reference["index"].tolist()
        assert list(other["captions"]) == list(reference["captions"])
        np.testing.assert_allclose(other["latents"], reference["latents"], atol=1e-4)


def test_size_on_the_command_line_of_an_image_dit(exports, tmp_path):
    """One process (trainer=cpu), in this one as tests/test_preemption.py's in_process_infer samples."""
    proc, _ = fail_fast("infer.py", f"ckpt_path={exports['dit']}", "size=[6,12]", "num_samples=2", "labels=[0,1]",
                        "trainer=cpu", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    samples = np.load(tmp_path / "samples.npz")
    assert samples["images"].shape == (2, 6, 12, 1) and samples["labels"].tolist() == [0, 1]


BAD = {  # (which export, overrides, the one-line error)
    "size not a pair": ("wan", ["size=[48]"], r"^Error: size=\[48\] is not \[H, W\], two positive whole numbers "
                                              r"\(pixels\); e.g. size=\[64,64\]$"),
    "size not whole": ("wan", ["size=[48,80.5]"], r"size=\[48, 80.5\] is not \[H, W\]"),
    "size not divisible": ("wan", ["size=[100,64]"], r"size=\[100, 64\]: the height 100 is not a multiple of 16 "
                                                     r"\(the VAE's 8x downsampling x the model's patch 2\); the "
                                                     r"nearest valid heights are 96 or 112, e.g. size=\[96,64\]"),
    "grid below a patch": ("wan", ["size=[64,8]"], r"the width 8 is smaller than one model token, 16 pixels .*"
                                                   r"use at least 16, e.g. size=\[64,16\]"),
    "frames not 1 + 4k": ("wan", ["frames=6"], r"frames=6 is not a frame count the model takes: 1 \+ k x 4 \(the "
                                               r"VAE's temporal compression 4\); the nearest valid counts are 5 and 9"),
    "frames of an image model": ("dit", ["frames=5"], r"frames=5: the model makes images \(8x8\), not videos; "
                                                      r"drop frames"),
    "cells not divisible": ("dit", ["size=[7,8]"], r"size=\[7, 8\]: the height 7 is not a multiple of 2 \(the "
                                                   r"model's patch 2\)"),
    "prompt_file and prompts": ("wan", ["prompt_file={file}", "prompts=[a cat]"],
                                r"give prompt_file= \(prompts with their own sizes\) or prompts=, not both"),
    "prompt_file for a class model": ("dit", ["prompt_file={file}"], r"prompt_file=.*: ckpt_path=.* is a "
                                                                     r"class-conditional model, which takes no text"),
}
BAD_LINES = {  # a prompt file's second line -> the error naming it
    "not JSON": ('{"prompt": "a cat",}', r"the line is not valid JSON \(Expecting property name"),
    "not an object": ('["a cat"]', r"a JSON list, not an object such as"),
    "prompt not a string": ('{"prompt": 3}', r"\"prompt\" must be a non-empty string, got 3"),
    "unknown key": ('{"prompt": "a cat", "sise": [64, 64]}', r"unknown key 'sise'; a line holds prompt, size, "
                                                            r"frames, negative_prompt"),
    "size not two ints": ('{"prompt": "a cat", "size": [64, "64"]}', r"size=\[64, '64'\] is not \[H, W\]"),
    "size not divisible": ('{"prompt": "a cat", "size": [64, 72]}', r"size=\[64, 72\]: the width 72 is not a "
                                                                    r"multiple of 16"),
    "frames not 1 + 4k": ('{"prompt": "a cat", "frames": 4}', r"frames=4 is not a frame count"),
}


def refused(exports, tmp_path, which: str, *overrides: str) -> str:
    run_dir = tmp_path / "infer"
    proc, seconds = fail_fast("infer.py", f"ckpt_path={exports[which]}", "num_samples=1", f"hydra.run.dir={run_dir}",
                              *overrides)
    line = assert_refused(proc, seconds=seconds)
    assert not run_dir.exists() or not any(run_dir.glob("samples*"))
    return line


@pytest.mark.parametrize("case", list(BAD))
def test_bad_sizes_are_refused_before_spawning(case, exports, tmp_path):
    which, overrides, message = BAD[case]
    file = tmp_path / "prompts.jsonl"
    file.write_text('{"prompt": "a cat"}\n')
    line = refused(exports, tmp_path, which, *(o.format(file=file) for o in overrides))
    assert re.search(message, line), line


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_prompt_file_line_is_refused_before_spawning(case, exports, tmp_path):
    text, message = BAD_LINES[case]
    file = tmp_path / "prompts.jsonl"
    file.write_text(f'{{"prompt": "a red fox", "size": [48, 80]}}\n{text}\n')
    line = refused(exports, tmp_path, "wan", f"prompt_file={file}")
    assert line.startswith(f"Error: prompt_file={file} line 2: ") and re.search(message, line), line


def test_prompt_files_and_requests(tmp_path):
    """A .txt file is one prompt per line; the requests keep each sample's number and seed whatever the other
    samples' shapes, and no batch mixes shapes."""
    txt = tmp_path / "p.txt"
    txt.write_text("a red fox\n\n  a blue cat  \n")
    assert [line.prompt for line in read_prompt_file(txt)] == ["a red fox", "a blue cat"]
    with pytest.raises(ConfigError, match=r"prompt_file=.*p.csv is not a .jsonl or .txt file"):
        read_prompt_file(tmp_path / "p.csv")
    shapes = [(1, 4, 4), (1, 2, 2), (1, 4, 4), (1, 4, 4), (1, 2, 2)]
    requests = SampleRequests(list(range(5)), seed=3, shapes=shapes)
    alone = SampleRequests(list(range(5)), seed=3)
    assert [requests[p][0] for p in range(5)] == [0, 2, 3, 1, 4]  # by shape, in order of first appearance
    assert all(requests[p][2] == alone.noise_seed(requests[p][0]) for p in range(5))
    batches = list(requests.batches(2))
    assert batches == [[0, 1], [2], [3, 4]]
    assert all(len({tuple(requests[p][3]["shape"].tolist()) for p in batch}) == 1 for batch in batches)
    sizes = SampleSizes.of({"image_size": [3, 8, 8], "vae": {"spatial_compression": 8, "temporal_compression": 4}},
                           (1, 2, 2))
    assert sizes.shape([48, 80], 9) == (3, 6, 10) and sizes.name((3, 6, 10)) == "48x80x9"
    assert sizes.shape() == (3, 8, 8)


def test_preview_grids_at_a_chosen_size(monkeypatch):
    from types import SimpleNamespace

    from ringdit.diffusion.pipeline import SamplingPipeline

    from ringdit.training import DiffusionModule, SampleGrid

    with pytest.raises(ConfigError, match=r"callbacks.sample_grid.size=\[8\] is not \[H, W\]"):
        SampleGrid("unused", size=[8])
    with pytest.raises(ConfigError, match=r"callbacks.sample_grid.frames must be a positive integer"):
        SampleGrid("unused", frames=0)
    data = {"channels": 1, "image_size": [8, 8], "num_classes": 2, "class_names": ["a", "b"]}
    grid = SampleGrid("unused", size=[5, 8])
    with pytest.raises(ConfigError, match=r"callbacks.sample_grid.size=\[5, 8\]: the height 5 is not a multiple of 2"):
        grid.check_shape(data, (2, 2))
    module = DiffusionModule(model={"_target_": "ringdit.models.DiT", "input_size": [8, 8], "patch_size": 2,
                                    "in_channels": 1, "hidden_size": 32, "depth": 1, "num_heads": 2, "num_classes": 2,
                                    "learn_sigma": False},
                             objective={"_target_": "ringdit.diffusion.FlowMatching"}, data=data,
                             sampling={"sampler": "euler", "steps": 1})
    module.configure_model()
    grid = SampleGrid("unused", size=[6, 12], per_class=1)
    trainer = SimpleNamespace(global_step=0, is_global_zero=False, loggers=[], datamodule=None)
    grid.on_fit_start(trainer, module)
    seen, generate = [], SamplingPipeline.generate_joint  # what the preview's Sampler calls

    def spy(*args, **kwargs):
        samples, joint = generate(*args, **kwargs)
        seen.append(tuple(samples.shape))
        return samples, joint

    monkeypatch.setattr(SamplingPipeline, "generate_joint", spy)
    grid.make_grid(trainer, module)
    assert grid.shape == (6, 12) and seen == [(2, 1, 6, 12)]  # a row per class, at the chosen size
