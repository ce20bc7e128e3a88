"""LTX-Video (diffusers' LTXVideoTransformer3DModel, unmodified) under ringdit's plan: the same numbers as the model
on one process with its own attention -- forward and every parameter gradient, a padded text mask (the model's
additive -10000 bias read as a key mask), per-sample and per-token timesteps, on one process and on 4 gloo CPU
ranks under every layout -- the same SGD losses through train.py, and one-line errors for what a user can get
wrong."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from ringdit.models import parallelize
from ringdit.parallel import init_sequence_parallel
from tests.diffusers_helpers import LAYOUTS, assert_matches_diffusers, forward_backward
from tests.distributed import run_ranks
from tests.families import (
    LTX,
    assert_refused_before_spawning,
    assert_sgd_steps_equal_one_process_and_ring2,
    wan_folder,
)
from tests.helpers import architecture

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (T, H, W) latents, 1x1x1 patches: 3 x 3 x 5 = 45 tokens, tail-padded on every layout (LTX's latent frame counts,
# 1 + (frames - 1) / 8, do not divide a degree either)
SHAPE = (3, 3, 5)
TEXT_LEN = 7
MASK = torch.tensor([[True] * TEXT_LEN, [True, True, True, False, False, False, False]])  # the second prompt padded


def ltx_case(seed=0, dims=None):
    """The same weights and inputs on every rank: the unmodified reference, a ringdit model, inputs, dout."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer

    torch.manual_seed(seed)
    reference = diffusers.LTXVideoTransformer3DModel.from_config(architecture("ltx_video_tiny"))
    model = DiffusersTransformer("ltx_video", config=architecture("ltx_video_tiny"), input_size=SHAPE, in_channels=4,
                                 text_len=TEXT_LEN, text_dim=16)
    model.transformer.load_state_dict(reference.state_dict())
    parallelize(model, dims=dims)  # dims None: one process, attention still routed to ringdit
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 4, *SHAPE, generator=g)
    text = torch.randn(2, TEXT_LEN, 16, generator=g) * MASK[..., None]
    dout = torch.randn(2, 4, *SHAPE, generator=g)
    return reference, model, (x, text), dout


def timesteps(per_token: bool) -> torch.Tensor:
    """(B,) per sample, or (B, S) per token: 0 on the first latent frame's tokens (a clean conditioning frame, as
    LTX's image-to-video conditions), t elsewhere."""
    t = torch.tensor([30.0, 810.0])
    if not per_token:
        return t
    first_frame = torch.zeros(SHAPE, dtype=torch.bool)
    first_frame[0] = True
    return torch.where(first_frame.flatten(), 0.0, t[:, None])  # (B, S)


def run_reference(reference, x, t, text):
    """The diffusers call as LTXPipeline makes it (packed tokens, its RoPE scale), unpacked."""
    from ringdit.models.diffusers.ltx_video import ROPE_INTERPOLATION_SCALE, pack_video, unpack_video

    out = reference(hidden_states=pack_video(x, 1, 1), encoder_hidden_states=text, timestep=t,
                    encoder_attention_mask=MASK, num_frames=SHAPE[0], height=SHAPE[1], width=SHAPE[2],
                    rope_interpolation_scale=ROPE_INTERPOLATION_SCALE, return_dict=False)[0]
    return unpack_video(out, SHAPE, 1, 1)


def check_layouts(rank, world):
    for ring, ulysses in LAYOUTS:
        dims = init_sequence_parallel(ring, ulysses)
        for per_token in (True, False) if (ring, ulysses) == (2, 2) else (True,):  # per-sample: cut nowhere
            reference, model, (x, text), dout = ltx_case(dims=dims)
            t = timesteps(per_token)
            ref_out, ref_grads = forward_backward(lambda: run_reference(reference, x, t, text), reference, dout)
            out, grads = forward_backward(lambda: model(x, t, {"text": text, "text_mask": MASK}),
                                          model.transformer, dout)
            for grad in (g for g in grads.values() if g is not None):  # DDP's average over the dp x sp ranks
                dist.all_reduce(grad)
                grad /= world
            where = f"ring {ring} x ulysses {ulysses}, {'per-token' if per_token else 'per-sample'} t"
            assert_matches_diffusers(out, grads, ref_out, ref_grads, where)


