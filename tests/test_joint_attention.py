"""Joint text-image attention (replicated text prefix + sharded image) against a one-device fp64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringdit.attention import USPAttention, get_attn_backend, joint_ring_attention
from ringdit.attention.joint import real_prefix_indices
from ringdit.attention.ring import ReplicatedText
from ringdit.parallel import ParallelDims, gather_sequence, init_sequence_parallel, shard_sequence
from tests.distributed import run_ranks

HEADS, HEAD_SIZE = 4, 16
TEXT = 5  # divides no parallel degree
# fp32 against the fp64 truth, as tests/test_backends.py's FP32_TOL (head size <= 64, <= 42 keys): measured at most
# 1.2e-6 on one device and on every layout
FP32_TOL, FP64_TOL = 1e-5, 1e-12


def random_joint(batch, text_len, image_len, dtype, seed=0):
    """Full ``[text ; image]`` q, k, v, dout ``(B, P + S, H, D)``, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, text_len + image_len, HEADS, HEAD_SIZE)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(4)]


def padded_text_mask(batch, text_len):
    """Per sample: all real, right-padded (QwenImage), none real, and a scattered pattern."""
    mask = torch.ones(batch, text_len, dtype=torch.bool)
    patterns = [[True] * text_len, [True, True] + [False] * (text_len - 2), [False] * text_len,
                [i % 2 == 1 for i in range(text_len)]]
    for b in range(batch):
        mask[b] = torch.tensor(patterns[b % len(patterns)])
    return mask


def reference(q, k, v, dout, text_len, mask=None, text_copies=1):
    """One device, fp64, written independently of ringdit: softmax over all keys with masked text keys at -inf.

    ``text_copies`` repeats the text keys (2: counted twice, 0: left out) to show the comparison would notice.
    """
    qd, kd, vd = (t.detach().double().clone().requires_grad_() for t in (q, k, v))
    keys_k = torch.cat([kd[:, :text_len]] * text_copies + [kd[:, text_len:]], dim=1)
    keys_v = torch.cat([vd[:, :text_len]] * text_copies + [vd[:, text_len:]], dim=1)
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, keys_k) * q.shape[-1] ** -0.5
    if mask is not None and text_copies:
        image_keys = torch.ones(q.shape[0], q.shape[1] - text_len, dtype=torch.bool)
        key_mask = torch.cat([mask] * text_copies + [image_keys], dim=1)  # (B, keys)
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), keys_v)
    out.backward(dout.double())
    return out.detach(), qd.grad, kd.grad, vd.grad


def max_error(a, b):
    return (a.double() - b).abs().max().item()


# ---- one device ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("masked", [False, True], ids=["all_text", "masked_text"])
@pytest.mark.parametrize(("name", "dtype"), [("math", torch.float64), ("math", torch.float32),
                                             ("torch_flash", torch.float32), ("torch_sdpa", torch.float32)])
def test_joint_attention_without_sp_matches_reference(name, dtype, masked):
    image_len, padded_len = 11, 14  # three rows of image tail padding
    q, k, v, dout = random_joint(4, TEXT, image_len, dtype)
    mask = padded_text_mask(4, TEXT) if masked else None
    ref = reference(q, k, v, dout, TEXT, mask)
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, 0, 0, padded_len - image_len))  # noqa: E731
    inputs = [pad(t).requires_grad_() for t in (q, k, v)]
    attn = USPAttention(HEADS, HEAD_SIZE, backend=name)
    out = attn(*inputs, valid_len=image_len, joint_prefix=TEXT, prefix_mask=mask)
    out.backward(pad(dout))
    real = slice(0, TEXT + image_len)
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    for got, want, what in zip((out, *(x.grad for x in inputs)), ref, ("out", "dq", "dk", "dv")):
        assert max_error(got[:, real], want) <= tol, f"{name} {what}: {max_error(got[:, real], want):.3e}"
        assert (got[:, TEXT + image_len :] == 0).all(), f"{what}: image padding rows must be zero"
    if mask is not None:  # masked text keys: exactly zero gradient
        assert (inputs[1].grad[:, :TEXT][~mask] == 0).all() and (inputs[2].grad[:, :TEXT][~mask] == 0).all()


