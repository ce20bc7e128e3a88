"""HunyuanVideo 1.5 under ring / Ulysses / USP against the unmodified diffusers model on one process: forward and every
parameter gradient, the text after the video tokens and padded (a masked prompt, a text length no degree divides);
the same SGD steps through train.py on one process and a ring of 2; bad settings refused before spawning."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from ringdit.models import parallelize
from ringdit.parallel import init_sequence_parallel
from tests.diffusers_helpers import forward_backward
from tests.distributed import run_ranks
from tests.families import (
    HUNYUAN,
    assert_refused_before_spawning,
    assert_sgd_steps_equal_one_process_and_ring2,
    wan_folder,
)
from tests.helpers import architecture, assert_same_numbers, logged_losses, model_weights

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (T, H, W) latents, 1x1x1 patches: 2 x 4 x 4 = 32 tokens divide every degree; 3 x 3 x 3 = 27 need tail padding
# (the padded one on every layout, the other where the ring crosses ranks, to keep the test near 60 s on 2 cores)
LAYOUTS = {(2, 1): [(2, 4, 4), (3, 3, 3)], (4, 1): [(3, 3, 3)], (1, 2): [(3, 3, 3)],
           (2, 2): [(2, 4, 4), (3, 3, 3)]}  # (ring, ulysses) on 4 ranks: the latent shapes
TEXT_LEN = 5  # Qwen2.5-VL states; with the single masked ByT5 and image tokens the joint text is 7: padded everywhere


def hunyuan_case(shape, seed=0, dims=None):
    """The same weights and inputs on every rank: an unmodified reference, a ringdit model, both calls, dout."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer

    config = architecture("hunyuan_video15_tiny")
    torch.manual_seed(seed)
    reference = diffusers.HunyuanVideo15Transformer3DModel.from_config(config)
    model = DiffusersTransformer("hunyuan_video15", config=config, input_size=shape, in_channels=4,
                                 text_len=TEXT_LEN, text_dim=16)
    model.transformer.load_state_dict(reference.state_dict())
    parallelize(model, dims=dims)  # dims None: one process, attention still routed to ringdit
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 4, *shape, generator=g)
    t = torch.tensor([30.0, 810.0])
    mask = torch.tensor([[True] * TEXT_LEN, [True, True, True, False, False]])  # the second prompt padded
    text = torch.randn(2, TEXT_LEN, 16, generator=g) * mask[..., None]
    dout = torch.randn(2, 4, *shape, generator=g)

    def run_reference():  # as the text-to-video pipeline calls it: zero condition latents, glyph text and image
        condition = torch.zeros(2, 5, *shape)
        return reference(hidden_states=torch.cat([x, condition], dim=1), timestep=t, encoder_hidden_states=text,
                         encoder_attention_mask=mask, encoder_hidden_states_2=torch.zeros(2, 1, 8),
                         encoder_attention_mask_2=torch.zeros(2, 1, dtype=torch.bool),
                         image_embeds=torch.zeros(2, 1, 12), return_dict=False)[0]

    return reference, model, run_reference, lambda: model(x, t, {"text": text, "text_mask": mask}), dout


def assert_matches_diffusers(out, grads, ref_out, ref_grads, where=""):
    """Tolerances as tests/test_diffusers_models.py's (fp32): output within 1e-5, gradients within 1e-4 of their max.

    The token refiner's key biases are the exception: its attention has no key norm, and softmax does not change when
    every key of a row moves by the same q.b, so their gradient is zero and both sides hold rounding noise (1e-10 of
    gradients of order 1): each must be that small next to the same projection's weight gradient instead."""
    grads, ref_grads = dict(grads), dict(ref_grads)
    for name in [name for name in ref_grads if name.startswith("context_embedder.") and name.endswith("to_k.bias")]:
        scale = ref_grads[name.replace(".bias", ".weight")].abs().max()
        for side in (grads, ref_grads):
            assert side.pop(name).abs().max() <= 1e-6 * scale, f"{where} {name}: a key bias gradient is not ~0"
    assert_same_numbers(out, ref_out, atol=1e-5, where=f"{where} output")
    assert_same_numbers(grads, ref_grads, of_max=1e-4, where=f"{where} gradient")


def check_layouts(rank, world):
    for (ring, ulysses), shapes in LAYOUTS.items():
        dims = init_sequence_parallel(ring, ulysses)
        for shape in shapes:
            reference, model, run_reference, run_model, dout = hunyuan_case(shape, dims=dims)
            ref_out, ref_grads = forward_backward(run_reference, reference, dout)
            out, grads = forward_backward(run_model, model.transformer, dout)
            for grad in (g for g in grads.values() if g is not None):  # DDP's average over the dp x sp ranks
                dist.all_reduce(grad)
                grad /= world
            assert_matches_diffusers(out, grads, ref_out, ref_grads, f"ring {ring} x ulysses {ulysses}, {shape}")


def test_hunyuan_video15_matches_unmodified_diffusers_under_every_layout():
    """Joint [video ; text] attention with the text sharded after the video and a padded prompt: its full (B, 1, S, S)
    mask is taken as the key mask it is; every real key counts once, the masked ones never."""
    run_ranks(check_layouts, 4)


def test_hunyuan_video15_one_process_equals_diffusers():
    reference, model, run_reference, run_model, dout = hunyuan_case((3, 3, 3))
    ref_out, ref_grads = forward_backward(run_reference, reference, dout)
    out, grads = forward_backward(run_model, model.transformer, dout)
    assert_matches_diffusers(out, grads, ref_out, ref_grads)


def test_a_mask_that_is_not_a_key_mask_is_refused():
    """A (B, 1, S, S) mask that is not real[i] & real[j] (a causal one) cannot be a key mask: a clear error."""
    from ringdit.models.parallelize import _square_key_mask

    causal = torch.ones(1, 4, 4, dtype=torch.bool).tril()
    with pytest.raises(NotImplementedError, match=r"not the outer product of a key mask with itself"):
        _square_key_mask(causal)
    real = torch.tensor([[True, True, False, True]])
    assert torch.equal(_square_key_mask(real[:, :, None] & real[:, None, :]), real)


# ---- through train.py ----------------------------------------------------------------------------------------------

def test_hunyuan_video15_sgd_steps_equal_one_process_and_ring2(tmp_path):
    assert_sgd_steps_equal_one_process_and_ring2(tmp_path, HUNYUAN, steps=3)
    reference = logged_losses(tmp_path / "ring1")
    assert reference[2] != pytest.approx(reference[0], rel=1e-3)  # the steps did change the model
    ref_weights, weights = model_weights(tmp_path / "ring1"), model_weights(tmp_path / "ring2")
    assert any(key.startswith("model.transformer.transformer_blocks.") for key in ref_weights)
    for key, value in ref_weights.items():
        assert_same_numbers(weights[key], value, rtol=1e-5, atol=1e-6, where=key)


BAD_INPUTS = {
    "model.family does not match model.pretrained": (
        ["model.pretrained={root}/wan"], r"holds a WanTransformer3DModel, not a HunyuanVideo15Transformer3DModel "
                                         r"\(model.family=hunyuan_video15\)"),
    "more Ulysses ranks than heads": (["ulysses_degree=4"], r"ulysses_degree=4 is more than the model's num_heads=2"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_hunyuan_video15_bad_input_is_refused_before_spawning(case, tmp_path):
    wan_folder(tmp_path)
    overrides, message = BAD_INPUTS[case]
    assert_refused_before_spawning(tmp_path, ["experiment=hunyuan_video15_tiny", "data.num_samples=16",
                                              *(o.format(root=tmp_path) for o in overrides)], message)
