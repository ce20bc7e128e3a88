"""The attention-backend contract: one class per kernel family.

Every backend computes plain softmax attention in the ``[B, S, H, D]`` layout. Backends whose kernel also returns
the softmax log-sum-exp (LSE) can take part in ring attention: ``forward_ring_kv_chunk`` attends the local queries
to ONE chunk of keys/values and returns ``(out, lse)``, so that the chunks of a ring can be merged exactly, and
``backward_ring_kv_chunk`` returns that chunk's share of the gradient given the FINAL merged ``out`` and ``lse``
(this is how flash-attention's backward composes across chunks: ``P = exp(S - lse_final)`` is the chunk's slice of
the full softmax, and ``rowsum(dout * out_final)`` is the full-row correction term).

Forward mode (``torch.func.jvp``, ``torch.autograd.forward_ad``) composes the same way: ``jvp_ring_kv_chunk`` returns
one chunk's share of the output's tangent given the FINAL ``lse``, and the shares of all chunks add up (see
``attention_tangent``; the derivation is in docs/concepts.md).

Capabilities are never declared by hand: ``supports_ring_rotation()`` is True exactly when a class overrides
``forward_ring_kv_chunk`` (``supports_ring_backward()`` when it overrides ``backward_ring_kv_chunk``,
``supports_forward_ad()`` when it overrides ``jvp_ring_kv_chunk``).
"""

from __future__ import annotations

import functools
from typing import Callable, ClassVar

import torch

