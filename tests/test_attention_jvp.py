"""Forward mode (``torch.func.jvp``, ``torch.autograd.forward_ad``) through ring, Ulysses and USP attention, and
through whole models under the parallel plan, against ``torch.func.jvp`` of the unsharded fp64 computation.

Tolerance: 1e-12 of the largest value, in fp64 (unit roundoff 1.1e-16). The sharded tangent is the same math in
another order: the ring adds per-block shares over <= 32 keys, and the rule's ``sum(P dv + P*dS v) - rowsum(P*dS)
out`` is the reference's softmax-JVP regrouped; measured at most 1.5e-15 of max on every case here. A hop lost or counted
twice, a wrong log-sum-exp weight, a padded or masked key that gets weight, or a missing tangent (dk, dv not
rotated) is off by O(1e-2) or more of max.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import ringdit.attention as attention
from ringdit.attention import (
    AttentionBackend,
    Stream,
    TokenLayout,
    USPAttention,
    get_attn_backend,
    validate_attention_config,
)
from ringdit.attention.backend import chunk_kernel_attention
from ringdit.parallel import gather_sequence, init_sequence_parallel, shard_sequence
from ringdit.parallel.collectives import chunk_length
from tests.distributed import run_ranks
from tests.helpers import architecture, tiny_dit

HEADS, HEAD_SIZE = 4, 16
TOL = 1e-12  # of the largest value: see the module docstring
LAYOUTS = [(2, 1), (4, 1), (1, 2), (2, 2)]  # (ring, ulysses) on 4 ranks


def assert_close_of_max(actual, expected, what):
    error = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert error <= TOL * scale, f"{what}: max error {error:.3e} vs {TOL:.0e} of max {scale:.3e}"


def reference_attention(q, k, v, key_mask=None):
    """Unsharded fp64 attention written out (masked keys at -inf), independent of ringdit's kernels."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def random_tensors(count, shape, seed):
    g = torch.Generator().manual_seed(seed)  # the same full tensors on every rank
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(count)]


# ---- one sequence, tail-padded -------------------------------------------------------------------------------------


def check_sequence_layouts(rank, world):
    for ring, ulysses in LAYOUTS:
        dims = init_sequence_parallel(ring, ulysses)
        for length in (24, 23):  # every degree divides 24; 23 is padded at the tail
            primals_tangents = random_tensors(6, (2, length, HEADS, HEAD_SIZE), seed=length)
            primals, tangents = primals_tangents[:3], primals_tangents[3:]
            ref_out, ref_tangent = torch.func.jvp(reference_attention, tuple(primals), tuple(tangents))
            for backend in attention.FORWARD_AD_ATTENTION_BACKENDS:
                attn = USPAttention(HEADS, HEAD_SIZE, backend=backend, dims=dims)
                local = tuple(shard_sequence(t, dims=dims) for t in primals + tangents)
                out, tangent = torch.func.jvp(lambda q, k, v: attn(q, k, v, valid_len=length), local[:3], local[3:])
                what = f"{backend} ring {ring} x ulysses {ulysses}, {length} tokens"
                assert_close_of_max(gather_sequence(out, length=length, dims=dims), ref_out, f"out, {what}")
                assert_close_of_max(gather_sequence(tangent, length=length, dims=dims), ref_tangent,
                                    f"tangent, {what}")
                pad_from = length - dims.sp_rank * out.shape[1]  # padded rows: zero output, zero tangent
                if pad_from < out.shape[1]:
                    assert (tangent[:, max(pad_from, 0):] == 0).all()
        # torch.autograd.forward_ad's dual tensors take the same rule
        primals_tangents = random_tensors(6, (2, 24, HEADS, HEAD_SIZE), seed=7)
        _, ref_tangent = torch.func.jvp(reference_attention, tuple(primals_tangents[:3]), tuple(primals_tangents[3:]))
        local = [shard_sequence(t, dims=dims) for t in primals_tangents]
        attn = USPAttention(HEADS, HEAD_SIZE, backend="torch_flash", dims=dims)
        with fwAD.dual_level():
            out = attn(*(fwAD.make_dual(p, t) for p, t in zip(local[:3], local[3:])))
            tangent = fwAD.unpack_dual(out).tangent
        assert_close_of_max(gather_sequence(tangent, dims=dims), ref_tangent, f"forward_ad, ring {ring} x {ulysses}")
        # a tangent on the queries only (k and v constants: the rule gets None for theirs)
        q, k, v, dq = primals_tangents[:4]
        _, ref_tangent = torch.func.jvp(lambda q: reference_attention(q, k, v), (q,), (dq,))
        _, tangent = torch.func.jvp(lambda q: attn(q, local[1], local[2]), (local[0],), (local[3],))
        assert_close_of_max(gather_sequence(tangent, dims=dims), ref_tangent, f"dq only, ring {ring} x {ulysses}")


