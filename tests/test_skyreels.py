"""SkyReels-V2 (diffusers' SkyReelsV2Transformer3DModel, unmodified) under ringdit's plan: the same numbers as the
model on one process with its own attention -- forward and every parameter gradient, per-sample and per-frame
(diffusion-forcing) timesteps, on one process and on 4 gloo CPU ranks under every layout -- the same SGD losses
through train.py, and one-line errors for what a user can get wrong."""

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
    SKYREELS,
    assert_refused_before_spawning,
    assert_sgd_steps_equal_one_process_and_ring2,
    wan_folder,
)
from tests.helpers import architecture

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (T, H, W) latents, 1x2x2 patches: 3 x 3 x 3 = 27 tokens, tail-padded on every layout (as SkyReels' 25 or 33
# latent frames at 540P do not divide a degree either)
SHAPE = (3, 6, 6)
TEXT_LEN = 7


def skyreels_case(seed=0, dims=None, batch=2, **config):
    """The same weights and inputs on every rank: the unmodified reference, a ringdit model, inputs, dout."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer

    config = {**architecture("skyreels_v2_tiny"), **config}
    torch.manual_seed(seed)
    reference = diffusers.SkyReelsV2Transformer3DModel.from_config(config)
    model = DiffusersTransformer("skyreels_v2", config=config, input_size=SHAPE, in_channels=4, text_len=TEXT_LEN,
                                 text_dim=16)
    model.transformer.load_state_dict(reference.state_dict())
    parallelize(model, dims=dims)  # dims None: one process, attention still routed to ringdit
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 4, *SHAPE, generator=g)
    text = torch.randn(batch, TEXT_LEN, 16, generator=g)
    dout = torch.randn(batch, 4, *SHAPE, generator=g)
    return reference, model, (x, text), dout


def timesteps(per_frame: bool, batch: int = 2) -> torch.Tensor:
    """(B,) per sample, or (B, T) per latent frame: diffusion forcing's, noisier on later frames."""
    if per_frame:
        return torch.tensor([[0.0, 250.0, 600.0], [30.0, 500.0, 999.0]])[:batch]
    return torch.tensor([30.0, 810.0])[:batch]


def run_reference(reference, x, t, text, fps=None):
    """The diffusers call: diffusion forcing with one timestep per frame (a per-sample t on every frame)."""
    t = t[:, None].expand(-1, x.shape[2]) if t.dim() == 1 else t
    return reference(x, t, text, enable_diffusion_forcing=True, fps=fps, return_dict=False)[0]


def check_layouts(rank, world):
    for ring, ulysses in LAYOUTS:
        dims = init_sequence_parallel(ring, ulysses)
        # per-frame t: the general case of the one code path (a per-sample t is the same t on every frame)
        reference, model, (x, text), dout = skyreels_case(dims=dims)
        t = timesteps(per_frame=True)
        ref_out, ref_grads = forward_backward(lambda: run_reference(reference, x, t, text), reference, dout)
        out, grads = forward_backward(lambda: model(x, t, {"text": text}), model.transformer, dout)
        for grad in (g for g in grads.values() if g is not None):  # DDP's average over the dp x sp ranks
            dist.all_reduce(grad)
            grad /= world
        assert_matches_diffusers(out, grads, ref_out, ref_grads, f"ring {ring} x ulysses {ulysses}")


def test_skyreels_matches_unmodified_diffusers_under_every_layout():
    """Ring 2, ring 4, Ulysses 2 and 2 x 2 on one 4-rank group; 27 tokens (padded), a timestep per frame (the
    per-token modulation cut at every block, the final shift / scale after the gather)."""
    run_ranks(check_layouts, 4)


@pytest.mark.parametrize("per_frame", [False, True], ids=["timestep", "per_frame_timesteps"])
def test_skyreels_one_process_equals_diffusers(per_frame):
    reference, model, (x, text), dout = skyreels_case()
    t = timesteps(per_frame)
    ref_out, ref_grads = forward_backward(lambda: run_reference(reference, x, t, text), reference, dout)
    out, grads = forward_backward(lambda: model(x, t, {"text": text}), model.transformer, dout)
    assert_matches_diffusers(out, grads, ref_out, ref_grads)


def test_skyreels_fps_embedding_at_batch_two():
    """The DF models embed the frame rate (inject_sample_info). diffusers repeats a per-sample fps embedding by the
    frame count in diffusion-forcing mode (wrong for batch > 1); ringdit passes one fps for the batch, which
    broadcasts: the same numbers as diffusers called with that one entry, and as each sample alone."""
    reference, model, (x, text), dout = skyreels_case(inject_sample_info=True)
    t = timesteps(True)
    ref_out, ref_grads = forward_backward(lambda: run_reference(reference, x, t, text, fps=[1]), reference, dout)
    out, grads = forward_backward(lambda: model(x, t, {"text": text}), model.transformer, dout)
    assert_matches_diffusers(out, grads, ref_out, ref_grads)
    with torch.no_grad():
        alone = run_reference(reference, x[1:], t[1:], text[1:], fps=[1])
    assert_matches_diffusers(out[1:], {}, alone, {})


def test_skyreels_block_causal_attention_is_refused():
    _, model, (x, text), _ = skyreels_case(num_frame_per_block=3)
    with pytest.raises(NotImplementedError, match=r"num_frame_per_block=3 .* use num_frame_per_block=1"):
        model(x, timesteps(False), {"text": text})


# ---- train.py ------------------------------------------------------------------------------------------------------

def test_skyreels_sgd_steps_equal_one_process_and_ring_2(tmp_path):
    assert_sgd_steps_equal_one_process_and_ring2(tmp_path, SKYREELS, steps=2)


BAD_INPUTS = {
    "a folder of another family": ("model.pretrained={root}/wan", r"holds a WanTransformer3DModel, not a "
                                                                  r"SkyReelsV2Transformer3DModel \(model.family="
                                                                  r"skyreels_v2\)"),
    "more Ulysses ranks than heads": ("ulysses_degree=4", r"ulysses_degree=4 is more than the model's num_heads=2"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_skyreels_bad_input_is_refused_before_spawning(case, tmp_path):
    wan_folder(tmp_path)
    override, message = BAD_INPUTS[case]
    assert_refused_before_spawning(tmp_path, [*SKYREELS, override.format(root=tmp_path)], message)
