"""A diffusers pipeline folder sampled as published (``ringdit.spec.pipeline_folder``): ``infer.py ckpt_path=<WanPipeline
folder>`` samples what ``WanPipeline`` itself returns for the same noise, prompt and defaults (its text encoder, UniPC
scheduler and shift, guidance, two experts); ``python -m ringdit.serve`` serves the folder and its videos equal
infer.py's; what such a folder cannot give is refused in one line.

fp32, to 1e-5 of the largest value: ringdit runs guidance's two halves in one batch, the pipeline in two forwards, so
the GEMMs round differently (measured 7e-7); a wrong default (shift, guidance, steps, scheduler, text length) differs by
orders of magnitude more. That the sampling arithmetic itself equals the pipelines' in fp64 (to 1e-10) is
tests/test_diffusers_schedulers.py's proof, with the embeddings given directly."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.helpers import assert_refused, fail_fast, run, served_video

pytest.importorskip("diffusers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "a red fox running"



SAMPLE = ["size=[16,16]", "frames=5", "diffusion.sampling.steps=3", "seed=4"]


def test_infer_samples_what_the_pipeline_returns(wan_pipeline_folder, tmp_path):
    """Same noise (ringdit's for seed 4, sample 0), prompt and defaults: the pipeline's latents."""
    import diffusers

    from ringdit.diffusion.samplers import initial_noise
    from ringdit.common.seeding import Stream, seed_of

    run("infer.py", tmp_path, f"ckpt_path={wan_pipeline_folder}", f"prompts=[{PROMPT}]", "num_samples=1", *SAMPLE)
    ours = torch.from_numpy(np.load(tmp_path / "samples.npz")["latents"]).double()  # (1, 16, 2, 2, 2)
    assert (tmp_path / "sample-000.mp4").is_file()  # decoded with the folder's VAE
    pipeline = diffusers.WanPipeline.from_pretrained(wan_pipeline_folder)
    noise = initial_noise((16, 2, 2, 2), [seed_of(Stream.INFERENCE, 4, 0)])
    theirs = pipeline(prompt=PROMPT, height=16, width=16, num_frames=5, num_inference_steps=3, latents=noise,
                      output_type="latent").frames.double()  # guidance_scale: its default, as ringdit's
    difference = (ours - theirs).abs().max().item() / theirs.abs().max().item()
    print(f"WanPipeline folder: ringdit vs the pipeline, largest difference / largest value {difference:.2e}")
    assert difference < 1e-5


def test_the_server_serves_a_pipeline_folder(wan_pipeline_folder, tmp_path):
    """python -m ringdit.serve ckpt_path=<folder>: a video equals infer.py's for the same prompt and seed."""
    run("infer.py", tmp_path / "infer", f"ckpt_path={wan_pipeline_folder}", f"prompts=[{PROMPT}]", "num_samples=1",
        *SAMPLE)
    served = served_video(wan_pipeline_folder, tmp_path / "serve", PROMPT, seed=4, steps=3, size=16, frames=5)
    assert served == (tmp_path / "infer" / "sample-000.mp4").read_bytes()


def test_what_a_pipeline_folder_cannot_give_is_refused(wan_pipeline_folder, tmp_path):
    import json

    for overrides, message in (
        ([], r"is a diffusers pipeline folder: give the prompts to encode with its text encoder"),
        (["size=[480,832]", f"prompts=[{PROMPT}]"], r"size=\[480, 832\]: 52 tokens along one axis, more than the 32"),
        ([f"prompts=[{PROMPT}]", f"base={wan_pipeline_folder}"], r"is a pipeline folder, sampled whole; drop base="),
    ):
        proc, seconds = fail_fast("infer.py", f"ckpt_path={wan_pipeline_folder}", "size=[16,16]", "frames=5",
                                  *overrides, f"hydra.run.dir={tmp_path / 'refused'}")
        assert_refused(proc, message, seconds=seconds)
    other = tmp_path / "Flux-tiny"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    proc, seconds = fail_fast("infer.py", f"ckpt_path={other}", f"prompts=[{PROMPT}]",
                              f"hydra.run.dir={tmp_path / 'flux'}")
    assert_refused(proc, r"is a FluxPipeline folder; ringdit samples WanPipeline folders as published", seconds=seconds)


@pytest.mark.parametrize("sampler", ["unipc", "flow_euler"])
def test_float64_sampling_is_the_float64_pipeline_from_the_same_noise(wan_pipeline_folder, tmp_path, sampler):
    """``trainer.precision=64-true`` (Lightning makes float64 the default dtype while predicting): the seed draws the
    same noise as in float32, UniPC (the folder's scheduler) steps in the pipeline's dtypes instead of failing, and the
    latents equal WanPipeline's with float64 transformers. Tolerance 1e-7 of the largest value: samples.npz holds
    float32 latents (rounding <= 2^-24 = 6e-8 relative), while the pipeline's flow Euler steps end in float64;
    UniPC keeps Wan's latents in float32 in both."""
    import diffusers

    from ringdit.diffusion.samplers import initial_noise
    from ringdit.common.seeding import Stream, seed_of

    chosen = [f"diffusion.sampling.sampler={sampler}"]
    run("infer.py", tmp_path / "fp64", f"ckpt_path={wan_pipeline_folder}", f"prompts=[{PROMPT}]", "num_samples=1",
        *SAMPLE,
        *chosen, "trainer.precision=64-true")
    ours = torch.from_numpy(np.load(tmp_path / "fp64" / "samples.npz")["latents"]).double()
    pipeline = diffusers.WanPipeline.from_pretrained(wan_pipeline_folder)
    for expert in (pipeline.transformer, pipeline.transformer_2):
        expert.to(torch.float64)  # its text encoder stays float32, as ringdit encodes prompts
    if sampler == "flow_euler":  # the folder's shift given to the chosen class, as ringdit does
        pipeline.scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=pipeline.scheduler.config.flow_shift)
    noise = initial_noise((16, 2, 2, 2), [seed_of(Stream.INFERENCE, 4, 0)])
    theirs = pipeline(prompt=PROMPT, height=16, width=16, num_frames=5, num_inference_steps=3, latents=noise,
                      output_type="latent").frames.double()
    difference = (ours - theirs).abs().max().item() / theirs.abs().max().item()
    print(f"{sampler} at 64-true vs the float64 pipeline: largest difference / largest value {difference:.2e}")
    assert difference < 1e-7


