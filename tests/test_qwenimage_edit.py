"""Qwen-Image-Edit (diffusers' QwenImageTransformer2DModel, unmodified, called as QwenImageEditPipeline calls it: the
reference image's packed latents after the image's, img_shapes listing both grids, the prediction sliced to the image)
under ringdit's plan, in float64: the same numbers as the model called directly on one process -- forward and every
parameter gradient -- on one process and on 4 gloo CPU ranks under ring 2, ring 4, Ulysses 2 and 2 x 2, with the
image (3 x 3 = 9 tokens), the reference (5 x 5 = 25) and the text (5) tail-padded on every layout, and with
Qwen-Image-Edit-2511's per-token modulation (zero_cond_t); a reference that does not fit is refused."""

from __future__ import annotations

import os

import pytest
import torch

from ringdit.models import parallelize
from ringdit.parallel import init_sequence_parallel
from tests.diffusers_helpers import (LAYOUTS, assert_matches_in_float64, check_sgd_layouts, ddp_average, float64_kept,
                                     forward_backward, training_module)
from tests.distributed import run_ranks
from tests.helpers import architecture

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE, REFERENCE = (6, 6), (10, 10)  # (H, W) latents: 9 and 25 tokens of 2 x 2 patches, padded on every layout
TEXT_LEN = 5
T = torch.tensor([30.0, 810.0], dtype=torch.float64)


