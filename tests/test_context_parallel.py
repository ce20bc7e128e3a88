"""Ring, Ulysses and USP attention on spawned CPU ranks (gloo) against the one-device fp64 reference."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from ringdit.attention import USPAttention, get_attn_backend
from ringdit.parallel import (
    all_to_all,
    check_degrees,
    gather_sequence,
    init_sequence_parallel,
    shard_sequence,
)
from tests.distributed import run_ranks

HEADS, HEAD_SIZE = 4, 16


def reference(q, k, v, dout):
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    out = get_attn_backend("math").forward(qd, kd, vd)
    out.backward(dout.double())
    return out.detach(), qd.grad, kd.grad, vd.grad


def max_errors(results, references):
    return [(r.double() - ref).abs().max().item() for r, ref in zip(results, references)]


def rms_errors(results, references):
    return [(r.double() - ref).pow(2).mean().sqrt().item() for r, ref in zip(results, references)]


BF16_UNIT_ROUNDOFF = 2.0**-8


def usp_attention_step(dims, backend_name, q, k, v, dout, length):
    """Shard the full tensors, run USPAttention forward + backward, gather output and input gradients."""
    attn = USPAttention(HEADS, HEAD_SIZE, backend=backend_name, dims=dims)
    local = [shard_sequence(t, dims=dims).detach().requires_grad_() for t in (q, k, v)]
    out = attn(*local, valid_len=length)
    out.backward(shard_sequence(dout, dims=dims))
    gathered = [gather_sequence(t, length=length, dims=dims) for t in (out.detach(), *(x.grad for x in local))]
    return gathered, local, out


LAYOUTS = [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2)]  # (ring, ulysses) on 4 ranks


def check_usp_matches_reference(rank, world):
    for ring, ulysses in LAYOUTS:  # one group of processes for all layouts: spawning dominates the test's time
        check_layout(ring, ulysses)


def check_layout(ring, ulysses):
    dims = init_sequence_parallel(ring, ulysses)
    for length in (4 * 6, 4 * 6 + 3):  # divisible by every degree, and not
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(length)  # same full tensors on every rank
            q, k, v, dout = (torch.randn(2, length, HEADS, HEAD_SIZE, generator=g).to(dtype) for _ in range(4))
            ref = reference(q, k, v, dout)
            results, local, out = usp_attention_step(dims, "torch_flash", q, k, v, dout, length)
            errors = max_errors(results, ref)
            if dtype == torch.float32:
                # against the fp64 truth, the bound of one device's fp32 kernels (tests/test_backends.py's FP32_TOL;
                # head size 16, <= 27 keys): measured at most 1e-6 (out) and 1e-6 (gradients) on every layout
                assert errors[0] <= 1e-5 and max(errors[1:]) <= 1e-4, f"{ring}x{ulysses} S={length}: {errors}"
            else:
                # Each hop's chunk result comes back from the bf16 kernel rounded once more than on one device,
                # so the typical (RMS) error may grow by about sqrt(2): allow 2x the single-device error, and
                # bound the worst element by the bf16 rounding budget of tests/test_backends.py (4u of max).
                single = rms_errors(reference_single_device(q, k, v, dout), ref)
                rms = rms_errors(results, ref)
                for err, base, worst, r, what in zip(rms, single, errors, ref, ("out", "dq", "dk", "dv")):
                    assert err <= 2 * base, f"bf16 {what}: RMS error {err:.3e} vs single-device {base:.3e}"
                    assert worst <= 4 * BF16_UNIT_ROUNDOFF * r.abs().max().item(), f"bf16 {what}: max {worst:.3e}"
            # tail padding: padded rows come back as zeros and get zero gradients
            pad_from = length - dims.sp_rank * out.shape[1]
            if pad_from < out.shape[1]:
                assert (out[:, max(pad_from, 0):] == 0).all()
                assert all((x.grad[:, max(pad_from, 0):] == 0).all() for x in local)


def reference_single_device(q, k, v, dout):
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = get_attn_backend("torch_flash").forward(qs, ks, vs)
    out.backward(dout)
    return out.detach(), qs.grad, ks.grad, vs.grad


def test_usp_attention_equals_single_device():
    """Every layout of LAYOUTS, fp32 and bf16, a length every degree divides and one none does, batch 2."""
    run_ranks(check_usp_matches_reference, 4)


def check_math_backend_ring_in_fp64(rank, world):
    """With the math backend in fp64 the ring is exact to rounding: no hidden precision loss anywhere."""
    dims = init_sequence_parallel(world, 1)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(3, 21, HEADS, HEAD_SIZE, generator=g, dtype=torch.float64) for _ in range(4))
    results, _, _ = usp_attention_step(dims, "math", q, k, v, dout, 21)
    assert max(max_errors(results, reference(q, k, v, dout))) < 1e-12
    # under autocast (bf16 mixed precision) the ring keeps its statistics in fp32: the same numbers as without it
    bf16 = [t.bfloat16() for t in (q, k, v, dout)]
    plain, _, _ = usp_attention_step(dims, "math", *bf16, 21)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, _, _ = usp_attention_step(dims, "math", *bf16, 21)
    for a, b in zip(plain, mixed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_ring_with_math_backend_is_exact_in_fp64():
    run_ranks(check_math_backend_ring_in_fp64, 3)


def check_point_to_point_count(rank, world):
    dims = init_sequence_parallel(world, 1)
    transfers = []
    real_batch = dist.batch_isend_irecv

    def counting_batch(ops):
        transfers.append(len(ops))
        return real_batch(ops)

    def forbidden(*args, **kwargs):
        raise AssertionError("ring attention must not use collectives")

    dist.batch_isend_irecv = counting_batch
    for name in ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "all_to_all_single"):
        setattr(dist, name, forbidden)
    attn = USPAttention(HEADS, HEAD_SIZE, backend="torch_flash", dims=dims)
    x = torch.randn(1, 8, HEADS, HEAD_SIZE, requires_grad=True)
    out = attn(x, x, x)
    assert sum(transfers) == 2 * (world - 1), transfers  # one send + one receive per hop, K and V stacked
    out.sum().backward()  # backward: N-1 K/V hops plus N dK/dV hops, each a send and a receive
    assert sum(transfers) == 2 * (world - 1) + 2 * (world - 1) + 2 * world


def test_ring_forward_sends_only_its_kv_hops():
    run_ranks(check_point_to_point_count, 4)


def check_collective_autograd(rank, world):
    """shard/gather/all_to_all against their definitions, including the backward of each (objective = sum over
    ranks of each rank's loss)."""
    dims = init_sequence_parallel(world, 1)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 10, 4, 3, generator=g, dtype=torch.float64)  # 10 tokens over 4 ranks: padded to 12
    weights = [torch.randn(2, 10, 4, 3, generator=g, dtype=torch.float64) for _ in range(world)]

    x = full.clone().requires_grad_()
    local = shard_sequence(x, dims=dims)
    assert local.shape == (2, 3, 4, 3)
    torch.testing.assert_close(gather_sequence(local, length=10, dims=dims), full)
    (shard_sequence(weights[rank], dims=dims) * local).sum().backward()
    expected = torch.zeros_like(full)
    span = slice(3 * rank, min(3 * rank + 3, 10))
    expected[:, span] = weights[rank][:, span]
    torch.testing.assert_close(x.grad, expected)

    local = shard_sequence(full, dims=dims).requires_grad_()
    (gather_sequence(local, length=10, dims=dims) * weights[rank]).sum().backward()
    torch.testing.assert_close(local.grad, shard_sequence(sum(weights), dims=dims))

    group = dims.sp_group
    local = shard_sequence(full[:, :8], dims=dims).requires_grad_()  # (2, 2, 4, 3)
    heads = all_to_all(local, group, scatter_dim=2, gather_dim=1)  # (2, 8, 1, 3)
    torch.testing.assert_close(heads, full[:, :8, rank : rank + 1])
    heads.backward(weights[0][:, :8, rank : rank + 1])
    torch.testing.assert_close(local.grad, shard_sequence(weights[0][:, :8], dims=dims))