BF16_UNIT_ROUNDOFF = 2.0**-8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_joint_ring_function_kernels(device, dtype):
    """The joint ring function on a ring of one (no communication), so its text-chunk and per-sample paths run on
    every device's kernels, CUDA included (head size 64: the CUDA flash kernel for bf16, efficient for fp32)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    head_size, image_len, padded_len = 64, 37, 40
    g = torch.Generator().manual_seed(1)
    shape = (4, TEXT + image_len, HEADS, head_size)
    q, k, v, dout = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    mask = padded_text_mask(4, TEXT)
    ref = reference(q, k, v, dout, TEXT, mask)
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, 0, 0, padded_len - image_len))  # noqa: E731
    text = [t[:, :TEXT].to(device, dtype).requires_grad_() for t in (q, k, v)]
    image = [pad(t[:, TEXT:]).to(device, dtype).requires_grad_() for t in (q, k, v)]
    out, text_out = joint_ring_attention(
        *image, ReplicatedText(*text, real_prefix_indices(mask.to(device))), get_attn_backend("torch_flash"),
        ParallelDims(), softmax_scale=head_size**-0.5, valid_len=image_len,
    )
    torch.autograd.backward([out, text_out], [pad(dout[:, TEXT:]).to(device, dtype), dout[:, :TEXT].to(device, dtype)])
    for what, got_text, got_image, want in zip(
        ("out", "dq", "dk", "dv"), (text_out, *(t.grad for t in text)), (out, *(t.grad for t in image)), ref
    ):
        got = torch.cat([got_text, got_image[:, :image_len]], dim=1).cpu()
        if dtype == torch.bfloat16:  # the rounding budget of tests/test_backends.py: 2u (out), 4u (grads) of max
            tol = (2 if what == "out" else 4) * BF16_UNIT_ROUNDOFF * want.abs().max().item()
        else:
            tol = FP32_TOL
        assert max_error(got, want) <= tol, f"{device} {dtype} {what}: {max_error(got, want):.3e} > {tol:.3e}"
        assert (got_image[:, image_len:] == 0).all()


def test_reference_tells_text_counted_twice_or_not_at_all():
    """The comparisons above would fail if text K/V were counted once per hop (twice) or dropped."""
    q, k, v, dout = random_joint(2, TEXT, 12, torch.float64)
    right = reference(q, k, v, dout, TEXT)
    for copies in (0, 2):
        wrong = reference(q, k, v, dout, TEXT, text_copies=copies)
        assert min(max_error(a, b) for a, b in zip(wrong, right)) > 1e3 * FP32_TOL


def test_joint_arguments_are_checked():
    attn = USPAttention(HEADS, HEAD_SIZE, backend="math")
    x = torch.randn(2, 9, HEADS, HEAD_SIZE)
    with pytest.raises(ValueError, match=r"joint_prefix must be an integer in \[0, 9\].*got 10"):
        attn(x, x, x, joint_prefix=10)
    shape_error = r"prefix_mask must be a bool tensor of shape \(batch, joint_prefix\) = \(2, 3\)"
    with pytest.raises(ValueError, match=shape_error):
        attn(x, x, x, joint_prefix=3, prefix_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="prefix_mask was given with joint_prefix=0"):
        attn(x, x, x, prefix_mask=torch.ones(2, 3, dtype=torch.bool))


# ---- sequence parallel on 4 gloo ranks ----------------------------------------------------------------------------
LAYOUTS = [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2)]  # (ring, ulysses)
# backend, dtype, batch, image length, masked text
CASES = [
    ("torch_flash", torch.float32, 2, 27, False),  # 27 image tokens: tail padding on every layout
    ("torch_flash", torch.float32, 4, 24, True),  # every mask pattern, no padding
    ("math", torch.float64, 4, 9, True),  # 9 tokens over 4 ranks: the last rank holds only padding
]


def joint_step(backend, q, k, v, dout, mask, image_len, dims):
    """This rank's view: replicated text + its image shard; the text loss is shared equally by the SP ranks."""
    local = [torch.cat([t[:, :TEXT], shard_sequence(t[:, TEXT:], dims=dims)], dim=1).requires_grad_()
             for t in (q, k, v)]
    out = USPAttention(HEADS, HEAD_SIZE, backend=backend, dims=dims)(
        *local, valid_len=image_len, joint_prefix=TEXT, prefix_mask=mask
    )
    out.backward(torch.cat([dout[:, :TEXT] / dims.sp_degree, shard_sequence(dout[:, TEXT:], dims=dims)], dim=1))
    return out.detach(), [x.grad for x in local]


