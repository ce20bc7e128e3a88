"""Ulysses over a head count its degree does not divide (7 heads over 2 and 4 ranks, 8 over 3, USP ring 2 x Ulysses 2
with 7 and 3 heads): the heads split unevenly (``ringdit.parallel.heads``), and attention -- plain, tail-padded,
joint with masked text -- and whole models (the DiT, QwenImage) stay exact against one process in float64,
forward, backward and forward mode. A degree above the head count is refused with degrees that work."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist

from ringdit.attention import Stream, TokenLayout, USPAttention, get_attn_backend
from ringdit.models import parallelize
from ringdit.parallel import (
    ParallelDims,
    all_to_all,
    check_heads_placeable,
    gather_sequence,
    head_counts,
    head_imbalance,
    init_sequence_parallel,
    shard_sequence,
)
from ringdit.parallel.collectives import chunk_length
from tests.distributed import run_ranks
from tests.helpers import architecture, assert_same_numbers, tiny_dit

HEAD_SIZE = 8
# fp64: a layout only reorders the sums (other GEMM shapes, the ring's merges, the per-rank head blocks), ~1e-15 of
# a tensor's max; 1e-12 of max (the bound) is 10^3 above that and far below a head or token lost or doubled.
EXACT = 1e-12


# ---- the placement, one process -------------------------------------------------------------------------------


def test_head_counts_split_every_head_once_and_count_the_imbalance():
    assert head_counts(56, 16) == (4,) * 8 + (3,) * 8 and head_counts(24, 5) == (5, 5, 5, 5, 4)
    assert head_counts(7, 2) == (4, 3) and head_counts(7, 4) == (2, 2, 2, 1) and head_counts(8, 3) == (3, 3, 2)
    assert head_counts(40, 8) == (5,) * 8
    assert head_imbalance(40, 8) == 1.0 and head_imbalance(56, 8) == 1.0
    assert head_imbalance(56, 16) == pytest.approx(8 / 7) and head_imbalance(24, 5) == pytest.approx(25 / 24)
    assert head_imbalance(7, 2) == pytest.approx(8 / 7) and head_imbalance(7, 7) == 1.0


@pytest.mark.parametrize(("heads", "ulysses", "ring", "advice"),
                         [(3, 4, 1, (2, 2)), (2, 4, 1, (2, 2)), (4, 8, 2, (4, 4)), (5, 7, 1, (1, 7))])
def test_a_degree_above_the_heads_is_refused_with_degrees_that_work(heads, ulysses, ring, advice):
    """More Ulysses ranks than heads would leave ranks with none: one line naming both values; its advice (same
    ranks, the rest of the degree on the ring) builds the layer."""
    with pytest.raises(ValueError, match=rf"^ulysses_degree={ulysses} is more than the model's num_heads={heads}: "
                                         rf".* use ulysses_degree=\d+ with ring_degree multiplied by \d+ \(the same "
                                         rf"ranks\)") as error:
        USPAttention(heads, HEAD_SIZE, dims=ParallelDims(ring_degree=ring, ulysses_degree=ulysses))
    fit, factor = map(int, re.search(r"use ulysses_degree=(\d+) with ring_degree multiplied by (\d+)",
                                     str(error.value)).groups())
    new_ring = ring * factor
    assert (fit, new_ring) == advice and fit * new_ring == ulysses * ring
    USPAttention(heads, HEAD_SIZE, dims=ParallelDims(ring_degree=new_ring, ulysses_degree=fit))
    check_heads_placeable(heads, heads)  # the other way out: any degree up to the heads
    assert "\n" not in str(error.value)


# ---- attention on CPU ranks -----------------------------------------------------------------------------------


def random_tensors(batch, length, heads, seed):
    g = torch.Generator().manual_seed(seed)  # the same full tensors on every rank
    return [torch.randn(batch, length, heads, HEAD_SIZE, generator=g, dtype=torch.float64) for _ in range(4)]


def reference(q, k, v, dout, key_mask=None):
    """One device, fp64, written out: softmax over every (unmasked) key; ``key_mask`` (B, keys) True on real keys."""
    qd, kd, vd = (t.detach().clone().requires_grad_() for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * HEAD_SIZE**-0.5
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vd)
    out.backward(dout)
    return out.detach(), qd.grad, kd.grad, vd.grad


def check_sequence(dims, heads, backend, length=27, batch=2):
    """Tail-padded self-attention (27 tokens pad on every degree here): output and gradients of q, k, v gathered,
    padded rows zero; the head shard each rank attends over is its ``head_counts`` share."""
    q, k, v, dout = random_tensors(batch, length, heads, seed=heads * 10 + length)
    attn = USPAttention(heads, HEAD_SIZE, backend=backend, dims=dims)
    local = [shard_sequence(t, dims=dims).detach().requires_grad_() for t in (q, k, v)]
    if dims.ulysses_degree > 1:
        held = attn._sequence_to_heads(*local, dims)[0]
        assert held.shape[2] == head_counts(heads, dims.ulysses_degree)[dims.ulysses_rank]
        assert held.shape[1] == dims.ulysses_degree * local[0].shape[1]
    out = attn(*local, valid_len=length)
    out.backward(shard_sequence(dout, dims=dims))
    label = f"ring {dims.ring_degree} x ulysses {dims.ulysses_degree}, {heads} heads, {backend}"
    for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in local)), reference(q, k, v, dout)):
        assert_same_numbers(gather_sequence(got.detach(), length=length, dims=dims), want, of_max=EXACT,
                            where=f"{label} {what}")
    padded = max(length - dims.sp_rank * out.shape[1], 0)
    assert all((t[:, padded:] == 0).all() for t in (out, *(x.grad for x in local))), label


def check_jvp(dims, heads, length=27):
    """Forward mode through the uneven exchange: the tangent of the output equals the one-device tangent."""
    q, k, v, dq = random_tensors(2, length, heads, seed=heads)
    dk, dv = (t.flip(1) for t in (q, v))

    def attention(q, k, v):
        return get_attn_backend("math").forward(q, k, v)

    ref_out, ref_tangent = torch.func.jvp(attention, (q, k, v), (dq, dk, dv))
    attn = USPAttention(heads, HEAD_SIZE, backend="math", dims=dims)
    local = [shard_sequence(t, dims=dims) for t in (q, k, v, dq, dk, dv)]
    primals = tuple(t.requires_grad_() for t in local[:3])  # as in a model with trainable weights: grad mode on
    out, tangent = torch.func.jvp(lambda q, k, v: attn(q, k, v, valid_len=length), primals, tuple(local[3:]))
    label = f"jvp ring {dims.ring_degree} x ulysses {dims.ulysses_degree}, {heads} heads"
    assert_same_numbers(gather_sequence(out.detach(), length=length, dims=dims), ref_out, of_max=EXACT, where=label)
    assert_same_numbers(gather_sequence(tangent, length=length, dims=dims), ref_tangent, of_max=EXACT, where=label)


TEXT, IMAGE = 5, 13  # neither divides any degree here: both streams pad


def shard_joint(t, dims):
    return torch.cat([shard_sequence(t[:, :TEXT], dims=dims), shard_sequence(t[:, TEXT:], dims=dims)], dim=1)


def unshard_joint(t, dims):
    text_chunk = chunk_length(TEXT, dims.sp_degree)
    text = gather_sequence(t[:, :text_chunk], length=TEXT, dims=dims)
    return torch.cat([text, gather_sequence(t[:, text_chunk:], length=IMAGE, dims=dims)], dim=1)


def check_joint(dims, heads):
    """Joint ``[text ; image]`` attention with the text sharded like the image and masked per sample (all real, a
    padded prompt, none real): every rank's chunk is ``[its text shard ; its image shard]``."""
    q, k, v, dout = random_tensors(3, TEXT + IMAGE, heads, seed=heads + 1)
    mask = torch.tensor([[True] * TEXT, [True, True, False, False, False], [False] * TEXT])
    key_mask = torch.cat([mask, torch.ones(3, IMAGE, dtype=torch.bool)], dim=1)
    layout = TokenLayout([Stream(TEXT, chunk_length(TEXT, dims.sp_degree), mask),
                          Stream(IMAGE, chunk_length(IMAGE, dims.sp_degree))])
    local = [shard_joint(t, dims).requires_grad_() for t in (q, k, v)]
    out = USPAttention(heads, HEAD_SIZE, backend="math", dims=dims)(*local, layout=layout)
    out.backward(shard_joint(dout, dims))
    label = f"joint ring {dims.ring_degree} x ulysses {dims.ulysses_degree}, {heads} heads"
    for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in local)),
                               reference(q, k, v, dout, key_mask)):
        assert_same_numbers(unshard_joint(got.detach(), dims), want, of_max=EXACT, where=f"{label} {what}")


