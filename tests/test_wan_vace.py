"""Wan VACE (diffusers' WanVACETransformer3DModel, unmodified: VACE blocks over the control video, hints added into
the main blocks) under ringdit's plan, in float64: the same numbers as the model called directly on one process --
forward and every parameter gradient -- on one process and on 4 gloo CPU ranks under ring 2, ring 4, Ulysses 2 and
2 x 2, the video and control tokens (3 x 3 x 3 = 27) tail-padded on every layout; SGD steps through
DiffusionModule's loss (flow matching, the condition drop keeping the control video) at ring 2 under DDP, at Ulysses 2
under FSDP and with LoRA at ring 2 equal one process (in the ranks: no train.py launch); a control video of another
grid, or none, is refused; sampling with the control latents equals WanVACEPipeline's loop."""

from __future__ import annotations

import os

import pytest
import torch

from ringdit.models import parallelize
from ringdit.parallel import init_sequence_parallel
from tests.diffusers_helpers import (LAYOUTS, assert_matches_in_float64, check_sgd_layouts, ddp_average, float64_kept,
                                     forward_backward, training_module)
from tests.distributed import run_ranks
from tests.helpers import architecture, assert_same_numbers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = (3, 6, 6)  # (T, H, W) latents: 27 tokens of Wan's 1x2x2 patches, padded on every layout
TEXT_LEN, CONTROL_CHANNELS = 7, 72  # wan_vace_tiny's vace_in_channels


SCALE = torch.tensor([1.0, 0.5], dtype=torch.float64)  # the pipeline's conditioning_scale, one per VACE layer