def test_usp_attention_jvp_equals_unsharded_on_every_layout():
    """Ring 2, ring 4, Ulysses 2, ring 2 x Ulysses 2; math and torch_flash; a padded length; torch.func.jvp and
    forward_ad's dual tensors."""
    run_ranks(check_sequence_layouts, 4)


def test_one_process_jvp_equals_unsharded():
    primals_tangents = random_tensors(6, (2, 64, HEADS, HEAD_SIZE), seed=3)
    ref = torch.func.jvp(reference_attention, tuple(primals_tangents[:3]), tuple(primals_tangents[3:]))
    for backend in attention.FORWARD_AD_ATTENTION_BACKENDS:
        attn = USPAttention(HEADS, HEAD_SIZE, backend=backend)
        out = torch.func.jvp(attn, tuple(primals_tangents[:3]), tuple(primals_tangents[3:]))
        for a, b, what in zip(out, ref, ("out", "tangent")):
            assert_close_of_max(a, b, f"{backend} {what}")
        # fp32, as models run: unit roundoff 6e-8, sums over 64 keys and 16 head dims; measured at most 4e-7 of
        # max for the output and the tangent on both backends, so 1e-5 of max leaves 25x headroom
        out32 = torch.func.jvp(attn, tuple(t.float() for t in primals_tangents[:3]),
                               tuple(t.float() for t in primals_tangents[3:]))
        for a, b, what in zip(out32, ref, ("out", "tangent")):
            error = (a.double() - b).abs().max().item()
            assert error <= 1e-5 * b.abs().max().item(), f"{backend} fp32 {what}: {error:.3e}"


def test_jvp_keeps_the_forward_and_backward_unchanged():
    """The fused kernel's forward and backward are the same bits with or without the forward-mode rule around."""
    q, k, v, dq, dk, dv = random_tensors(6, (2, 9, HEADS, HEAD_SIZE), seed=5)
    backend = get_attn_backend("torch_flash")
    out, _ = torch.func.jvp(lambda q, k, v: backend.forward(q, k, v), (q, k, v), (dq, dk, dv))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt)[0].transpose(1, 2)
    assert torch.equal(out, kernel)


def test_the_primal_of_a_jvp_keeps_its_backward_and_the_tangent_is_a_constant():
    """What sCM / rCM take: the tangent under a stop-gradient, the output trained through."""
    q, k, v, dq = random_tensors(4, (2, 9, HEADS, HEAD_SIZE), seed=6)
    reference = q.clone().requires_grad_()
    reference_attention(reference, k, v).sum().backward()
    for backend in attention.FORWARD_AD_ATTENTION_BACKENDS:
        attn = USPAttention(HEADS, HEAD_SIZE, backend=backend)
        leaf = q.clone().requires_grad_()
        out, tangent = torch.func.jvp(lambda q: attn(q, k, v), (leaf,), (dq,))
        if backend != "math":  # math's local path is torch's own ops: its tangent is differentiable, as torch makes it
            assert not tangent.requires_grad
        out.sum().backward()
        assert_close_of_max(leaf.grad, reference.grad, f"{backend} gradient through the JVP's output")


def test_the_chunk_rule_in_query_tiles(monkeypatch):
    """Long blocks run the chunk rule a tile of query rows at a time: tiles of 4 rows (the last one short) give the
    tangent of the whole block."""
    from ringdit.attention.backend import attention_tangent
    from ringdit.attention.backends import math_backend

    q, k, v, dq, dk, dv = random_tensors(6, (2, 10, HEADS, HEAD_SIZE), seed=8)
    out, ref_tangent = torch.func.jvp(reference_attention, (q, k, v), (dq, dk, dv))
    _, lse = get_attn_backend("math").forward_ring_kv_chunk(q, k, v)
    monkeypatch.setattr(math_backend, "_TANGENT_TILE_ELEMENTS", 1)
    monkeypatch.setattr(math_backend, "_TANGENT_MIN_ROWS", 4)
    tangent = attention_tangent(*math_backend.chunk_tangent(q, k, v, dq, dk, dv, lse, HEAD_SIZE**-0.5), out)
    assert_close_of_max(tangent, ref_tangent, "tangent in tiles of 4 query rows")


# ---- joint text-image attention with masked text -------------------------------------------------------------------

