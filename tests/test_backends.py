"""Every attention backend against the ``math`` reference in fp64, and the chunk contract ring attention relies on."""

from __future__ import annotations

import logging

import pytest
import torch

from ringdit.attention import (
    RING_CAPABLE_ATTENTION_BACKENDS,
    AttentionBackend,
    FlashAttnBackend,
    USPAttention,
    get_attn_backend,
    list_backends,
    merge_attention_chunk,
    register_backend,
    registry,
    validate_attention_config,
)
from ringdit.attention.backends.flash_attn import FlashAttnAPI
from ringdit.parallel import ParallelDims
from tests.fake_flash_attn import FAKE_APIS

BF16_UNIT_ROUNDOFF = 2.0**-8  # bf16 keeps 8 significant bits
# Forward: the output is rounded once and the probabilities may be rounded before P @ V -> 2u of max|out|.
# Gradients: dout, out, P and dP are each rounded once more -> 4u of max|grad|.
BF16_FORWARD_TOL, BF16_GRAD_TOL = 2 * BF16_UNIT_ROUNDOFF, 4 * BF16_UNIT_ROUNDOFF
# fp32 against the fp64 truth: an element sums up to 128 products (the head size) or 77 keys, rounded at u = 6e-8,
# the errors adding like a random walk (sqrt(128) ~ 11), over a few stages (scores, softmax, P @ V; dP, dS) on values
# of max ~2: ~6e-8 x 11 x 4 x 2 ~ 5e-6. Measured at most 1.8e-6 (torch_flash's dq, head size 128) on four of this
# CPU's code paths (MKL_CBWR, ATEN_CPU_CAPABILITY); another CPU's kernels reorder the same sums.
FP32_TOL = 1e-5

CPU_BACKENDS = [name for name in list_backends() if registry.backend_class(name).is_available("cpu")]
CPU_RING_BACKENDS = [name for name in CPU_BACKENDS if name in RING_CAPABLE_ATTENTION_BACKENDS]


def fake_flash_attn_backend(api_name: str) -> FlashAttnBackend:
    return FlashAttnBackend(api=FlashAttnAPI.from_module(FAKE_APIS[api_name]()))


def make_backend(name: str) -> AttentionBackend:
    return fake_flash_attn_backend(name) if name in FAKE_APIS else get_attn_backend(name, device_type="cpu")


RING_UNDER_TEST = CPU_RING_BACKENDS + list(FAKE_APIS)


def random_qkv(batch, seq_q, seq_k, heads, head_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, seq_q, heads, head_size), (batch, seq_k, heads, head_size), (batch, seq_k, heads, head_size),
              (batch, seq_q, heads, head_size)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]  # q, k, v, dout


def reference(q, k, v, dout, scale=None):
    """fp64 autograd through the math backend's forward, on the (possibly bf16-rounded) inputs."""
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vd)
    out.backward(dout.double())
    return out.detach(), scores.logsumexp(-1).detach(), (qd.grad, kd.grad, vd.grad)


def assert_lse_close(actual, expected, dtype):
    # bf16 kernels may round the scaled queries before Q @ K^T: a relative error well under one unit roundoff.
    rel = 1e-5 if dtype != torch.bfloat16 else BF16_UNIT_ROUNDOFF / 4
    err = (actual.double() - expected).abs().max().item()
    assert err <= rel * max(1.0, expected.abs().max().item()), f"lse: max abs error {err:.3e}"


def assert_close(actual, expected, dtype, *, grad=False, what=""):
    err = (actual.double() - expected).abs().max().item()
    if dtype == torch.bfloat16:
        tol = (BF16_GRAD_TOL if grad else BF16_FORWARD_TOL) * expected.abs().max().item()
    else:
        tol = FP32_TOL if dtype == torch.float32 else 1e-12
    assert err <= tol, f"{what}: max abs error {err:.3e} > tolerance {tol:.3e}"


SHAPES = [  # batch, seq_q, seq_k, heads, head_size
    (2, 33, 77, 3, 16),
    (1, 64, 64, 2, 64),
    (2, 17, 40, 2, 128),
]


