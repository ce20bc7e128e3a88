"""CogVideoX 1.5 (diffusers' CogVideoXTransformer3DModel, unmodified, with RoPE and 2x2x2 patches) under ringdit's
plan, in float64: the same numbers as the model on one process with its own processor and attention -- forward and
every parameter gradient, on one process and on 4 gloo CPU ranks under ring 2, ring 4, Ulysses 2 and 2 x 2 with the
video tokens and the text padded --; the same SGD losses and weights through DiffusionModule's loss (CogVideoX's v
objective) at ring 2 under DDP, FSDP and LoRA as on one process (in the ranks: no train.py launch); train.py and
infer.py on experiment=cogvideox_tiny; one-line refusals before spawning."""

from __future__ import annotations

import os

import pytest
import torch

from ringdit.models import parallelize
from ringdit.parallel import init_sequence_parallel
from tests.diffusers_helpers import LAYOUTS, check_sgd_layouts, ddp_average, forward_backward, training_module
from tests.distributed import run_ranks
from tests.helpers import architecture, assert_same_numbers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (T, H, W) latents, 2x2x2 patches: 1 x 3 x 5 = 15 video tokens, and 7 text tokens: both tail-padded on every layout
SHAPE = (2, 6, 10)
TEXT_LEN = 7
# float64 on both sides: what is left is the order of sums (another GEMM shape, the ring's merges), ~1e-15 relative;
OUT_ATOL, GRAD_OF_MAX = 1e-13, 1e-12  # measured: 8.9e-16 and 1.4e-15 of the largest