TEXT, IMAGE = 5, 19  # neither divides the degrees: both streams padded


def text_mask(batch):
    """Per sample: all real, right-padded, none real, scattered."""
    patterns = [[True] * TEXT, [True, True] + [False] * (TEXT - 2), [False] * TEXT, [i % 2 == 1 for i in range(TEXT)]]
    return torch.tensor([patterns[b % 4] for b in range(batch)])


def shard_joint(t, dims):
    return torch.cat([shard_sequence(t[:, :TEXT], dims=dims), shard_sequence(t[:, TEXT:], dims=dims)], dim=1)


def unshard_joint(t, dims):
    text_chunk = chunk_length(TEXT, dims.sp_degree)
    return torch.cat([gather_sequence(t[:, :text_chunk], length=TEXT, dims=dims),
                      gather_sequence(t[:, text_chunk:], length=IMAGE, dims=dims)], dim=1)


def check_joint_layouts(rank, world):
    batch = 4
    mask = text_mask(batch)
    key_mask = torch.cat([mask, torch.ones(batch, IMAGE, dtype=torch.bool)], dim=1)
    primals_tangents = random_tensors(6, (batch, TEXT + IMAGE, HEADS, HEAD_SIZE), seed=11)
    ref_out, ref_tangent = torch.func.jvp(lambda q, k, v: reference_attention(q, k, v, key_mask),
                                          tuple(primals_tangents[:3]), tuple(primals_tangents[3:]))
    for ring, ulysses in LAYOUTS:
        dims = init_sequence_parallel(ring, ulysses)
        layout = TokenLayout([Stream(TEXT, chunk_length(TEXT, dims.sp_degree), mask),
                              Stream(IMAGE, chunk_length(IMAGE, dims.sp_degree))])
        local = [shard_joint(t, dims) for t in primals_tangents]
        for backend in attention.FORWARD_AD_ATTENTION_BACKENDS:
            attn = USPAttention(HEADS, HEAD_SIZE, backend=backend, dims=dims)
            out, tangent = torch.func.jvp(lambda q, k, v: attn(q, k, v, layout=layout), tuple(local[:3]),
                                          tuple(local[3:]))
            what = f"joint, {backend} ring {ring} x ulysses {ulysses}"
            assert_close_of_max(unshard_joint(out, dims), ref_out, f"out, {what}")
            assert_close_of_max(unshard_joint(tangent, dims), ref_tangent, f"tangent, {what}")


def test_joint_attention_jvp_with_masked_text_equals_unsharded():
    run_ranks(check_joint_layouts, 4)


# ---- whole models under the plan -----------------------------------------------------------------------------------


def check_dit_under_plan(rank, world):
    from ringdit.models import parallelize

    g = torch.Generator().manual_seed(1)
    for ring, ulysses, spatial in ((2, 1, (10, 6)), (4, 1, (8, 8)), (2, 2, (6, 10))):  # 15, 16 and 15 tokens
        model = tiny_dit().double()
        x, dx = (torch.randn(2, 3, *spatial, generator=g, dtype=torch.float64) for _ in range(2))
        t, dt = torch.tensor([37.0, 912.0], dtype=torch.float64), torch.tensor([1.0, -2.0], dtype=torch.float64)
        y, drop = torch.tensor([3, 7]), torch.tensor([False, True])
        reference = parallelize(copy.deepcopy(model), backend="math")  # one device; torch's own derivatives
        ref_out, ref_tangent = torch.func.jvp(lambda x, t: reference(x, t, y, drop), (x, t), (dx, dt))
        parallelize(model, model.parallel_plan, init_sequence_parallel(ring, ulysses), backend="torch_flash")
        out, tangent = torch.func.jvp(lambda x, t: model(x, t, y, drop), (x, t), (dx, dt))
        assert_close_of_max(out, ref_out, f"DiT out, ring {ring} x ulysses {ulysses}")
        assert_close_of_max(tangent, ref_tangent, f"DiT tangent, ring {ring} x ulysses {ulysses}")


def test_dit_jvp_under_the_plan_equals_unsharded():
    """The JVP in the input and the time, through shard / ring / all-to-all / gather, as sCM takes it."""
    run_ranks(check_dit_under_plan, 4)