def edit_case(zero_cond_t=False, seed=0, dims=None):
    """The same weights and inputs on every rank: the unmodified reference called as the edit pipeline calls it, the
    ringdit model's call (float64), dout."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer
    from ringdit.models.diffusers.packing import pack_latents, unpack_latents

    config = {**architecture("qwenimage_edit_tiny"), "zero_cond_t": zero_cond_t}
    torch.manual_seed(seed)
    reference = diffusers.QwenImageTransformer2DModel.from_config(config).double()
    model = DiffusersTransformer("qwenimage_edit", config=config, input_size=SHAPE, in_channels=4,
                                 text_len=TEXT_LEN, text_dim=16)
    model.transformer.load_state_dict(reference.state_dict())
    parallelize(model.double(), dims=dims)  # dims None: one process, attention still routed to ringdit
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 4, *SHAPE, generator=g, dtype=torch.float64)
    ref_latents = torch.randn(2, 4, *REFERENCE, generator=g, dtype=torch.float64)
    mask = torch.tensor([[True] * TEXT_LEN, [True, True, True, False, False]])  # the second prompt padded
    text = torch.randn(2, TEXT_LEN, 16, generator=g, dtype=torch.float64) * mask[..., None]
    dout = torch.randn(2, 4, *SHAPE, generator=g, dtype=torch.float64)

    def run_pipeline_call():  # QwenImageEditPipeline's denoising-loop call, its slice, then ringdit's unpacking
        latents = pack_latents(x)
        out = reference(hidden_states=torch.cat([latents, pack_latents(ref_latents)], dim=1), timestep=T / 1000,
                        encoder_hidden_states_mask=mask, encoder_hidden_states=text,
                        img_shapes=[[(1, SHAPE[0] // 2, SHAPE[1] // 2), (1, REFERENCE[0] // 2,
                                                                         REFERENCE[1] // 2)]] * 2,
                        return_dict=False)[0]
        return unpack_latents(out[:, : latents.size(1)], *SHAPE)

    def run_model():
        return model(x, T, {"text": text, "text_mask": mask, "reference": ref_latents})

    return reference, model, run_pipeline_call, run_model, dout


def run_both(zero_cond_t=False, dims=None):
    reference, model, run_pipeline_call, run_model, dout = edit_case(zero_cond_t, dims=dims)
    with float64_kept():  # QwenImage's RoPE rounds q and k to float32 (x.float()): kept float64 on both sides
        expected = forward_backward(run_pipeline_call, reference, dout)
        got = forward_backward(run_model, model.transformer, dout)
    return got, expected


def check_layouts(rank, world):
    # Qwen-Image-Edit (2508 / 2509) and -2511 (zero_cond_t) alternate: each on a ring-only layout and one with Ulysses
    for (ring, ulysses), zero_cond_t in zip(LAYOUTS, (False, True, False, True)):
        (out, grads), expected = run_both(zero_cond_t, dims=init_sequence_parallel(ring, ulysses))
        ddp_average(grads)  # DDP's average over the dp x sp ranks
        assert_matches_in_float64((out, grads), expected,
                                  f"ring {ring} x ulysses {ulysses}, zero_cond_t={zero_cond_t}")


def test_qwenimage_edit_matches_the_edit_pipelines_call_under_every_layout():
    run_ranks(check_layouts, 4)


@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["edit", "edit-2511"])
def test_qwenimage_edit_one_process_equals_the_edit_pipelines_call(zero_cond_t):
    assert_matches_in_float64(*run_both(zero_cond_t), f"one process, zero_cond_t={zero_cond_t}")


def test_a_missing_or_unfitting_reference_is_refused():
    _, model, _, _, _ = edit_case()
    x = torch.zeros(2, 4, *SHAPE, dtype=torch.float64)
    text, mask = torch.zeros(2, TEXT_LEN, 16, dtype=torch.float64), torch.ones(2, TEXT_LEN, dtype=torch.bool)
    with pytest.raises(ValueError, match="model.family=qwenimage_edit denoises beside a reference image, but the "
                                         "conditioning has no 'reference' latents"):
        model(x, T, {"text": text, "text_mask": mask})
    for shape in [(2, 3, 10, 10), (1, 4, 10, 10), (2, 4, 10, 7)]:  # other channels, samples, an odd width
        with pytest.raises(ValueError, match=r"the reference latents \(.*\) do not fit the latents \(2, 4, 6, 6\)"):
            model(x, T, {"text": text, "text_mask": mask, "reference": torch.zeros(shape, dtype=torch.float64)})


# ---- training: DiffusionModule's loss and SGD steps in the ranks ---------------------------------------------------

MODEL = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "qwenimage_edit",
         "config": architecture("qwenimage_edit_tiny"), "input_size": list(SHAPE), "in_channels": 4,
         "text_len": TEXT_LEN, "text_dim": 16, "condition_dropout_prob": 0.5}  # half drop their prompt, none the image
STEPS, LR = 2, 0.5


def batch():
    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(2, 4, *SHAPE, generator=g)
    mask = torch.tensor([[True] * TEXT_LEN, [True, True, False, False, False]])
    cond = {"text": torch.randn(2, TEXT_LEN, 16, generator=g) * mask[..., None], "text_mask": mask,
            "reference": torch.randn(2, 4, *REFERENCE, generator=g)}
    return training_module(SHAPE), x0, cond


def check_training(rank, world):
    check_sgd_layouts(world, MODEL, batch, STEPS, LR)


def test_qwenimage_edit_sgd_steps_equal_one_process_under_ddp_fsdp_and_lora():
    run_ranks(check_training, 2)


# ---- sampling: a Sampler against QwenImageEditPipeline's loop ------------------------------------------------------


def test_sampling_with_a_reference_equals_the_edit_pipelines_loop(monkeypatch):
    """For the same noise, prompt embeddings (a padded mask), flow-matching Euler scheduler with Qwen-Image's dynamic
    shift and reference image, a ``Sampler`` of the model with the reference latents in the conditioning gives
    QwenImageEditPipeline's latents; the reference latents are the pipeline's own (its resize, preprocessing and
    ``_encode_vae_image`` over a tiny random Qwen-Image VAE). Guidance 1: the pipeline's true CFG rescales the guided
    prediction to the conditional one's norm, which ringdit's guidance does not. The pipeline resizes the reference
    to about a megapixel (``calculate_dimensions(1024 * 1024, ratio)``); here to 64 x 64 pixels (its loop and model
    calls untouched) so that the test stays small. float64."""
    import diffusers
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
    from PIL import Image

    from ringdit.diffusion import FlowMatching, initial_noise
    from ringdit.diffusion.pipeline import SamplingPipeline
    from ringdit.models.diffusers import DiffusersTransformer
    from ringdit.models.diffusers.packing import pack_latents, unpack_latents
    from ringdit.parallel import ParallelDims
    from ringdit.sampling import Sampler

    original = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: original(64 * 64, ratio))
    steps, seeds, shape = 3, [3], (8, 8)  # 64 x 64 pixels: 16 image and 16 reference tokens
    shift = {"base_tokens": 256, "max_tokens": 8192, "base_shift": 0.5, "max_shift": 0.9}  # Qwen-Image's scheduler
    torch.manual_seed(0)
    config = architecture("qwenimage_edit_tiny")
    reference = diffusers.QwenImageTransformer2DModel.from_config(config).double()
    model = DiffusersTransformer("qwenimage_edit", config=config, input_size=shape, in_channels=4, text_len=TEXT_LEN,
                                 text_dim=16)
    model.transformer.load_state_dict(reference.state_dict())
    vae = diffusers.AutoencoderKLQwenImage(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                          temperal_downsample=[False, True, True],
                                          latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0]).double()
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=shift["base_shift"], max_shift=shift["max_shift"],
        base_image_seq_len=shift["base_tokens"], max_image_seq_len=shift["max_tokens"])
    pipe = diffusers.QwenImageEditPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
                                           processor=None, transformer=reference)
    g = torch.Generator().manual_seed(5)
    image = Image.fromarray(torch.randint(0, 256, (48, 48, 3), generator=g, dtype=torch.uint8).numpy())
    mask = torch.tensor([[True, True, True, False, False]])
    text = torch.randn(1, TEXT_LEN, 16, generator=g, dtype=torch.float64) * mask[..., None]
    noise = initial_noise((4, *shape), seeds).double()
    with torch.no_grad():
        packed = pipe(image=image, prompt_embeds=text, prompt_embeds_mask=mask, latents=pack_latents(noise),
                      height=64, width=64, num_inference_steps=steps, output_type="latent").images
        expected = unpack_latents(packed, *shape)
        pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(image, 64, 64), 64, 64)
        ref_latents = pipe._encode_vae_image(pixels.double().unsqueeze(2), None)[:, :, 0]  # (1, 4, 8, 8)
    pipeline = SamplingPipeline.for_run(
        FlowMatching(shift="resolution", resolution=shift),
        {"sampler": "flow_euler", "steps": steps, "shift": "resolution", "cfg_scale": 1.0},
        {"image_size": list(shape), "latent_scale": 1.0, "conditioning": "text"})
    sampler = Sampler(parallelize(model.double()), ParallelDims(), pipeline, torch.device("cpu"))
    samples = sampler.generate({"text": text, "text_mask": mask, "reference": ref_latents}, seeds, shape=shape)
    scale = expected.abs().max()
    assert (samples.double() - expected).abs().max() <= 1e-10 * scale, (samples - expected).abs().max() / scale
    other = sampler.generate({"text": text, "text_mask": mask, "reference": -ref_latents}, seeds, shape=shape)
    assert (other.double() - expected).abs().max() > 1e-3 * scale  # the reference steers the samples
