"""Flux.2 (diffusers' Flux2Transformer2DModel, unmodified) under ringdit's plan against the model on one process called
as Flux2Pipeline calls it (its own patchify, packing and position ids): forward and every parameter gradient, the
image and the text both tail-padded, under ring 2, ring 4, Ulysses 2 and 2 x 2 on 4 gloo CPU ranks, in fp32 and (on
one process and 2 x 2) fp64 -- where RoPE's rounding of q and k to fp32 must happen alike on both sides --; the same
SGD losses through train.py on one process and a ring of 2; and one-line errors before spawning."""

from __future__ import annotations

import os

import pytest
import torch

from ringdit.models import parallelize
from ringdit.parallel import init_sequence_parallel
from tests.diffusers_helpers import LAYOUTS, assert_matches_diffusers, ddp_average, forward_backward
from tests.distributed import run_ranks
from tests.families import (
    FLUX2,
    assert_refused_before_spawning,
    assert_sgd_steps_equal_one_process_and_ring2,
    wan_folder,
)
from tests.helpers import architecture, assert_same_numbers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (H, W) latents of 1 channel, packed 2x2: 3 x 5 = 15 image tokens and 5 text tokens, tail-padded on every layout
SHAPE = (6, 10)
TEXT_LEN = 5
GUIDANCE = 4.0  # the tiny architecture is guidance-distilled, as FLUX.2-dev