def test_ltx_with_a_padded_text_mask_matches_diffusers_under_every_layout():
    """Ring 2, ring 4, Ulysses 2 and 2 x 2 on one 4-rank group; 45 tokens (padded), a padded prompt."""
    run_ranks(check_layouts, 4)


@pytest.mark.parametrize("per_token", [False, True], ids=["timestep", "per_token_timesteps"])
def test_ltx_one_process_equals_diffusers(per_token):
    reference, model, (x, text), dout = ltx_case()
    t = timesteps(per_token)
    ref_out, ref_grads = forward_backward(lambda: run_reference(reference, x, t, text), reference, dout)
    out, grads = forward_backward(lambda: model(x, t, {"text": text, "text_mask": MASK}), model.transformer, dout)
    assert_matches_diffusers(out, grads, ref_out, ref_grads)


def test_the_mask_matters():
    """The padded prompt's keys are masked: unmasked, the second sample's prediction changes."""
    _, model, (x, text), _ = ltx_case()
    with torch.no_grad():
        masked = model(x, timesteps(False), {"text": text, "text_mask": MASK})
        unmasked = model(x, timesteps(False), {"text": text, "text_mask": torch.ones_like(MASK)})
    assert torch.equal(masked[0], unmasked[0]) and not torch.allclose(masked[1], unmasked[1], atol=1e-4)


# ---- the additive bias as a key mask --------------------------------------------------------------------------------


def test_an_additive_bias_is_read_as_a_key_mask():
    from ringdit.models.parallelize import cross_attention_key_mask

    bias = ((1 - MASK.float()) * -10000.0)[:, None, None].expand(2, 3, 1, TEXT_LEN)  # (B, heads, 1, L), as LTX's
    assert torch.equal(cross_attention_key_mask(bias, TEXT_LEN), MASK)
    assert torch.equal(cross_attention_key_mask(bias.bfloat16(), TEXT_LEN), MASK)  # bf16: -10000 rounds to -9984
    # a prompt with no real key: a bias equal on every key does not change a softmax, so all keys count
    empty = torch.full((1, 1, 1, TEXT_LEN), -10000.0)
    assert bool(cross_attention_key_mask(empty, TEXT_LEN).all())


@pytest.mark.parametrize("case, message", [
    ("soft", r"a float bias with values other than 0 and <= -1000 .*: a soft bias, not a key mask"),
    ("per head", r"differs between heads or queries: ringdit takes a mask only as a per-sample key mask"),
    ("not over the keys", r"is not a key mask \(B, \.\.\., 7\)"),
])
def test_a_mask_that_is_not_a_key_mask_is_refused(case, message):
    from ringdit.models.parallelize import cross_attention_key_mask

    bias = torch.zeros(2, 2, 1, TEXT_LEN)
    if case == "soft":
        bias[1, :, :, 3] = -5.0
    elif case == "per head":
        bias[1, 1, :, 3] = -10000.0
    else:
        bias = torch.zeros(2, 2, 1, TEXT_LEN + 1)
    with pytest.raises(NotImplementedError, match=message):
        cross_attention_key_mask(bias, TEXT_LEN)


# ---- the token-count shift -----------------------------------------------------------------------------------------


