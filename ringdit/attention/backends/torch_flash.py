"""``torch_flash``: PyTorch's own fused attention kernels, called at the level where they return the softmax LSE.

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (fp64, fp32, bf16, fp16).
- CUDA: ``aten._scaled_dot_product_flash_attention`` (fp16/bf16) or, for fp32 and head sizes flash cannot take,
  ``aten._scaled_dot_product_efficient_attention``, each with its backward op.

Not (yet) the cuDNN kernel: on an H200, ``torch_sdpa`` (which picks it) ran 1.6x faster than FlashAttention-2 in
bf16, but its LSE layout and backward have not been checked on a GPU here.

The kernels take ``[B, H, S, D]``; ours is ``[B, S, H, D]``, so inputs and outputs are transposed views (no copies).
"""

from __future__ import annotations

import functools

import torch

from ringdit.attention.backend import AttentionBackend, Tensor, accepts_packed_layout, chunk_kernel_attention
from ringdit.attention.backends.math_backend import chunk_tangent

aten = torch.ops.aten
# The CUDA memory-efficient kernel pads its LSE's sequence dim to a multiple of this (kAlignLSE in ATen).
_EFFICIENT_LSE_ALIGN = 32


def _bhsd(*tensors: Tensor) -> list[Tensor]:
    return [t.transpose(1, 2) for t in tensors]


def _use_cuda_flash_kernel(q: Tensor) -> bool:
    """FlashAttention-2 on CUDA takes fp16/bf16 with head sizes that are multiples of 8, up to 256."""
    head_size = q.shape[-1]
    return q.dtype in (torch.float16, torch.bfloat16) and head_size % 8 == 0 and head_size <= 256


@functools.lru_cache(maxsize=None)
def _dense_kernel_placeholders(kernel: str, device: torch.device, dtype: torch.dtype):
    """The non-varlen, no-dropout bookkeeping tensors the CUDA backward ops want back from their forward.

    A chunk's backward runs without that chunk's forward call (it uses the final out/lse), so take them once from
    a tiny forward: whatever the kernel returns for a dense call is what its backward accepts.
    """
    x = torch.zeros(1, 1, 8, 64, device=device, dtype=dtype)
    if kernel == "flash":
        _, _, cum_q, cum_k, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(x, x, x)
        return cum_q, cum_k, seed, offset
    _, _, seed, offset = aten._scaled_dot_product_efficient_attention(x, x, x, None, True)
    return None, None, seed, offset


class TorchFlashBackend(AttentionBackend):
    name = "torch_flash"
    priority = 0  # the default everywhere: always installed, fused, and ring-capable
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)  # fp64 on CPU only

    def forward(self, q, k, v, *, softmax_scale=None):
        return chunk_kernel_attention(self, q, k, v, softmax_scale)

    @accepts_packed_layout
    def forward_ring_kv_chunk(self, q, k, v, *, softmax_scale=None):
        qt, kt, vt = _bhsd(q, k, v)
        if q.device.type == "cpu":
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, scale=softmax_scale)
        elif _use_cuda_flash_kernel(q):
            out, lse = aten._scaled_dot_product_flash_attention(qt, kt, vt, scale=softmax_scale)[:2]
        else:
            _check_cuda_dtype(q)
            out, lse = aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True, scale=softmax_scale)[:2]
            lse = lse[..., : q.shape[1]]
        return out.transpose(1, 2), lse  # (B, Sq, H, D), (B, H, Sq)

    @accepts_packed_layout
    def backward_ring_kv_chunk(self, dout, q, k, v, out, lse, *, softmax_scale=None):
        dout_t, qt, kt, vt, out_t = _bhsd(dout, q, k, v, out)
        lse = lse.contiguous()
        if q.device.type == "cpu":
            grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout_t, qt, kt, vt, out_t, lse, 0.0, False, scale=softmax_scale
            )
        elif _use_cuda_flash_kernel(q):
            cum_q, cum_k, seed, offset = _dense_kernel_placeholders("flash", q.device, q.dtype)
            grads = aten._scaled_dot_product_flash_attention_backward(
                dout_t, qt, kt, vt, out_t, lse, cum_q, cum_k, q.shape[1], k.shape[1], 0.0, False, seed, offset,
                scale=softmax_scale,
            )
        else:
            _check_cuda_dtype(q)
            _, _, seed, offset = _dense_kernel_placeholders("efficient", q.device, q.dtype)
            padded = -(-q.shape[1] // _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN
            lse = torch.nn.functional.pad(lse, (0, padded - q.shape[1]))
            grads = aten._scaled_dot_product_efficient_attention_backward(
                dout_t.contiguous(), qt, kt, vt, None, out_t, lse, seed, offset, 0.0, [True, True, True, False],
                False, scale=softmax_scale,
            )[:3]
        dq, dk, dv = (g.transpose(1, 2) for g in grads[:3])
        return dq, dk, dv


    @accepts_packed_layout
    def jvp_ring_kv_chunk(self, q, k, v, dq, dk, dv, lse, *, softmax_scale=None):
        # No fused kernel computes a tangent: the chunk's share is written out in PyTorch (as the math backend does),
        # against the lse this backend's fused forward returned.
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return chunk_tangent(q, k, v, dq, dk, dv, lse, scale)


def _check_cuda_dtype(q: Tensor) -> None:
    if q.dtype == torch.float64:
        raise TypeError(
            "torch_flash has no fp64 kernel on CUDA; use attention_backend=math for fp64 on GPU "
            "(or run fp64 on CPU, where torch_flash supports it)"
        )