def vace_case(seed=0, dims=None):
    """The same weights and inputs on every rank: the unmodified reference, a ringdit model (float64), inputs, dout."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer

    torch.manual_seed(seed)
    reference = diffusers.WanVACETransformer3DModel.from_config(architecture("wan_vace_tiny")).double()
    model = DiffusersTransformer("wan_vace", config=architecture("wan_vace_tiny"), input_size=SHAPE, in_channels=4,
                                 text_len=TEXT_LEN, text_dim=16)
    model.transformer.load_state_dict(reference.state_dict())
    parallelize(model.double(), dims=dims)  # dims None: one process, attention still routed to ringdit
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 4, *SHAPE, generator=g, dtype=torch.float64)
    text = torch.randn(2, TEXT_LEN, 16, generator=g, dtype=torch.float64)
    control = torch.randn(2, CONTROL_CHANNELS, *SHAPE, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 4, *SHAPE, generator=g, dtype=torch.float64)
    return reference, model, (x, text, control), dout


T = torch.tensor([30.0, 810.0], dtype=torch.float64)


def run_both(reference, model, x, text, control, dout):
    expected = forward_backward(lambda: reference(x, T, text, control_hidden_states=control,
                                                  control_hidden_states_scale=SCALE, return_dict=False)[0],
                                reference, dout)
    got = forward_backward(lambda: model(x, T, {"text": text, "control": control, "control_scale": SCALE}),
                           model.transformer, dout)
    return got, expected


def check_layouts(rank, world):
    for ring, ulysses in LAYOUTS:
        reference, model, inputs, dout = vace_case(dims=init_sequence_parallel(ring, ulysses))
        with float64_kept():
            (out, grads), expected = run_both(reference, model, *inputs, dout)
        ddp_average(grads)  # DDP's average over the dp x sp ranks
        assert_matches_in_float64((out, grads), expected, f"ring {ring} x ulysses {ulysses}")


def test_wan_vace_matches_unmodified_diffusers_under_every_layout():
    run_ranks(check_layouts, 4)


def test_wan_vace_one_process_equals_diffusers():
    reference, model, inputs, dout = vace_case()
    assert_matches_in_float64(*run_both(reference, model, *inputs, dout), "one process")


# ---- training: DiffusionModule's loss and SGD steps in the ranks ---------------------------------------------------

MODEL = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "wan_vace",
         "config": architecture("wan_vace_tiny"), "input_size": list(SHAPE), "in_channels": 4, "text_len": TEXT_LEN,
         "text_dim": 16, "condition_dropout_prob": 0.5}  # half the samples drop their prompt, none the control
STEPS, LR = 2, 0.5


def batch():
    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(2, 4, *SHAPE, generator=g)
    cond = {"text": torch.randn(2, TEXT_LEN, 16, generator=g),
            "control": torch.randn(2, CONTROL_CHANNELS, *SHAPE, generator=g)}
    return training_module(SHAPE), x0, cond


def vace_blocks_train(name, kind, weights):
    if kind == "lora":  # the VACE blocks' adapters train too
        assert any(key.startswith("transformer.vace_blocks.") for key in weights), sorted(weights)[:3]


def check_training(rank, world):
    check_sgd_layouts(world, MODEL, batch, STEPS, LR, check=vace_blocks_train)


def test_wan_vace_sgd_steps_equal_one_process_under_ddp_fsdp_and_lora():
    run_ranks(check_training, 2)


def test_conditioning_without_control_latents_or_with_other_channels_is_refused():
    _, model, (x, text, control), _ = vace_case()
    with pytest.raises(ValueError, match="model.family=wan_vace denoises under a control video, but the conditioning "
                                         "has no 'control' latents"):
        model(x, T, {"text": text})
    with pytest.raises(ValueError, match="the control latents have 16 channels but model.config.vace_in_channels is "
                                         "72"):
        model(x, T, {"text": text, "control": control[:, :16]})


@pytest.mark.parametrize("grid", [(2, 6, 6), (3, 4, 6)], ids=["fewer frames", "smaller"])
def test_a_control_video_of_another_grid_is_refused(grid):
    _, model, (x, text, _), _ = vace_case()
    control = torch.zeros(2, CONTROL_CHANNELS, *grid, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"the control latents \(2, 72, .*\) do not fit the latents \(2, 4, 3, 6, 6\)"):
        model(x, T, {"text": text, "control": control})


# ---- sampling: Sampler.generate against WanVACEPipeline --------------------------------------------------------------


def test_sampling_with_control_latents_equals_wan_vace_pipeline():
    """For the same noise, prompt embeddings, UniPC scheduler and control video, ``Sampler.generate``
    (infer.py's and the previews' path) with the control latents in the conditioning gives WanVACEPipeline's latents,
    guided at 5 with the control in both halves, as the pipeline passes it; the control latents are the pipeline's own
    (``prepare_video_latents`` + ``prepare_masks`` over a tiny random Wan VAE: 4 + 4 + 64 = 72 channels). float64:
    measured equal to the bit. The pipeline takes one video, so one sample."""
    import diffusers
    from PIL import Image

    from ringdit.diffusion import initial_noise
    from ringdit.models.diffusers import DiffusersTransformer
    from ringdit.sampling import Sampler

    steps, seeds, shape = 3, [3], (2, 4, 4)
    torch.manual_seed(0)
    reference = diffusers.WanVACETransformer3DModel.from_config(architecture("wan_vace_tiny")).double()
    model = DiffusersTransformer("wan_vace", config=architecture("wan_vace_tiny"), input_size=shape, in_channels=4,
                                 text_len=TEXT_LEN, text_dim=16)
    model.transformer.load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(5)
    text, negative = (torch.randn(1, TEXT_LEN, 16, generator=g, dtype=torch.float64) for _ in range(2))
    torch.manual_seed(7)
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.05, 0.0],
                                     latents_std=[1.5, 0.8, 1.2, 1.0])
    scheduler = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                  flow_shift=3.0, solver_order=2)
    pipe = diffusers.WanVACEPipeline(tokenizer=None, text_encoder=None, transformer=reference, vae=vae,
                                     scheduler=scheduler)
    frames, height, width = (shape[0] - 1) * 4 + 1, shape[1] * 8, shape[2] * 8
    pixels = (torch.rand(frames, height, width, 3, generator=torch.Generator().manual_seed(8)) * 255).to(torch.uint8)
    video = [Image.fromarray(frame.numpy()) for frame in pixels]
    noise = initial_noise((4, *shape), seeds)
    with torch.no_grad():
        cpu = torch.device("cpu")
        video_, mask, references = pipe.preprocess_conditions(video, None, None, 1, height, width, frames,
                                                              torch.float32, cpu)
        control = torch.cat([pipe.prepare_video_latents(video_, mask, references, None, cpu),
                             pipe.prepare_masks(mask, references, None)], dim=1).double()  # (1, 72, T, H, W)
        expected = pipe(video=video, prompt_embeds=text, negative_prompt_embeds=negative, latents=noise,
                        height=height, width=width, num_frames=frames, num_inference_steps=steps, guidance_scale=5.0,
                        output_type="latent").frames
    sampler = Sampler.for_run(parallelize(model.double()),
                              {"_target_": "ringdit.diffusion.FlowMatching", "shift": 3.0},
                              {"sampler": "unipc", "steps": steps, "shift": 3.0, "cfg_scale": 5.0,
                               "scheduler_config": dict(scheduler.config)},
                              {"image_size": list(shape), "latent_scale": 1.0, "conditioning": "text"})
    samples = sampler.generate({"text": text, "control": control}, seeds, negative={"text": negative}, shape=shape)
    assert_same_numbers(samples.double(), expected.double(), of_max=1e-10, where="WanVACEPipeline's latents")


# ---- train.py on control data ---------------------------------------------------------------------------------------


def test_train_py_refuses_data_without_control_latents_and_its_advice_trains(tmp_path):
    """Data without control latents: one line before any rank starts, naming the data a VACE model needs; the advice
    (synthetic data with control latents of vace_in_channels) trains through train.py."""
    from tests.helpers import assert_refused, fail_fast, in_process

    common = ["model=wan_vace_tiny", "data=synthetic_text_latents", "data.num_samples=16", "data.batch_size=4",
              "trainer.max_steps=2", "logger=csv", "scheduler=constant", "optimizer=sgd", "optimizer.lr=0.5",
              "trainer.val_check_interval=2", "callbacks.sample_grid.steps=2", f"paths.log_dir={tmp_path}"]
    proc, seconds = fail_fast("train.py", *common)
    line = assert_refused(proc, text="model.family=wan_vace denoises under a control video, but the data has no "
                                     "'control' latents", seconds=seconds)
    advice = line.rsplit("e.g. ", 1)[1].split()
    assert advice == ["data=synthetic_text_latents", "data.control=72"], line
    proc, _ = in_process("train.py", *common, *advice)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in proc.stdout + proc.stderr