def flux2_case(seed=0, dims=None, dtype=torch.float32):
    """The same weights and inputs on every rank: the unmodified reference and its pipeline call, a ringdit model and
    its call, dout."""
    import diffusers
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    from ringdit.models.diffusers import DiffusersTransformer

    config = architecture("flux2_tiny")
    torch.manual_seed(seed)
    reference = diffusers.Flux2Transformer2DModel.from_config(config).to(dtype)
    model = DiffusersTransformer("flux2", config=config, input_size=SHAPE, in_channels=1, text_len=TEXT_LEN,
                                 text_dim=32, guidance=GUIDANCE)
    model.transformer.load_state_dict(reference.state_dict())
    model.to(dtype)
    parallelize(model, dims=dims)  # dims None: one process, attention still routed to ringdit
    g = torch.Generator().manual_seed(seed + 1)
    x, dout = (torch.randn(2, 1, *SHAPE, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    text = torch.randn(2, TEXT_LEN, 32, generator=g, dtype=torch.float64).to(dtype)
    t = torch.tensor([30.0, 810.0], dtype=dtype)

    def run_reference():  # Flux2Pipeline's __call__: patchify, pack, (B, S, 4) ids, sigma, guidance; then unpack
        patches = Flux2Pipeline._patchify_latents(x)  # (B, 4C, H/2, W/2)
        ids = Flux2Pipeline._prepare_latent_ids(patches)
        out = reference(hidden_states=Flux2Pipeline._pack_latents(patches), encoder_hidden_states=text,
                        timestep=t / 1000, guidance=torch.full((2,), GUIDANCE, dtype=dtype),
                        txt_ids=Flux2Pipeline._prepare_text_ids(text), img_ids=ids, return_dict=False)[0]
        return Flux2Pipeline._unpatchify_latents(Flux2Pipeline._unpack_latents_with_ids(out, ids))

    return reference, model, run_reference, lambda: model(x, t, {"text": text}), dout


def assert_fp64_matches(out, grads, ref_out, ref_grads, where=""):
    """fp64: only the sums' order differs (~1e-15). Both sides round q and k to fp32 in RoPE (and its backward's
    gradients); a side that rounded otherwise, or not at all, would be off by ~1e-7 relative."""
    assert_same_numbers(out, ref_out, atol=1e-11, where=f"{where} fp64 output")
    assert_same_numbers(grads, ref_grads, of_max=1e-9, where=f"{where} fp64 gradient")


def check_layouts(rank, world):
    for ring, ulysses in LAYOUTS:
        dims = init_sequence_parallel(ring, ulysses)
        for dtype in (torch.float32, torch.float64) if (ring, ulysses) == (2, 2) else (torch.float32,):
            reference, model, run_reference, run_model, dout = flux2_case(dims=dims, dtype=dtype)
            ref_out, ref_grads = forward_backward(run_reference, reference, dout)
            out, grads = forward_backward(run_model, model.transformer, dout)
            ddp_average(grads)  # DDP's average over the dp x sp ranks
            where = f"ring {ring} x ulysses {ulysses}"
            check = assert_matches_diffusers if dtype == torch.float32 else assert_fp64_matches
            check(out, grads, ref_out, ref_grads, where)


def test_flux2_matches_unmodified_diffusers_under_every_layout():
    """Joint [text ; image] attention in double- and single-stream blocks, image and text sharded together (15 image
    and 5 text tokens: padded on every layout): every real key counts once, text-side gradients are combined."""
    run_ranks(check_layouts, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_flux2_one_process_equals_diffusers(dtype):
    reference, model, run_reference, run_model, dout = flux2_case(dtype=dtype)
    ref_out, ref_grads = forward_backward(run_reference, reference, dout)
    out, grads = forward_backward(run_model, model.transformer, dout)
    (assert_matches_diffusers if dtype == torch.float32 else assert_fp64_matches)(out, grads, ref_out, ref_grads)


# ---- the shift: Flux2Pipeline's, of the token count and the step count ----------------------------------------------

# FLUX.2-dev's scheduler_config.json, which Flux2Pipeline samples with (passing mu, so the base / max are unused)
FLUX2_SCHEDULER = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15,
                   "shift": 3.0, "use_dynamic_shifting": True, "time_shift_type": "exponential"}


@pytest.mark.parametrize(("shape", "steps"), [((6, 10), 1), ((6, 10), 50), ((64, 64), 4), ((128, 128), 28),
                                              ((132, 132), 50)])
def test_flux2_samples_at_flux2_pipelines_sigmas(shape, steps):
    """experiment=flux2_tiny with diffusion.objective.shift=resolution: the times the module samples at are
    Flux2Pipeline's sigmas -- its scheduler after retrieve_timesteps(..., sigmas=linspace(1, 1/steps, steps),
    mu=compute_empirical_mu(image tokens, steps)) -- for 15, 1024, 4096 and 4356 image tokens (above 4300 its mu no
    longer depends on the steps). float32 in diffusers: 1e-6."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    from tests.helpers import sampled_grid, scheduler_sigmas

    tokens = shape[0] // 2 * (shape[1] // 2)  # 2x2 packed, as the pipeline's latents.shape[1]
    expected = scheduler_sigmas(FLUX2_SCHEDULER, steps, compute_empirical_mu(tokens, steps))
    grid = sampled_grid(["experiment=flux2_tiny", "diffusion.objective.shift=resolution"], shape, (2, 2), steps)
    torch.testing.assert_close(grid, expected, rtol=0, atol=1e-6)


def test_flux2_trains_with_the_shift_of_200_steps():
    """Training has no step count: the family takes compute_empirical_mu at 200 steps (flux2.py says why), kept in
    the run's objective; that is FLUX.1's linear shift (calculate_shift), for every size."""
    import math

    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    from ringdit.diffusion import FlowMatching
    from ringdit.spec import resolve_shift

    objective = {"shift": "resolution"}
    resolve_shift(objective, {"steps": 50}, 15,
                  {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "flux2"})
    assert objective["resolution"] == {"empirical_mu_steps": 200}
    for tokens in (15, 1024, 4096, 4356, 16384):
        shift = FlowMatching(**objective).shift_for(tokens)
        assert shift == pytest.approx(math.exp(compute_empirical_mu(tokens, 200)), rel=1e-12)
        # (its coefficients are FLUX.1's rounded to 5 digits: 4e-6 apart at 4096 tokens, 1.4e-5 at 16384)
        assert math.log(shift) == pytest.approx(calculate_shift(tokens), abs=2e-5)


# ---- train.py ------------------------------------------------------------------------------------------------------

def test_flux2_sgd_steps_equal_one_process_and_ring_2(tmp_path):
    assert_sgd_steps_equal_one_process_and_ring2(tmp_path, FLUX2, steps=2)


def flux2_folder(root):
    """A diffusers folder that holds a Flux.2 transformer (its config only)."""
    (root / "flux2" / "transformer").mkdir(parents=True)
    (root / "flux2" / "transformer" / "config.json").write_text('{"_class_name": "Flux2Transformer2DModel"}')
    return root / "flux2"


BAD_INPUTS = {
    "a folder of another family": (["model.pretrained={root}/wan"], r"holds a WanTransformer3DModel, not a "
                                                                    r"Flux2Transformer2DModel \(model.family=flux2\)"),
    # Flux.2's folder for Flux (data.pooled_dim: Flux's own data check passes, the folder is what is wrong)
    "model.family does not match model.pretrained": (
        ["model.family=flux", "data.pooled_dim=32", "model.pretrained={root}/flux2"],
        r"holds a Flux2Transformer2DModel, not a FluxTransformer2DModel \(model.family=flux\)"),
    "more Ulysses ranks than heads": (["ulysses_degree=4"], r"ulysses_degree=4 is more than the model's num_heads=2"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_flux2_bad_input_is_refused_before_spawning(case, tmp_path):
    wan_folder(tmp_path)
    flux2_folder(tmp_path)
    overrides, message = BAD_INPUTS[case]
    assert_refused_before_spawning(tmp_path, [*FLUX2, *(o.format(root=tmp_path) for o in overrides)], message)
