"""diffusers models under ring / Ulysses / USP against the unmodified diffusers model on one process (its own
attention): forward and every parameter gradient, on spawned CPU ranks (gloo)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ringdit.parallel import init_sequence_parallel
from tests.distributed import run_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
LAYOUTS = [(2, 1), (4, 1), (1, 2), (2, 2)]  # (ring, ulysses) on 4 ranks
# (T, H, W) latents: 2 x 4 x 4 = 32 tokens divide every degree; 3 x 3 x 3 = 27 need tail padding (Wan's usual
# 21 latent frames do not divide the degree either).
SHAPES = [(2, 8, 8), (3, 6, 6)]


def wan_case(shape, seed=0):
    """The same weights and inputs on every rank: a unmodified reference model, a ringdit one, inputs, dout."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer

    torch.manual_seed(seed)
    reference = diffusers.WanTransformer3DModel.from_config(WAN_TINY)
    model = DiffusersTransformer("wan", config=WAN_TINY, input_size=shape, in_channels=4, text_len=7, text_dim=16)
    model.transformer.load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 4, *shape, generator=g)
    t = torch.tensor([30.0, 810.0])
    text = torch.randn(2, 7, 16, generator=g)
    dout = torch.randn(2, 4, *shape, generator=g)
    return reference, model, (x, t, text), dout


def forward_backward(call, model, dout):
    model.zero_grad()
    out = call()
    (out * dout).sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_grads_match(grads, reference, rtol=1e-4):
    assert grads.keys() == reference.keys()
    for name, ref in reference.items():
        scale = ref.abs().max().clamp_min(1e-12)
        error = (grads[name] - ref).abs().max() / scale
        assert error <= rtol, f"{name}: relative gradient error {error:.2e}"


def check_wan_layouts(rank, world):
    for ring, ulysses in LAYOUTS:
        init_sequence_parallel(ring, ulysses)
        for shape in SHAPES:
            reference, model, (x, t, text), dout = wan_case(shape)
            ref_out, ref_grads = forward_backward(
                lambda: reference(x, t, text, return_dict=False)[0], reference, dout)
            out, grads = forward_backward(lambda: model(x, t, {"text": text}), model.transformer, dout)
            # every rank computed the full loss of the same batch: DDP's average of the ranks' gradients (over
            # dp x sp ranks) must be the one-device gradient
            for grad in grads.values():
                dist.all_reduce(grad)
                grad /= world
            where = f"ring {ring} x ulysses {ulysses}, latents {shape}"
            assert (out - ref_out).abs().max() <= 1e-5, where
            assert_grads_match(grads, ref_grads)


def test_wan_matches_unmodified_diffusers_under_every_layout():
    run_ranks(check_wan_layouts, 4)


def test_wan_one_process_equals_diffusers():
    reference, model, (x, t, text), dout = wan_case((3, 6, 6))
    ref_out, ref_grads = forward_backward(lambda: reference(x, t, text, return_dict=False)[0], reference, dout)
    out, grads = forward_backward(lambda: model(x, t, {"text": text}), model.transformer, dout)
    assert (out - ref_out).abs().max() <= 1e-5
    assert_grads_match(grads, ref_grads)
