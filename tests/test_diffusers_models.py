"""diffusers models under ring / Ulysses / USP against the unmodified diffusers model on one process (its own
attention): forward and every parameter gradient, on spawned CPU ranks (gloo)."""

from __future__ import annotations

import os

import pytest
import torch

from ringdit.models import parallelize
from ringdit.parallel import init_sequence_parallel
from tests.diffusers_helpers import (
    LAYOUTS, assert_matches_diffusers, ddp_average, forward_backward, per_token_timesteps)
from tests.distributed import run_ranks
from tests.helpers import architecture

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (ring, ulysses) layouts on 4 ranks: LAYOUTS (tests/diffusers_helpers.py).
# fp32, as the models are used. One process computes what diffusers does (measured: the same bits for Wan and Flux,
# 2 ulps for QwenImage); a layout reorders the sums (other GEMM shapes, the ring's merges): measured at most 5e-7 on
# outputs of max ~2 (1e-5: ~80 ulps there) and 3e-6 of a gradient's max (rtol 1e-4), on every layout. A token lost,
# padded in or counted twice, or a wrongly reduced gradient, is off by far more.
# (T, H, W) latents: 2 x 4 x 4 = 32 tokens divide every degree; 3 x 3 x 3 = 27 need tail padding (Wan's usual
# 21 latent frames do not divide the degree either).
SHAPES = [(2, 8, 8), (3, 6, 6)]