FORWARD_CASES = [(name, dtype) for name in CPU_BACKENDS for dtype in (torch.float32, torch.bfloat16, torch.float64)]
FORWARD_CASES += [(name, dtype) for name in FAKE_APIS for dtype in (torch.float32, torch.bfloat16)]  # no fp64


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(("name", "dtype"), FORWARD_CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_forward_matches_fp64_reference(name, shape, dtype):
    backend = make_backend(name)
    q, k, v, dout = random_qkv(*shape, dtype)
    ref_out, _, _ = reference(q, k, v, dout)
    out = backend.forward(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, ref_out, dtype, what=f"{name} forward")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", RING_UNDER_TEST)
def test_ring_chunk_hooks_match_reference_on_full_kv(name, shape, dtype):
    backend = make_backend(name)
    q, k, v, dout = random_qkv(*shape, dtype)
    ref_out, ref_lse, ref_grads = reference(q, k, v, dout)
    out, lse = backend.forward_ring_kv_chunk(q, k, v)
    assert out.shape == q.shape and lse.shape == (shape[0], shape[3], shape[1])
    assert lse.dtype == torch.float32
    assert_close(out, ref_out, dtype, what="out")
    assert_lse_close(lse, ref_lse, dtype)
    grads = backend.backward_ring_kv_chunk(dout, q, k, v, out, lse)
    for grad, ref, which in zip(grads, ref_grads, "qkv"):
        assert grad.shape == ref.shape and grad.dtype == dtype
        assert_close(grad, ref, dtype, grad=True, what=f"d{which}")


@pytest.mark.parametrize("pieces", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", RING_UNDER_TEST)
def test_kv_split_merges_to_full_attention(name, dtype, pieces):
    """The chunk contract of ring attention: chunks merged by LSE = full attention; chunk backwards (given the
    final out/lse) sum to the full gradient."""
    backend = make_backend(name)
    q, k, v, dout = random_qkv(2, 24, 50, 2, 32, dtype, seed=pieces)
    ref_out, ref_lse, (ref_dq, ref_dk, ref_dv) = reference(q, k, v, dout)
    acc = torch.float32
    out = torch.zeros(q.shape, dtype=acc)
    lse = torch.full((2, 2, 24), float("-inf"), dtype=acc)
    bounds = torch.linspace(0, 50, pieces + 1).long().tolist()
    chunks = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    for c in chunks:
        chunk_out, chunk_lse = backend.forward_ring_kv_chunk(q, k[:, c], v[:, c])
        out, lse = merge_attention_chunk(out, lse, chunk_out, chunk_lse)
    assert_close(out, ref_out, dtype, what="merged out")
    assert_lse_close(lse, ref_lse, dtype)
    out = out.to(dtype)
    dq = torch.zeros(q.shape, dtype=acc)
    dk, dv = [], []
    for c in chunks:
        g = backend.backward_ring_kv_chunk(dout, q, k[:, c], v[:, c], out, lse)
        dq += g[0]
        dk.append(g[1])
        dv.append(g[2])
    assert_close(dq, ref_dq, dtype, grad=True, what="summed dq")
    assert_close(torch.cat(dk, 1), ref_dk, dtype, grad=True, what="dk")
    assert_close(torch.cat(dv, 1), ref_dv, dtype, grad=True, what="dv")


@pytest.mark.parametrize("name", RING_UNDER_TEST)
def test_packed_layout(name):
    """The packed layout of the backend contract: [T, H, D] in, out [Tq, H, D] and lse [H, Tq] out."""
    backend = make_backend(name)
    q, k, v, dout = (t[0] for t in random_qkv(1, 9, 14, 3, 16, torch.float32))
    out, lse = backend.forward_ring_kv_chunk(q, k, v)
    assert out.shape == (9, 3, 16) and lse.shape == (3, 9)
    batched_out, batched_lse = backend.forward_ring_kv_chunk(q[None], k[None], v[None])
    torch.testing.assert_close(out, batched_out[0])
    torch.testing.assert_close(lse, batched_lse[0])
    grads = backend.backward_ring_kv_chunk(dout, q, k, v, out, lse)
    assert [tuple(g.shape) for g in grads] == [(9, 3, 16), (14, 3, 16), (14, 3, 16)]


@pytest.mark.parametrize("name", CPU_RING_BACKENDS)
def test_plain_attention_ignores_autocast(name):
    """Chunk kernels keep fp32 statistics under autocast, so their backward (run outside it) agrees."""
    backend = make_backend(name)
    q, k, v, dout = random_qkv(2, 12, 20, 2, 16, torch.bfloat16)
    results = []
    for autocast in (False, True):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = backend.forward(*inputs)
        out.backward(dout)
        results.append([out.detach(), *(t.grad for t in inputs)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_merge_stays_finite_when_nothing_was_seen():
    out = torch.zeros(1, 3, 1, 2)
    lse = torch.full((1, 1, 3), float("-inf"))
    merged, merged_lse = merge_attention_chunk(out, lse, out.clone(), lse.clone())
    assert torch.isfinite(merged).all() and (merged == 0).all() and (merged_lse == float("-inf")).all()
    chunk_out, chunk_lse = torch.ones(1, 3, 1, 2), torch.zeros(1, 1, 3)
    merged, merged_lse = merge_attention_chunk(out, lse, chunk_out, chunk_lse)
    torch.testing.assert_close(merged, chunk_out)
    torch.testing.assert_close(merged_lse, chunk_lse)


# ---- registry, capability and errors ---------------------------------------------------------------------------


class ForwardOnlyBackend(AttentionBackend):
    name = "forward_only"
    priority = 1

    def forward(self, q, k, v, *, softmax_scale=None):
        return get_attn_backend("math").forward(q, k, v, softmax_scale=softmax_scale)

    def forward_ring_kv_chunk(self, q, k, v, *, softmax_scale=None):
        return get_attn_backend("math").forward_ring_kv_chunk(q, k, v, softmax_scale=softmax_scale)


@pytest.fixture
def forward_only_registered(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, ForwardOnlyBackend.name, ForwardOnlyBackend)
    yield ForwardOnlyBackend


def test_ring_capability_is_derived_from_overrides(forward_only_registered):
    assert RING_CAPABLE_ATTENTION_BACKENDS[:1] == ("torch_flash",)
    assert set(RING_CAPABLE_ATTENTION_BACKENDS) == {"torch_flash", "flash_attn", "math"}
    assert "torch_sdpa" not in RING_CAPABLE_ATTENTION_BACKENDS
    import ringdit.attention as attention

    # computed from the registry on access: a newly registered ring-capable class shows up, in priority order
    assert attention.RING_CAPABLE_ATTENTION_BACKENDS[:2] == ("torch_flash", "forward_only")
    assert ForwardOnlyBackend.supports_ring_rotation() and not ForwardOnlyBackend.supports_ring_backward()


def test_base_class_hooks_raise_the_documented_error():
    sdpa = get_attn_backend("torch_sdpa")
    assert not sdpa.supports_ring_rotation()
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(NotImplementedError, match=r"^TorchSDPABackend does not implement ring KV-chunk attention$"):
        sdpa.forward_ring_kv_chunk(q, q, q)


def test_config_time_rejects_non_ring_backend():
    with pytest.raises(ValueError) as info:
        validate_attention_config("torch_sdpa", ring_degree=2)
    assert str(info.value) == (
        "Ring Attention requires one of the ring-capable backends (torch_flash, flash_attn, math), got 'torch_sdpa'"
    )
    assert validate_attention_config("torch_sdpa", ring_degree=1) == "torch_sdpa"


def test_config_time_picks_and_logs_a_ring_backend(caplog):
    with caplog.at_level(logging.INFO, logger="ringdit.attention.registry"):
        assert validate_attention_config(None, ring_degree=4, device_type="cpu") == "torch_flash"
    assert "attention_backend has been automatically set to torch_flash" in caplog.text


def test_config_time_refuses_training_with_forward_only_ring_backend(forward_only_registered):
    assert validate_attention_config("forward_only", ring_degree=2, training=False) == "forward_only"
    with pytest.raises(ValueError, match=r"forward_only.*forward only.*backward_ring_kv_chunk.*not train"):
        validate_attention_config("forward_only", ring_degree=2, training=True)


def test_unknown_and_unavailable_backends_list_what_exists():
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*torch_flash \(available\)"):
        validate_attention_config("flash")
    with pytest.raises(ValueError, match=r"'flash_attn' is not available on cpu.*math \(available\)"):
        validate_attention_config("flash_attn", device_type="cpu")
    assert get_attn_backend(None, device_type="cpu").name == "torch_flash"


def test_layer_construction_rejects_non_ring_backend_under_ring():
    dims = ParallelDims(ring_degree=2, ring_ranks=(0, 1))
    message = ("Ring Attention requires a backend whose kernel exposes the softmax LSE for the per-hop merge; "
               "TORCH_SDPA does not declare support (see AttentionBackend.supports_ring_rotation).")
    with pytest.raises(RuntimeError) as info:
        USPAttention(4, 16, backend="torch_sdpa", dims=dims)  # built with the mesh
    assert str(info.value) == message
    USPAttention(4, 16, backend="torch_sdpa")  # one process: fine
    USPAttention(4, 16, backend="math", dims=dims)  # ring-capable: fine


def test_register_backend_guards():
    with pytest.raises(TypeError):
        register_backend(object)
    with pytest.raises(ValueError, match="already registered"):

        class Impostor(AttentionBackend):
            name = "math"

        register_backend(Impostor)


# ---- real GPU kernels (run where CUDA is present) -----------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("name", ["torch_flash", "flash_attn"])
def test_cuda_kernels_split_contract(name, dtype, head_size):
    cls = registry.backend_class(name)
    if not cls.is_available("cuda"):
        pytest.skip(cls.unavailable_reason("cuda"))
    if dtype not in cls.dtypes:
        pytest.skip(f"{name} has no {dtype}")
    backend = get_attn_backend(name, device_type="cuda")
    q, k, v, dout = (t.cuda() for t in random_qkv(2, 100, 300, 4, head_size, dtype))
    ref_out, ref_lse, ref_grads = reference(q.cpu(), k.cpu(), v.cpu(), dout.cpu())
    out = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    lse = torch.full((2, 4, 100), float("-inf"), device="cuda")
    chunks = [slice(0, 128), slice(128, 300)]
    for c in chunks:
        out, lse = merge_attention_chunk(out, lse, *backend.forward_ring_kv_chunk(q, k[:, c], v[:, c]))
    tol_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16  # fp16 rounds finer than bf16
    assert_close(out.cpu(), ref_out, tol_dtype, what="out")
    out = out.to(dtype)
    grads = [backend.backward_ring_kv_chunk(dout, q, k[:, c], v[:, c], out, lse) for c in chunks]
    dq = sum(g[0].float() for g in grads)
    dk = torch.cat([g[1] for g in grads], 1)
    dv = torch.cat([g[2] for g in grads], 1)
    for got, ref, which in zip((dq, dk, dv), ref_grads, "qkv"):
        assert_close(got.cpu(), ref, tol_dtype, grad=True, what=f"d{which}")