def check_joint_layouts(rank, world, errors_file):
    report = []
    for ring, ulysses in LAYOUTS:  # one group of processes for all layouts: spawning dominates the test's time
        dims = init_sequence_parallel(ring, ulysses)
        cases = CASES + ([("torch_sdpa", torch.float32, 4, 27, True)] if ring == 1 else [])  # no LSE: Ulysses only
        for backend, dtype, batch, image_len, masked in cases:
            q, k, v, dout = random_joint(batch, TEXT, image_len, dtype, seed=image_len)
            mask = padded_text_mask(batch, TEXT) if masked else None
            ref = reference(q, k, v, dout, TEXT, mask)
            out, grads = joint_step(backend, q, k, v, dout, mask, image_len, dims)
            label = f"{ring}x{ulysses} {backend} {str(dtype)[6:]} B={batch} S={image_len} mask={masked}"
            tol = FP64_TOL if dtype == torch.float64 else FP32_TOL

            # image rows: gathered over the SP group, as usual
            image = [gather_sequence(t[:, TEXT:], length=image_len, dims=dims) for t in (out, *grads)]
            # text rows: the output is complete on every rank; the gradients are partial sums over the ranks
            text_grads = [g[:, :TEXT].clone() for g in grads]
            for g in text_grads:
                dist.all_reduce(g, group=dims.sp_group)
            errors = {}
            for what, got_image, got_text, want in zip(
                ("out", "dq", "dk", "dv"), image, [out[:, :TEXT], *text_grads], ref
            ):
                errors[what] = max(max_error(got_image, want[:, TEXT:]), max_error(got_text, want[:, :TEXT]))
                assert errors[what] <= tol, f"{label} {what}: max abs error {errors[what]:.3e} > {tol:.0e}"
            report.append(f"{label}: " + " ".join(f"{w}={e:.1e}" for w, e in errors.items()))

            # the replicated text output stays exactly replicated: the same bits on every rank
            copies = [torch.empty_like(out[:, :TEXT]) for _ in range(dims.sp_degree)]
            dist.all_gather(copies, out[:, :TEXT].contiguous(), group=dims.sp_group)
            assert all(torch.equal(c, copies[0]) for c in copies), f"{label}: text rows differ between ranks"
            # no rank alone holds the text gradient: summing over the SP group is necessary
            for what, g, want in zip(("dq", "dk", "dv"), grads, ref[1:]):
                assert max_error(g[:, :TEXT], want[:, :TEXT]) > 0.1 * want[:, :TEXT].abs().max(), f"{label} {what}"
            if mask is not None:  # masked text keys get no gradient, on any rank
                assert all((g[:, :TEXT][~mask] == 0).all() for g in grads[1:]), label
            # image tail padding: zero output rows and zero gradients
            pad_from = TEXT + max(0, image_len - dims.sp_rank * (out.shape[1] - TEXT))
            assert all((t[:, pad_from:] == 0).all() for t in (out, *grads)), label
    if rank == 0:
        with open(errors_file, "w") as f:
            f.write("\n".join(report) + "\n")


def test_joint_attention_on_every_layout_matches_one_device(tmp_path):
    """Ring 2/4, Ulysses 2/4, 2x2; text of 5 tokens (divides nothing); image tail padding, a rank holding only
    padding; masks of every kind incl. a sample with no real text; text grads summed over SP vs one device."""
    errors_file = tmp_path / "errors.txt"
    run_ranks(check_joint_layouts, 4, str(errors_file))
    print("\n" + errors_file.read_text())
