"""Stand-ins for the flash-attn interfaces, with the real function signatures, computed by the ``math`` backend.

They let CI (no CUDA, no flash-attn) check the adapter's argument plumbing, layouts and LSE handling against three
generations of the API: flash-attn 2.5 (``window_size`` tuple, backward returns dq/dk/dv), flash-attn 2.8
(custom op with ``window_size_left/right``, backward fills preallocated dq/dk/dv and returns softmax_d) and
flash-attn 3 (``flash_attn_interface``, ``is_causal``, no dropout).
"""

from __future__ import annotations

import types

import torch

from ringdit.attention.backends.math_backend import MathBackend

_math = MathBackend()


def _forward(q, k, v, softmax_scale):
    out, lse = _math.forward_ring_kv_chunk(q, k, v, softmax_scale=softmax_scale)
    return out, lse.float()  # flash-attn's LSE is always fp32 [B, H, Sq]


def _backward_into(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale):
    assert softmax_lse.dtype == torch.float32 and softmax_lse.is_contiguous()
    for name, tensor in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert tensor is not None, f"{name} must be preallocated"
    gq, gk, gv = _math.backward_ring_kv_chunk(dout, q, k, v, out, softmax_lse, softmax_scale=softmax_scale)
    dq.copy_(gq), dk.copy_(gk), dv.copy_(gv)
    return torch.zeros(softmax_lse.shape)


def flash_attn_2_5() -> types.ModuleType:
    module = types.ModuleType("fake_flash_attn_2_5.flash_attn_interface")

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        alibi_slopes=None, deterministic=False, return_attn_probs=False):
        assert dropout_p == 0.0 and not causal and window_size == (-1, -1)
        out, lse = _forward(q, k, v, softmax_scale)
        return (out, lse, torch.empty(0)) if return_attn_probs else out

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, alibi_slopes, deterministic, rng_state=None):
        assert dropout_p == 0.0 and not causal and window_size == (-1, -1) and alibi_slopes is None
        softmax_d = _backward_into(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale)
        return dq, dk, dv, softmax_d

    module.flash_attn_func, module._flash_attn_backward = flash_attn_func, _flash_attn_backward
    return module


class _CustomOpDef:
    """Mimics torch.library.custom_op's wrapper: the signature lives on ``_init_fn``."""

    def __init__(self, fn):
        self._init_fn = fn

    def __call__(self, *args, **kwargs):
        return self._init_fn(*args, **kwargs)


def flash_attn_2_8() -> types.ModuleType:
    module = types.ModuleType("fake_flash_attn_2_8.flash_attn_interface")

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        out, lse = _forward(q, k, v, softmax_scale)
        return (out, lse, torch.empty(0)) if return_attn_probs else out

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                             rng_state=None):
        assert (window_size_left, window_size_right, softcap, dropout_p) == (-1, -1, 0.0, 0.0)
        return _backward_into(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale)

    module.flash_attn_func, module._flash_attn_backward = flash_attn_func, _CustomOpDef(_flash_attn_backward)
    return module


def flash_attn_3() -> types.ModuleType:
    module = types.ModuleType("flash_attn_interface")

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
        out, lse = _forward(q, k, v, softmax_scale)
        return (out, lse) if return_attn_probs else out

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                             sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None,
                             softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1,
                             softcap=0.0, deterministic=False, sm_margin=0):
        assert cu_seqlens_q is None and not is_causal
        return _backward_into(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale)

    module.flash_attn_func, module._flash_attn_backward = _CustomOpDef(flash_attn_func), _CustomOpDef(_flash_attn_backward)
    return module


FAKE_APIS = {"flash-attn 2.5": flash_attn_2_5, "flash-attn 2.8": flash_attn_2_8, "flash-attn 3": flash_attn_3}