def wan_case(shape, seed=0, dims=None):
    """The same weights and inputs on every rank: a unmodified reference model, a ringdit one, inputs, dout."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer

    torch.manual_seed(seed)
    reference = diffusers.WanTransformer3DModel.from_config(architecture("wan_tiny"))
    model = DiffusersTransformer("wan", config=architecture("wan_tiny"), input_size=shape, in_channels=4, text_len=7, text_dim=16)
    model.transformer.load_state_dict(reference.state_dict())
    parallelize(model, dims=dims)  # dims None: one process, attention still routed to ringdit
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 4, *shape, generator=g)
    t = torch.tensor([30.0, 810.0])
    text = torch.randn(2, 7, 16, generator=g)
    dout = torch.randn(2, 4, *shape, generator=g)
    return reference, model, (x, t, text), dout


def check_wan_layouts(rank, world):
    for ring, ulysses in LAYOUTS:
        dims = init_sequence_parallel(ring, ulysses)
        if ring > 1:  # the layers are USPAttention: a backend without the LSE is refused when built for the mesh
            from ringdit.models.diffusers import DiffusersTransformer

            with pytest.raises(RuntimeError, match=r"Ring Attention requires a backend whose kernel exposes the "
                                                   r"softmax LSE for the per-hop merge; TORCH_SDPA does not declare"):
                parallelize(DiffusersTransformer("wan", config=architecture("wan_tiny")), dims=dims, backend="torch_sdpa")
        for shape in SHAPES:
            reference, model, (x, t, text), dout = wan_case(shape, dims=dims)
            ref_out, ref_grads = forward_backward(
                lambda: reference(x, t, text, return_dict=False)[0], reference, dout)
            out, grads = forward_backward(lambda: model(x, t, {"text": text}), model.transformer, dout)
            # every rank computed the full loss of the same batch: DDP's average of the ranks' gradients (over
            # dp x sp ranks) must be the one-device gradient
            ddp_average(grads)  # DDP's average over the dp x sp ranks
            where = f"ring {ring} x ulysses {ulysses}, latents {shape}"
            assert_matches_diffusers(out, grads, ref_out, ref_grads, where)
        # Wan 2.2 TI2V: one timestep per token, 0 on the first (clean) latent frame; 27 tokens pad on every layout
        reference, model, (x, _, text), dout = wan_case((3, 6, 6), dims=dims)
        t = per_token_timesteps((3, 6, 6), torch.tensor([30.0, 810.0]))
        ref_out, ref_grads = forward_backward(lambda: reference(x, t, text, return_dict=False)[0], reference, dout)
        out, grads = forward_backward(lambda: model(x, t, {"text": text}), model.transformer, dout)
        ddp_average(grads)  # DDP's average over the dp x sp ranks
        assert_matches_diffusers(out, grads, ref_out, ref_grads, f"ring {ring} x ulysses {ulysses}, per-token t")


def test_wan_matches_unmodified_diffusers_under_every_layout():
    run_ranks(check_wan_layouts, 4)


@pytest.mark.parametrize("per_token", [False, True], ids=["timestep", "per_token_timesteps"])
def test_wan_one_process_equals_diffusers(per_token):
    reference, model, (x, t, text), dout = wan_case((3, 6, 6))
    if per_token:
        t = per_token_timesteps((3, 6, 6), t)
    ref_out, ref_grads = forward_backward(lambda: reference(x, t, text, return_dict=False)[0], reference, dout)
    out, grads = forward_backward(lambda: model(x, t, {"text": text}), model.transformer, dout)
    assert_matches_diffusers(out, grads, ref_out, ref_grads)


# ---- Flux: joint [text ; image] attention with the text replicated ------------------------------------------------

# (H, W) latents of 1 channel, packed 2x2: 16 image tokens divide every degree; 3 x 5 = 15 need tail padding.
FLUX_SHAPES = [(8, 8), (6, 10)]
TEXT_LEN = 5  # not divisible by the Ulysses degree


def flux_case(shape, seed=0, guidance=None, dims=None):
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer
    from ringdit.models.diffusers.families import image_ids
    from ringdit.models.diffusers.packing import pack_latents, unpack_latents

    config = {**architecture("flux_tiny"), "guidance_embeds": guidance is not None}
    torch.manual_seed(seed)
    reference = diffusers.FluxTransformer2DModel.from_config(config)
    model = DiffusersTransformer("flux", config=config, input_size=shape, in_channels=1, text_len=TEXT_LEN,
                                 text_dim=32, pooled_dim=32, guidance=guidance)
    model.transformer.load_state_dict(reference.state_dict())
    parallelize(model, dims=dims)  # dims None: one process, attention still routed to ringdit
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 1, *shape, generator=g)
    t = torch.tensor([30.0, 810.0])
    text, pooled = torch.randn(2, TEXT_LEN, 32, generator=g), torch.randn(2, 32, generator=g)
    dout = torch.randn(2, 1, *shape, generator=g)

    def run_reference():
        extra = {"guidance": torch.full((2,), float(guidance))} if guidance is not None else {}
        out = reference(hidden_states=pack_latents(x), encoder_hidden_states=text, pooled_projections=pooled,
                        timestep=t / 1000, img_ids=image_ids(shape[0] // 2, shape[1] // 2, x.device),
                        txt_ids=torch.zeros(TEXT_LEN, 3), return_dict=False, **extra)[0]
        return unpack_latents(out, *shape)

    return reference, model, run_reference, lambda: model(x, t, {"text": text, "pooled": pooled}), dout


def check_flux_layouts(rank, world):
    for ring, ulysses in LAYOUTS:
        dims = init_sequence_parallel(ring, ulysses)
        for shape, guidance in zip(FLUX_SHAPES, (None, 3.5)):  # Flux-schnell- and Flux-dev-like
            reference, model, run_reference, run_model, dout = flux_case(shape, guidance=guidance, dims=dims)
            ref_out, ref_grads = forward_backward(run_reference, reference, dout)
            out, grads = forward_backward(run_model, model.transformer, dout)
            ddp_average(grads)  # DDP's average over the dp x sp ranks
            where = f"ring {ring} x ulysses {ulysses}, latents {shape}, guidance {guidance}"
            assert_matches_diffusers(out, grads, ref_out, ref_grads, where)


def test_flux_matches_unmodified_diffusers_under_every_layout():
    """Joint attention with the text sharded like the image (5 text tokens: padded on every layout): every key
    counts once, text-side gradients are combined exactly."""
    run_ranks(check_flux_layouts, 4)


def test_flux_one_process_equals_diffusers():
    reference, model, run_reference, run_model, dout = flux_case((6, 10), guidance=3.5)
    ref_out, ref_grads = forward_backward(run_reference, reference, dout)
    out, grads = forward_backward(run_model, model.transformer, dout)
    assert_matches_diffusers(out, grads, ref_out, ref_grads)


# ---- QwenImage: joint attention with a padded text mask ------------------------------------------------------------



def qwen_case(shape, seed=0, dims=None):
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer
    from ringdit.models.diffusers.packing import pack_latents, unpack_latents

    torch.manual_seed(seed)
    reference = diffusers.QwenImageTransformer2DModel.from_config(architecture("qwenimage_tiny"))
    model = DiffusersTransformer("qwenimage", config=architecture("qwenimage_tiny"), input_size=shape, in_channels=4, text_len=TEXT_LEN,
                                 text_dim=16)
    model.transformer.load_state_dict(reference.state_dict())
    parallelize(model, dims=dims)  # dims None: one process, attention still routed to ringdit
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 4, *shape, generator=g)
    t = torch.tensor([30.0, 810.0])
    text = torch.randn(2, TEXT_LEN, 16, generator=g)
    mask = torch.tensor([[True] * TEXT_LEN, [True, True, True, False, False]])  # the second prompt padded
    text = text * mask[..., None]
    dout = torch.randn(2, 4, *shape, generator=g)

    def run_reference():
        out = reference(hidden_states=pack_latents(x), encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                        timestep=t / 1000, img_shapes=[[(1, shape[0] // 2, shape[1] // 2)]] * 2,
                        return_dict=False)[0]
        return unpack_latents(out, *shape)

    return reference, model, run_reference, lambda: model(x, t, {"text": text, "text_mask": mask}), dout


def check_qwen_layouts(rank, world):
    for ring, ulysses in LAYOUTS:
        dims = init_sequence_parallel(ring, ulysses)
        for shape in FLUX_SHAPES:
            reference, model, run_reference, run_model, dout = qwen_case(shape, dims=dims)
            ref_out, ref_grads = forward_backward(run_reference, reference, dout)
            out, grads = forward_backward(run_model, model.transformer, dout)
            ddp_average(grads)  # DDP's average over the dp x sp ranks
            where = f"ring {ring} x ulysses {ulysses}, latents {shape}"
            assert_matches_diffusers(out, grads, ref_out, ref_grads, where)


def test_qwenimage_with_a_padded_text_mask_matches_diffusers_under_every_layout():
    run_ranks(check_qwen_layouts, 4)


def test_qwenimage_one_process_equals_diffusers():
    reference, model, run_reference, run_model, dout = qwen_case((6, 10))
    ref_out, ref_grads = forward_backward(run_reference, reference, dout)
    out, grads = forward_backward(run_model, model.transformer, dout)
    assert_matches_diffusers(out, grads, ref_out, ref_grads)