def test_shift_resolution_is_ltx_pipelines_own():
    """diffusion.objective.shift=resolution for model.family=ltx_video: LTXPipeline's calculate_shift with the
    constants of LTX-Video's scheduler config, kept in the run's objective (infer.py samples with it too); a family
    without its own (Flux) and the DiT keep Flux's; constants the run gives are kept."""
    import math

    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    from ringdit.diffusion import FlowMatching
    from ringdit.spec import resolve_shift

    LTX = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "ltx_video"}
    objective, sampling = {"shift": "resolution"}, {}
    resolve_shift(objective, sampling, 192, LTX)
    assert sampling == {"shift": "resolution"}
    for tokens in (192, 1024, 6000):
        ltx = math.exp(calculate_shift(tokens, 1024, 4096, 0.95, 2.05))  # LTX-Video's scheduler_config.json
        assert FlowMatching(**objective).shift_for(tokens) == pytest.approx(ltx, rel=1e-12)
    for model in ({**LTX, "family": "flux"}, {"_target_": "ringdit.models.DiT"}):
        objective = {"shift": "resolution"}
        resolve_shift(objective, {}, 192, model)
        assert FlowMatching(**objective).shift_for(192) == pytest.approx(math.exp(calculate_shift(192)), rel=1e-12)
    given = {"shift": "resolution", "resolution": {"base_shift": 1.0}}
    resolve_shift(given, {}, 192, LTX)
    assert given["resolution"] == {"base_shift": 1.0}
    with pytest.raises(ValueError, match=r"resolution takes \['base_tokens', .*got \['base_seq_len'\]"):
        FlowMatching(shift="resolution", resolution={"base_seq_len": 1024})


# LTX-Video's scheduler_config.json (Lightricks/LTX-Video), which LTXPipeline samples with
LTX_SCHEDULER = {"base_image_seq_len": 1024, "max_image_seq_len": 4096, "base_shift": 0.95, "max_shift": 2.05,
                 "shift_terminal": 0.1, "use_dynamic_shifting": True}


@pytest.mark.parametrize(("shape", "steps"), [((3, 3, 5), 2), ((3, 3, 5), 50), ((4, 16, 24), 8), ((6, 32, 32), 20)])
def test_ltx_samples_at_ltx_pipelines_sigmas(shape, steps):
    """experiment=ltx_video_tiny (shift=resolution; diffusion.sampling.shift_terminal null: the family's 0.1): the times
    the module samples at are LTXPipeline's sigmas -- its scheduler after retrieve_timesteps(..., sigmas=linspace(1,
    1/steps, steps), mu=calculate_shift(tokens, its constants)) --, for 45 tokens (below the base 1024), 1536 and
    6144 (beyond the max 4096): the shift and the stretch to 0.1. float32 in diffusers: 1e-6."""
    import math

    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    from tests.helpers import sampled_grid, scheduler_sigmas

    mu = calculate_shift(math.prod(shape), *(LTX_SCHEDULER[key] for key in ("base_image_seq_len", "max_image_seq_len",
                                                                             "base_shift", "max_shift")))
    expected = scheduler_sigmas(LTX_SCHEDULER, steps, mu)  # as LTXPipeline computes mu from its scheduler's config
    torch.testing.assert_close(sampled_grid(["experiment=ltx_video_tiny"], shape, (1, 1, 1), steps), expected,
                               rtol=0, atol=1e-6)


# ---- train.py ------------------------------------------------------------------------------------------------------

def test_ltx_sgd_steps_equal_one_process_and_ring_2(tmp_path):
    assert_sgd_steps_equal_one_process_and_ring2(tmp_path, LTX, steps=2)


BAD_INPUTS = {
    "a folder of another family": ("model.pretrained={root}/wan", r"holds a WanTransformer3DModel, not a "
                                                                  r"LTXVideoTransformer3DModel \(model.family="
                                                                  r"ltx_video\)"),
    "more Ulysses ranks than heads": ("ulysses_degree=4", r"ulysses_degree=4 is more than the model's num_heads=2"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_ltx_bad_input_is_refused_before_spawning(case, tmp_path):
    wan_folder(tmp_path)
    override, message = BAD_INPUTS[case]
    assert_refused_before_spawning(tmp_path, [*LTX, override.format(root=tmp_path)], message)