def test_collectives_autograd():
    run_ranks(check_collective_autograd, 4)


def check_mesh_layout(rank, world):
    """The DeviceMesh keeps the documented layout (ringdit.parallel.mesh): rank = dp_rank * sp + sp_rank, sp_rank = ring_rank * U + ulysses_rank,
    and the CFG pairs are dp replicas 2j, 2j + 1 at equal sp_rank."""
    for dp, ring, ulysses in [(1, 2, 2), (2, 2, 1), (2, 1, 2), (4, 1, 1)]:
        dims = init_sequence_parallel(ring, ulysses, cfg_parallel=dp % 2 == 0)
        sp = ring * ulysses
        assert dims.mesh.mesh_dim_names == ("dp", "ring", "ulysses") and dims.mesh.shape == (dp, ring, ulysses)
        assert (dims.dp_degree, dims.ring_degree, dims.ulysses_degree) == (dp, ring, ulysses)
        assert rank == dims.dp_rank * sp + dims.sp_rank and dims.sp_rank == dims.ring_rank * ulysses + dims.ulysses_rank
        base, u = dims.dp_rank * sp, dims.ulysses_rank
        expected = {"sp_group": [base + s for s in range(sp)],
                    "ring_group": [base + r * ulysses + u for r in range(ring)],
                    "ulysses_group": [base + dims.ring_rank * ulysses + v for v in range(ulysses)],
                    "cfg_group": sorted({(dims.dp_rank // 2 * 2 + h) * sp + dims.sp_rank for h in (0, 1)})
                    if dp % 2 == 0 else [rank]}
        for name, ranks in expected.items():
            group = getattr(dims, name)
            assert (dist.get_process_group_ranks(group) if group is not None else [rank]) == ranks, (name, dp, ring)
        assert list(dims.ring_ranks) == expected["ring_group"]
        assert dims.cfg_rank == (dims.dp_rank % 2 if dp % 2 == 0 else 0)


def test_mesh_keeps_the_documented_rank_layout():
    run_ranks(check_mesh_layout, 4)


def check_layout_errors(rank, world):
    dims = init_sequence_parallel(1, 4)
    USPAttention(6, 16, dims=dims)  # a degree that does not divide the heads splits them 2 + 2 + 1 + 1
    with pytest.raises(ValueError, match=r"ulysses_degree=4 is more than the model's num_heads=3: .* use "
                                         r"ulysses_degree=2 with ring_degree multiplied by 2 \(the same ranks\)"):
        USPAttention(3, 16, dims=dims)  # built with the mesh


def test_layout_errors_name_values_and_fixes():
    run_ranks(check_layout_errors, 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_degrees_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match=rf"ring_degree must be a positive integer, got {bad!r}"):
        check_degrees(bad, 1)


def test_degrees_must_divide_the_world_size():
    with pytest.raises(ValueError, match=r"world size 4 .* not divisible by ring_degree x ulysses_degree = 3 x 1 = 3"):
        check_degrees(3, 1, 4)


def check_silent_rank(rank, world):
    """Rank 1 is alive but never joins the ring step (hung, or stuck elsewhere): rank 0 must fail, not wait."""
    dims = init_sequence_parallel(world, 1, timeout=datetime.timedelta(seconds=1))
    if rank == 1:
        time.sleep(4)
        return
    attn = USPAttention(HEADS, HEAD_SIZE, dims=dims)
    x = torch.randn(1, 4, HEADS, HEAD_SIZE)
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        attn(x, x, x)
    assert time.monotonic() - start < 3.5


def test_silent_rank_ends_the_ring_with_an_error_not_a_hang():
    run_ranks(check_silent_rank, 2)