# ---- whole models on CPU ranks --------------------------------------------------------------------------------


def all_reduced_mean(grads: dict, world: int) -> dict:
    """DDP's gradient: the mean over every rank, sequence-parallel ranks included (each computed the whole loss)."""
    for grad in (g for g in grads.values() if g is not None):
        dist.all_reduce(grad)
        grad /= world
    return grads


def forward_backward(call, model, dout):
    model.zero_grad()
    out = call()
    (out * dout).sum().backward()
    return out.detach(), {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def check_dit(dims, world, heads):
    """A 2-block DiT of ``heads`` heads (8 values each), 15 tokens: output and every parameter gradient."""
    model = tiny_dit(hidden_size=heads * HEAD_SIZE, num_heads=heads, input_size=(10, 6)).double()
    reference_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(heads)
    x, dout = torch.randn(2, 3, 10, 6, generator=g, dtype=torch.float64), None
    t, y, drop = torch.tensor([37.0, 912.0]), torch.tensor([3, 7]), torch.tensor([False, True])
    dout = torch.randn(2, 6, 10, 6, generator=g, dtype=torch.float64)
    ref_out, ref_grads = forward_backward(lambda: reference_model(x, t, y, drop), reference_model, dout)
    parallelize(model, dims=dims, backend="math")
    out, grads = forward_backward(lambda: model(x, t, y, drop), model, dout)
    label = f"DiT ring {dims.ring_degree} x ulysses {dims.ulysses_degree}, {heads} heads"
    assert_same_numbers(out, ref_out, of_max=EXACT, where=f"{label} output")
    assert_same_numbers(all_reduced_mean(grads, world), ref_grads, of_max=EXACT, where=f"{label} gradient")


def check_qwenimage(dims, world, heads):
    """QwenImage (joint text-image attention, a padded prompt's text keys masked) with ``heads`` heads against the
    unmodified diffusers model, 3 x 5 image tokens and 5 text tokens (both padded), float64."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer
    from ringdit.models.diffusers.packing import pack_latents, unpack_latents

    config, shape = {**architecture("qwenimage_tiny"), "num_attention_heads": heads}, (6, 10)
    torch.manual_seed(0)
    reference_model = diffusers.QwenImageTransformer2DModel.from_config(config).double()
    model = DiffusersTransformer("qwenimage", config=config, input_size=shape, in_channels=4, text_len=TEXT,
                                 text_dim=16)
    model.transformer.load_state_dict(reference_model.state_dict())
    model.double()
    parallelize(model, dims=dims)
    g = torch.Generator().manual_seed(1)
    x, dout = (torch.randn(2, 4, *shape, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.tensor([[True] * TEXT, [True, True, True, False, False]])  # the second prompt padded
    text = torch.randn(2, TEXT, 16, generator=g, dtype=torch.float64) * mask[..., None]
    t = torch.tensor([30.0, 810.0], dtype=torch.float64)

    def run_reference():
        out = reference_model(hidden_states=pack_latents(x), encoder_hidden_states=text,
                              encoder_hidden_states_mask=mask, timestep=t / 1000,
                              img_shapes=[[(1, shape[0] // 2, shape[1] // 2)]] * 2, return_dict=False)[0]
        return unpack_latents(out, *shape)

    ref_out, ref_grads = forward_backward(run_reference, reference_model, dout)
    out, grads = forward_backward(lambda: model(x, t, {"text": text, "text_mask": mask}), model.transformer, dout)
    label = f"QwenImage ring {dims.ring_degree} x ulysses {dims.ulysses_degree}, {heads} heads"
    assert_same_numbers(out, ref_out, of_max=EXACT, where=f"{label} output")
    assert_same_numbers(all_reduced_mean(grads, world), ref_grads, of_max=EXACT, where=f"{label} gradient")


# ---- the runs: one group of processes each (spawning dominates a short test's time) ------------------------------


def check_all_to_all_uneven(rank, world):
    """The exchange itself: rank r's sequence chunk of head h holds 100 h + r; after it each rank holds its heads
    for every chunk, and the reverse exchange (the backward) restores the input."""
    dims = init_sequence_parallel(1, world)
    counts = head_counts(7, world)
    x = (torch.arange(7, dtype=torch.float64) * 100 + rank).expand(2, 3, 7).clone()  # (B, S_local, H)
    x.requires_grad_()
    heads = all_to_all(x, dims.ulysses_group, scatter_dim=2, gather_dim=1, scatter_sizes=counts)
    first = sum(counts[:rank])
    expected = torch.stack([torch.arange(first, first + counts[rank]) * 100.0 + r for r in range(world)])
    assert torch.equal(heads[0], expected.double().repeat_interleave(3, dim=0)), heads[0]
    back = all_to_all(heads, dims.ulysses_group, scatter_dim=1, gather_dim=2, gather_sizes=counts)
    assert torch.equal(back, x)
    back.backward(x.detach() * 2)  # the backward of the round trip is the identity too
    assert torch.equal(x.grad, x.detach() * 2)


def check_four_ranks(rank, world):
    for ring, ulysses, heads in [(1, 2, 7), (1, 4, 7), (1, 4, 5), (2, 2, 7), (2, 2, 3)]:
        dims = init_sequence_parallel(ring, ulysses)
        for backend in ("math", "torch_flash"):
            check_sequence(dims, heads, backend)
        check_joint(dims, heads)
        if heads == 7:
            check_jvp(dims, heads)
    for ring, ulysses in [(1, 4), (2, 2)]:
        dims = init_sequence_parallel(ring, ulysses)
        check_dit(dims, world, heads=7)
        check_qwenimage(dims, world, heads=5)


def check_three_ranks(rank, world):
    dims = init_sequence_parallel(1, 3)
    for heads in (8, 4):  # 3 + 3 + 2; 2 + 1 + 1
        check_sequence(dims, heads, "math")
        check_joint(dims, heads)
    check_jvp(dims, 8)
    check_dit(dims, world, heads=8)


def check_five_ranks(rank, world):
    dims = init_sequence_parallel(1, 5)
    for heads in (24, 7):  # 5 + 5 + 5 + 5 + 4; 2 + 2 + 1 + 1 + 1
        check_sequence(dims, heads, "math")
        check_joint(dims, heads)


def test_all_to_all_moves_unequal_head_shares():
    run_ranks(check_all_to_all_uneven, 4)


def test_ulysses_2_and_4_with_heads_they_do_not_divide_are_exact():
    """7 heads over Ulysses 2 (4 + 3) and 4 (2 + 2 + 2 + 1), 5 over 4, USP ring 2 x Ulysses 2 with 7 and 3 heads:
    padded self-attention on two backends, joint attention with masked text, forward mode; the DiT (7 heads)
    and QwenImage (5 heads) against one process, every parameter gradient."""
    run_ranks(check_four_ranks, 4)


def test_ulysses_3_with_8_heads_is_exact():
    run_ranks(check_three_ranks, 3)


def test_ulysses_5_with_24_heads_is_exact():
    run_ranks(check_five_ranks, 5)


# ---- train.py: a layout that was refused before ---------------------------------------------------------------


def test_train_pys_checks_take_a_degree_that_does_not_divide_the_heads_and_the_advice_for_one_above_them(tmp_path):
    """Before any rank: ``ulysses_degree=3`` over the tiny DiT's 4 heads (refused before) passes train.py's checks, and
    so does the advice of the refusal of ``ulysses_degree=8`` (tests/test_reliability.py's "more Ulysses ranks than
    heads": ulysses_degree=4 with ring_degree multiplied by 2)."""
    from tests.helpers import TINY, prepare_train

    prepare_train([*TINY, "logger=none", "ulysses_degree=3"], tmp_path / "three")
    prepare_train([*TINY, "logger=none", "ulysses_degree=4", "ring_degree=2"], tmp_path / "advised")


@pytest.mark.slow  # 20 s; test_ulysses_3_with_8_heads_is_exact proves the DiT's forward and backward in-process
def test_train_py_with_ulysses_3_over_4_heads_takes_the_steps_of_one_process(tmp_path):
    """``ulysses_degree=3`` with the tiny DiT's 4 heads (refused before: 3 does not divide 4) trains on 3 ranks
    (heads 2 + 1 + 1) and takes the same SGD steps as one process. fp32, as training runs: a layout reorders sums
    only (tests/test_training.py::test_sgd_steps_equal_one_device reasons rel 1e-5 and atol 1e-6)."""
    from tests.helpers import SGD, TINY, logged_losses, model_weights, run

    for name, layout in (("one", []), ("ulysses3", ["ulysses_degree=3"])):
        run("train.py", tmp_path / name, *TINY, *SGD, *layout)
    reference, parallel = logged_losses(tmp_path / "one"), logged_losses(tmp_path / "ulysses3")
    assert sorted(reference) == sorted(parallel) == [0, 1, 2]
    for step in reference:
        assert parallel[step] == pytest.approx(reference[step], rel=1e-5), f"step {step}"
    assert_same_numbers(model_weights(tmp_path / "ulysses3"), model_weights(tmp_path / "one"), rtol=1e-5, atol=1e-6,
                        where="ulysses 3 over 4 heads")