def cogvideox_case(seed=0, dims=None):
    """The same weights and inputs on every rank: the unmodified reference, a ringdit model (float64), inputs,
    dout."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer

    torch.manual_seed(seed)
    reference = diffusers.CogVideoXTransformer3DModel.from_config(architecture("cogvideox15_tiny")).double()
    model = DiffusersTransformer("cogvideox15", config=architecture("cogvideox15_tiny"), input_size=SHAPE,
                                 in_channels=4, text_len=TEXT_LEN, text_dim=16)
    model.transformer.load_state_dict(reference.state_dict())
    parallelize(model.double(), dims=dims)  # dims None: one process, attention still routed to ringdit
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 4, *SHAPE, generator=g, dtype=torch.float64)
    text = torch.randn(2, TEXT_LEN, 16, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 4, *SHAPE, generator=g, dtype=torch.float64)
    return reference, model, (x, text), dout


T = torch.tensor([30, 999])  # integer DDPM steps, as CogVideoXPipeline passes them (999: zero terminal SNR's last)


def run_reference(reference, x, text):
    """The diffusers call as CogVideoXPipeline makes it: (B, F, C, H, W) latents, the integer step, its RoPE pair
    (_prepare_rotary_positional_embeddings for CogVideoX 1.5: the "slice" grid, max_size the sample size)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    config = reference.config
    cos, sin = get_3d_rotary_pos_embed(embed_dim=config.attention_head_dim, crops_coords=None,
                                       grid_size=(SHAPE[1] // 2, SHAPE[2] // 2), temporal_size=SHAPE[0] // 2,
                                       grid_type="slice", max_size=(config.sample_height // 2,
                                                                    config.sample_width // 2))
    out = reference(hidden_states=x.transpose(1, 2), encoder_hidden_states=text, timestep=T,
                    image_rotary_emb=(cos, sin), return_dict=False)[0]
    return out.transpose(1, 2)


def assert_matches(out, grads, ref_out, ref_grads, where=""):
    assert_same_numbers(out, ref_out, atol=OUT_ATOL, where=f"{where} output")
    assert_same_numbers(grads, ref_grads, of_max=GRAD_OF_MAX, where=f"{where} gradient")


def check_layouts(rank, world):
    for ring, ulysses in LAYOUTS:
        dims = init_sequence_parallel(ring, ulysses)
        reference, model, (x, text), dout = cogvideox_case(dims=dims)
        ref_out, ref_grads = forward_backward(lambda: run_reference(reference, x, text), reference, dout)
        out, grads = forward_backward(lambda: model(x, T.double(), {"text": text}), model.transformer, dout)
        ddp_average(grads)  # DDP's average over the dp x sp ranks
        assert_matches(out, grads, ref_out, ref_grads, f"ring {ring} x ulysses {ulysses}")


def test_cogvideox_matches_diffusers_under_every_layout():
    """Ring 2, ring 4, Ulysses 2 and 2 x 2 on one 4-rank group; 15 video and 7 text tokens (both padded)."""
    run_ranks(check_layouts, 4)


def test_cogvideox_one_process_equals_diffusers():
    """ringdit's processor (through dispatch_attention_fn) computes what diffusers' CogVideoXAttnProcessor2_0 does."""
    from ringdit.models.diffusers.cogvideox import CogVideoXAttnProcessor

    reference, model, (x, text), dout = cogvideox_case()
    assert all(isinstance(p, CogVideoXAttnProcessor) for p in model.transformer.attn_processors.values())
    assert not any(isinstance(p, CogVideoXAttnProcessor) for p in reference.attn_processors.values())  # unmodified
    ref_out, ref_grads = forward_backward(lambda: run_reference(reference, x, text), reference, dout)
    out, grads = forward_backward(lambda: model(x, T.double(), {"text": text}), model.transformer, dout)
    assert_matches(out, grads, ref_out, ref_grads)


# ---- training: DiffusionModule's loss and SGD steps in the ranks ---------------------------------------------------

# experiment=cogvideox_tiny's objective (CogVideoX1.5-5B's scheduler)
OBJECTIVE = {"_target_": "ringdit.diffusion.DDPM", "beta_start": 0.00085, "beta_end": 0.012,
             "beta_schedule": "scaled_linear", "prediction": "v", "rescale_zero_snr": True, "snr_shift_scale": 1.0,
             "timestep_spacing": "trailing", "learn_variance": False}
MODEL = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "cogvideox15",
         "config": architecture("cogvideox15_tiny"), "input_size": list(SHAPE), "in_channels": 4,
         "text_len": TEXT_LEN, "text_dim": 16}
STEPS, LR = 2, 0.5


def batch():
    """(module, x0, cond): the DiffusionModule with CogVideoX's objective, a fixed batch."""
    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(2, 4, *SHAPE, generator=g)
    cond = {"text": torch.randn(2, TEXT_LEN, 16, generator=g)}
    return training_module(SHAPE, OBJECTIVE, sampler="ddim"), x0, cond


def check_training(rank, world):
    check_sgd_layouts(world, MODEL, batch, STEPS, LR, fsdp=((2, 1), (1, 2)))


def test_cogvideox_sgd_steps_equal_one_process_under_ddp_fsdp_and_lora():
    """CogVideoX's v objective on its zero-terminal-SNR schedule: 2 SGD steps at ring 2 (DDP), under FSDP at ring 2
    and Ulysses 2, and LoRA's adapters at ring 2 give one process's losses and weights."""
    run_ranks(check_training, 2)


def test_the_objective_trains_v():
    """The loss's target is CogVideoX's v (diffusers' get_velocity), the model's time the integer step."""
    from diffusers import CogVideoXDDIMScheduler

    from ringdit.diffusion import DDPM

    objective = DDPM(**{k: v for k, v in OBJECTIVE.items() if k != "_target_"})
    scheduler = CogVideoXDDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       prediction_type="v_prediction", rescale_betas_zero_snr=True,
                                       snr_shift_scale=1.0, timestep_spacing="trailing")
    x0, noise = torch.randn(2, 4, *SHAPE, dtype=torch.float64), torch.randn(2, 4, *SHAPE, dtype=torch.float64)
    assert torch.equal(objective.alphas_cumprod, scheduler.alphas_cumprod)
    torch.testing.assert_close(objective.target(x0, noise, T), scheduler.get_velocity(x0, noise, T), rtol=0,
                               atol=1e-15)


@pytest.mark.parametrize("steps", [3, 4])
def test_sampling_is_cogvideox_pipelines_with_its_ddim_scheduler(steps):
    """ringdit's ddim sampler with experiment=cogvideox_tiny's objective, guided at 6 away from a negative prompt,
    gives CogVideoXPipeline's latents (CogVideoXDDIMScheduler with CogVideoX1.5-5B's settings) for the same noise:
    its trailing steps (3: diffusers' previous step t - 333 where the listed one is 332), its RoPE and its guidance.
    float64 models; the pipeline rounds each prediction to float32 (noise_pred.float()): 5e-7 measured."""
    import diffusers

    from ringdit.diffusion import DDPM, sample

    reference, model, (x, text), _ = cogvideox_case()
    negative = torch.randn(1, TEXT_LEN, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    scheduler = diffusers.CogVideoXDDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                                 prediction_type="v_prediction", rescale_betas_zero_snr=True,
                                                 snr_shift_scale=1.0, timestep_spacing="trailing")
    pipe = diffusers.CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=reference,
                                       scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(prompt_embeds=text[:1], negative_prompt_embeds=negative, latents=x[:1].transpose(1, 2),
                    num_frames=4 * (SHAPE[0] - 1) + 1, height=8 * SHAPE[1], width=8 * SHAPE[2], guidance_scale=6.0,
                    num_inference_steps=steps, output_type="latent", return_dict=False)[0].transpose(1, 2)
    objective = DDPM(**{key: value for key, value in OBJECTIVE.items() if key != "_target_"})
    with torch.no_grad():
        got = sample(model, objective, x[:1], {"text": text[:1]}, steps=steps, cfg_scale=6.0,
                     null={"text": negative})
    assert_same_numbers(got, expected, atol=1e-5, where=f"{steps} steps")


# ---- train.py / infer.py -------------------------------------------------------------------------------------------

RUN = ["experiment=cogvideox_tiny", "data.num_samples=8", "data.batch_size=2", "data.size=6", "data.text_len=5",
       "trainer.max_steps=2", "logger=csv", "optimizer=sgd", "optimizer.lr=0.5", "scheduler=constant",
       "trainer.val_check_interval=2", "callbacks.model_checkpoint.every_n_train_steps=2",
       "callbacks.sample_grid.steps=2"]


def test_experiment_trains_and_infer_samples(tmp_path):
    """experiment=cogvideox_tiny on one process (in this process): train.py's run with its preview, then infer.py's
    samples over CogVideoX's trailing DDIM steps."""
    import numpy as np

    from tests.helpers import logged_losses, run

    run("train.py", tmp_path / "run", *RUN, f"data.cache_dir={tmp_path / 'data'}", env={"HF_HUB_OFFLINE": "1"})
    assert sorted(logged_losses(tmp_path / "run")) == [0, 1]
    run("infer.py", tmp_path / "infer", f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}",
        "num_samples=2", "diffusion.sampling.steps=3", env={"HF_HUB_OFFLINE": "1"})
    latents = np.load(tmp_path / "infer" / "samples.npz")["latents"]
    assert latents.shape == (2, 4, 4, 6, 6) and np.isfinite(latents).all()


BAD_INPUTS = {
    "frames the temporal patch does not divide": (
        ["data.frames=3"], r"the bucket \[3, 8, 8\] .*is not divisible by the model's patch \[2, 2, 2\] \(the "
                           r"nearest shape that is: \[2, 8, 8\]\)"),
    "CogVideoX 1.0's layout": (
        ["model.config.use_rotary_positional_embeddings=false"],
        r"model.family=cogvideox15 runs the CogVideoX 1.5 layout .*use model=cogvideox15"),
    "more Ulysses ranks than heads": (["ulysses_degree=4"], r"ulysses_degree=4 is more than the model's num_heads=2"),
    "epsilon on a zero-SNR schedule": (
        ["diffusion.objective.prediction=epsilon"], r"rescale_zero_snr=True with prediction=epsilon"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_cogvideox_bad_input_is_refused_before_spawning(case, tmp_path):
    from tests.families import assert_refused_before_spawning

    overrides, message = BAD_INPUTS[case]
    assert_refused_before_spawning(tmp_path, ["experiment=cogvideox_tiny", "data.num_samples=8", *overrides], message)