def test_prompts_are_cleaned_as_the_pipeline_cleans_them(wan_pipeline_folder, tmp_path):
    """WanPipeline cleans each prompt before encoding it (its ``prompt_clean``: HTML entities, runs of whitespace):
    so does ringdit for a folder whose pipeline does. ``&#32;`` is a space once unescaped: uncleaned, the word-level
    tokenizer would read "a&#32;red" as one unknown word."""
    import diffusers

    from ringdit.diffusion.samplers import initial_noise
    from ringdit.common.seeding import Stream, seed_of

    prompt = "a&#32;red   fox running "
    run("infer.py", tmp_path, f"ckpt_path={wan_pipeline_folder}", f"prompts=['{prompt}']", "num_samples=1", *SAMPLE)
    ours = torch.from_numpy(np.load(tmp_path / "samples.npz")["latents"]).double()
    noise = initial_noise((16, 2, 2, 2), [seed_of(Stream.INFERENCE, 4, 0)])
    theirs = diffusers.WanPipeline.from_pretrained(wan_pipeline_folder)(
        prompt=prompt, height=16, width=16, num_frames=5, num_inference_steps=3, latents=noise,
        output_type="latent").frames.double()
    difference = (ours - theirs).abs().max().item() / theirs.abs().max().item()
    assert difference < 1e-5  # as the plain prompt's test, module docstring


def test_the_shift_given_reaches_the_folders_scheduler(wan_pipeline_folder, tmp_path):
    """``diffusion.sampling.shift=5`` on a folder whose UniPC config says flow_shift 3: the pipeline's latents with
    its scheduler at flow_shift 5 (Wan's 720p setting), not at the folder's 3."""
    import diffusers

    from ringdit.diffusion.samplers import initial_noise
    from ringdit.common.seeding import Stream, seed_of

    run("infer.py", tmp_path, f"ckpt_path={wan_pipeline_folder}", f"prompts=[{PROMPT}]", "num_samples=1", *SAMPLE,
        "diffusion.sampling.shift=5")
    ours = torch.from_numpy(np.load(tmp_path / "samples.npz")["latents"]).double()
    pipeline = diffusers.WanPipeline.from_pretrained(wan_pipeline_folder)
    assert pipeline.scheduler.config.flow_shift == 3.0
    pipeline.scheduler = diffusers.UniPCMultistepScheduler.from_config(pipeline.scheduler.config, flow_shift=5.0)
    noise = initial_noise((16, 2, 2, 2), [seed_of(Stream.INFERENCE, 4, 0)])
    theirs = pipeline(prompt=PROMPT, height=16, width=16, num_frames=5, num_inference_steps=3, latents=noise,
                      output_type="latent").frames.double()
    assert (ours - theirs).abs().max().item() / theirs.abs().max().item() < 1e-5  # as the module docstring's