def diffusers_case(family, dims):
    """A tiny Wan or Flux transformer in fp64 (the unsharded copy first), its call with inputs and input tangents."""
    from ringdit.models import parallelize
    from ringdit.models.diffusers import DiffusersTransformer

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    if family == "wan":
        shape = (3, 6, 6)  # 27 tokens after patching: padded on every layout
        model = DiffusersTransformer("wan", config=architecture("wan_tiny"), input_size=shape, in_channels=4,
                                     text_len=7, text_dim=16).double()
        x, dx, cond = rand(2, 4, *shape), rand(2, 4, *shape), {"text": rand(2, 7, 16)}
    else:
        shape = (6, 10)
        model = DiffusersTransformer("flux", config={**architecture("flux_tiny"), "guidance_embeds": False},
                                     input_size=shape, in_channels=1, text_len=5, text_dim=32, pooled_dim=32).double()
        x, dx, cond = rand(2, 1, *shape), rand(2, 1, *shape), {"text": rand(2, 5, 32), "pooled": rand(2, 32)}
    reference = copy.deepcopy(model)
    parallelize(reference, backend="math")  # one process; its attention's JVP: torch's own derivative formulas
    parallelize(model, dims=dims, backend="torch_flash")
    t, dt = torch.tensor([30.0, 810.0], dtype=torch.float64), torch.tensor([1.0, 0.5], dtype=torch.float64)
    return reference, model, (x, t), (dx, dt), cond


def check_diffusers_under_plan(rank, world):
    for family in ("wan", "flux"):
        for ring, ulysses in ((2, 1), (2, 2)):
            dims = init_sequence_parallel(ring, ulysses)
            reference, model, primals, tangents, cond = diffusers_case(family, dims)
            ref_out, ref_tangent = torch.func.jvp(lambda x, t: reference(x, t, cond), primals, tangents)
            out, tangent = torch.func.jvp(lambda x, t: model(x, t, cond), primals, tangents)
            assert_close_of_max(out, ref_out, f"{family} out, ring {ring} x ulysses {ulysses}")
            assert_close_of_max(tangent, ref_tangent, f"{family} tangent, ring {ring} x ulysses {ulysses}")


def test_wan_and_flux_jvp_under_the_plan_equal_unsharded():
    run_ranks(check_diffusers_under_plan, 4)


# ---- backends without a forward-mode rule --------------------------------------------------------------------------


class LseOnlyBackend(AttentionBackend):
    """A ring-capable kernel (it returns the LSE) without a forward-mode rule, as flash_attn is."""

    name = "lse_only_for_test"

    def forward(self, q, k, v, *, softmax_scale=None):
        return chunk_kernel_attention(self, q, k, v, softmax_scale)

    def forward_ring_kv_chunk(self, q, k, v, *, softmax_scale=None):
        return get_attn_backend("torch_flash").forward_ring_kv_chunk(q, k, v, softmax_scale=softmax_scale)


def test_forward_ad_capability_is_derived_from_the_classes():
    assert attention.FORWARD_AD_ATTENTION_BACKENDS == ("torch_flash", "math")
    assert not attention.TorchSDPABackend.supports_forward_ad()  # no LSE, no rule
    assert not attention.FlashAttnBackend.supports_forward_ad()  # LSE, but no jvp_ring_kv_chunk
    assert LseOnlyBackend.supports_ring_rotation() and not LseOnlyBackend.supports_forward_ad()


@pytest.mark.parametrize("backend", ["torch_sdpa", "flash_attn"])
def test_a_backend_without_forward_mode_is_refused_in_one_line(backend):
    with pytest.raises(ValueError) as refusal:
        validate_attention_config(backend, forward_ad=True, device_type="cpu")
    message = str(refusal.value)
    assert "\n" not in message
    assert message == (f"attention_backend={backend!r} has no forward-mode (JVP) rule (no jvp_ring_kv_chunk), so "
                       "torch.func.jvp cannot run through it; use attention_backend= one of (torch_flash, math)")
    # the advice works: the backend it names passes, on a ring too, and one is chosen when none is named
    assert validate_attention_config("torch_flash", forward_ad=True, ring_degree=2, device_type="cpu") == "torch_flash"
    assert validate_attention_config(None, forward_ad=True, ring_degree=2, device_type="cpu") == "torch_flash"


def test_a_jvp_through_a_backend_without_the_rule_says_so_in_one_line():
    q, k, v = random_tensors(3, (1, 6, HEADS, HEAD_SIZE), seed=0)
    backend = LseOnlyBackend()
    backend.forward(q, k, v)  # the forward itself runs
    with pytest.raises(RuntimeError, match=r"^attention backend 'lse_only_for_test' has no forward-mode \(JVP\) rule "
                                           r"\(it does not implement jvp_ring_kv_chunk\), .*use attention_backend= "
                                           r"one of \(torch_flash, math\)$"):
        torch.func.jvp(lambda q: backend.forward(q, k, v), (q,), (q,))
