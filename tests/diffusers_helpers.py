"""What the diffusers-model test modules share to compare ringdit's model with the unmodified diffusers model: the
(ring, ulysses) layouts on 4 ranks, a forward and backward that collects the output and every parameter gradient, the
comparison with its tolerances, Wan 2.2 TI2V's per-token timesteps, and a recorder of a transformer's calls."""

from __future__ import annotations

import torch

from tests.helpers import assert_same_numbers

LAYOUTS = [(2, 1), (4, 1), (1, 2), (2, 2)]  # (ring, ulysses) on 4 ranks


def forward_backward(call, model, dout):
    model.zero_grad()
    out = call()
    (out * dout).sum().backward()
    # a parameter the model does not use here (QwenImage's last text-stream MLP) has no gradient on either side
    return out.detach(), {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def assert_matches_diffusers(out, grads, ref_out, ref_grads, where=""):
    """The prediction within 1e-5 (fp32, outputs of order 1: the rounding of another GEMM order and the ring's merges,
    ~1e-6 measured), every gradient within 1e-4 of its own largest entry (a sum over tokens, rounded more)."""
    assert_same_numbers(out, ref_out, atol=1e-5, where=f"{where} output")
    assert_same_numbers(grads, ref_grads, of_max=1e-4, where=f"{where} gradient")


def per_token_timesteps(shape, t):
    """(B, S) timesteps of the (T, H/2, W/2) tokens of latents ``shape`` (Wan's 1x2x2 patches): 0 on the first
    frame's tokens (the given image), ``t`` elsewhere, as Wan 2.2 TI2V samples."""
    frames, height, width = shape
    first_frame = torch.zeros(frames, height // 2, width // 2, dtype=torch.bool)
    first_frame[0] = True
    return torch.where(first_frame.flatten(), 0.0, t[:, None])  # (B, S)


def recorded_calls(transformer) -> list[dict]:
    """Every call's tensor keyword arguments, recorded as the transformer receives them."""
    calls = []
    transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append({k: v.clone() for k, v in kwargs.items()
                                                   if isinstance(v, torch.Tensor)}), with_kwargs=True)
    return calls