Tensor = torch.Tensor


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax statistics and merges run in: fp32, or fp64 for fp64 inputs (the reference)."""
    return torch.promote_types(dtype, torch.float32)


def accepts_packed_layout(chunk_fn: Callable) -> Callable:
    """Let a batched ``[B, S, H, D]`` chunk hook also take the packed ``[T, H, D]`` layout (variable-length kernels').

    Nothing inside ringdit packs; the layout is kept because it is part of the backend contract
    (``forward_ring_kv_chunk`` takes either), so kernels written against a packed, serving-style interface keep working.

    Packed inputs are viewed as a batch of one; ``out`` comes back as ``[Tq, H, D]`` and ``lse`` as ``[H, Tq]``.
    Every tensor argument is packed or none is.
    """

    @functools.wraps(chunk_fn)
    def wrapper(self, *tensors: Tensor, **kwargs):
        if tensors[0].dim() == 4:
            return chunk_fn(self, *tensors, **kwargs)
        if tensors[0].dim() != 3:
            raise ValueError(
                f"attention expects [B, S, H, D] or packed [T, H, D] tensors, got shape {tuple(tensors[0].shape)}"
            )
        # lse is the one argument with a different rank: [H, Tq] packed, [B, H, Tq] batched.
        batched = [t.unsqueeze(0) for t in tensors]
        results = chunk_fn(self, *batched, **kwargs)
        return tuple(r.squeeze(0) for r in results)

    return wrapper


class AttentionBackend:
    """Base class of attention kernels. Subclasses set ``name`` and implement ``forward``.

    Layout: ``q [B, Sq, H, D]``, ``k, v [B, Sk, H, D]``; ``lse [B, H, Sq]`` in fp32 (fp64 for fp64 inputs).
    """

    name: ClassVar[str] = ""
    # Lower is preferred when a backend is picked automatically (and orders RING_CAPABLE_ATTENTION_BACKENDS).
    priority: ClassVar[int] = 100
    # Informational (the README's table, the benchmarks): the kernels themselves reject what they cannot run.
    device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)

    # ---- availability ------------------------------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls, device_type: str | None = None) -> str | None:
        """Why this backend cannot run on ``device_type`` here (None when it can)."""
        device_type = device_type or default_device_type()
        if device_type not in cls.device_types:
            return f"{cls.name} runs on {'/'.join(cls.device_types)}, not {device_type}"
        if device_type == "cuda" and not torch.cuda.is_available():
            return "no CUDA device is visible"
        return None

    @classmethod
    def is_available(cls, device_type: str | None = None) -> bool:
        return cls.unavailable_reason(device_type) is None

    # ---- capabilities (derived, never declared) ---------------------------------------------------------------
    @classmethod
    def supports_ring_rotation(cls) -> bool:
        """True when the kernel exposes the softmax LSE, i.e. the class implements ``forward_ring_kv_chunk``."""
        return cls.forward_ring_kv_chunk is not AttentionBackend.forward_ring_kv_chunk

    @classmethod
    def supports_ring_backward(cls) -> bool:
        """True when ring attention can be trained with this backend (it implements ``backward_ring_kv_chunk``)."""
        return cls.backward_ring_kv_chunk is not AttentionBackend.backward_ring_kv_chunk

    @classmethod
    def supports_forward_ad(cls) -> bool:
        """True when the output's tangent can be computed with this backend, locally and over the ring (it implements
        ``jvp_ring_kv_chunk``)."""
        return cls.jvp_ring_kv_chunk is not AttentionBackend.jvp_ring_kv_chunk

    @classmethod
    def enum_name(cls) -> str:
        return cls.name.upper()

    # ---- kernels ----------------------------------------------------------------------------------------------
    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: float | None = None) -> Tensor:
        """Plain local attention ``[B, Sq, H, D] -> [B, Sq, H, D]``, differentiable."""
        raise NotImplementedError(f"{type(self).__name__} does not implement attention forward")

    def forward_ring_kv_chunk(
        self, q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: float | None = None
    ) -> tuple[Tensor, Tensor]:
        """Attend local queries to one rotated K/V chunk for ring merging: returns ``(out, lse)``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement ring KV-chunk attention")

    def backward_ring_kv_chunk(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        *,
        softmax_scale: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """This K/V chunk's ``(dq, dk, dv)`` given the FINAL merged ``out`` and ``lse`` of the whole row."""
        raise NotImplementedError(f"{type(self).__name__} does not implement ring KV-chunk attention backward")

    def jvp_ring_kv_chunk(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        dq: Tensor,
        dk: Tensor,
        dv: Tensor,
        lse: Tensor,
        *,
        softmax_scale: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        """This K/V chunk's share ``(partial, rowsum)`` of the output's tangent given the FINAL ``lse`` of the whole
        row (``dq, dk, dv``: the tangents of ``q, k, v``). With ``P = exp(S - lse)`` the chunk's slice of the full
        softmax and ``dS = scale * (dq k^T + q dk^T)``: ``partial = P dv + (P * dS) v`` ``(B, Sq, H, D)`` and
        ``rowsum = rowsum(P * dS)`` ``(B, H, Sq)``, both in the accumulation dtype; summed over the chunks they give
        the tangent ``partial - rowsum * out`` (``attention_tangent``)."""
        raise NotImplementedError(f"{type(self).__name__} has no forward-mode (JVP) rule")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def attention_tangent(partial: Tensor, rowsum: Tensor, out: Tensor) -> Tensor:
    """The output's tangent from the chunk shares summed over every chunk of the row: ``partial - rowsum * out``
    (``partial (B, S, H, D)``, ``rowsum (B, H, S)`` in the accumulation dtype; ``out`` the forward's output)."""
    return partial - rowsum.transpose(1, 2).unsqueeze(-1) * out.to(partial.dtype)


def zero_tangents(primals, tangents) -> list[Tensor]:
    """Forward mode passes None for an input without a tangent: a zero tangent of the same shape."""
    return [torch.zeros_like(p) if t is None else t for p, t in zip(primals, tangents)]


class ChunkKernelAttention(torch.autograd.Function):
    """Plain attention built from a backend's own chunk kernels: forward = one chunk, backward = its gradient,
    jvp = its tangent (``jvp_ring_kv_chunk``).

    Lets LSE-returning kernels (which are not differentiable ops themselves) serve ``AttentionBackend.forward``.
    ``forward`` / ``setup_context`` are separate (and ``lse`` an output, not differentiable) so that ``torch.func``
    transforms (``jvp``) can run it; call it through ``chunk_kernel_attention``.
    """

    @staticmethod
    def forward(backend: AttentionBackend, q: Tensor, k: Tensor, v: Tensor, softmax_scale: float | None):
        # autocast must not re-type the statistics: backward (which runs outside autocast) recomputes against them
        with torch.autocast(q.device.type, enabled=False):
            return backend.forward_ring_kv_chunk(q, k, v, softmax_scale=softmax_scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        backend, q, k, v, softmax_scale = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.save_for_forward(q, k, v, out, lse)
        ctx.backend, ctx.softmax_scale = backend, softmax_scale

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):  # also when backward is called inside autocast
            dq, dk, dv = ctx.backend.backward_ring_kv_chunk(dout, q, k, v, out, lse, softmax_scale=ctx.softmax_scale)
        return None, dq, dk, dv, None

    @staticmethod
    def jvp(ctx, _dbackend, dq, dk, dv, _dscale):
        q, k, v, out, lse = ctx.saved_tensors
        check_forward_ad_capable(ctx.backend)
        dq, dk, dv = zero_tangents((q, k, v), (dq, dk, dv))
        # no_grad: the tangent is a constant to reverse mode (what sCM's stop-gradient wants; see docs/concepts.md)
        with torch.autocast(q.device.type, enabled=False), torch.no_grad():
            partial, rowsum = ctx.backend.jvp_ring_kv_chunk(q, k, v, dq, dk, dv, lse, softmax_scale=ctx.softmax_scale)
            # in out's own strides (fused kernels return a transposed view): forward AD wants the layouts to match
            return torch.empty_like(out).copy_(attention_tangent(partial, rowsum, out)), None


def chunk_kernel_attention(backend: AttentionBackend, q: Tensor, k: Tensor, v: Tensor, softmax_scale: float | None):
    """``ChunkKernelAttention``'s output (its lse is internal)."""
    return ChunkKernelAttention.apply(backend, q, k, v, softmax_scale)[0]


def check_forward_ad_capable(backend: AttentionBackend) -> None:
    """The one-line refusal where a forward-mode derivative meets a backend without the rule."""
    if not backend.supports_forward_ad():
        raise RuntimeError(
            f"attention backend {backend.name!r} has no forward-mode (JVP) rule (it does not implement "
            f"jvp_ring_kv_chunk), so torch.func.jvp / forward_ad cannot run through it; use attention_backend= one of "
            f"({', '.join(_forward_ad_classes())})"
        )


def _forward_ad_classes() -> list[str]:
    """The backend classes with a forward-mode rule, in the registry's order (priority, name): read from the classes
    themselves, as the registry reads them (which imports this module, so it cannot be asked here)."""
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    capable = {cls.name: cls for cls in subclasses(AttentionBackend) if cls.name and cls.supports_forward_ad()}
    return sorted(capable, key=lambda name: (capable[name].priority, name))
