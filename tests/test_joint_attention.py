"""Joint text-image attention with the text sharded like the image, against a one-device fp64 reference.

Every rank's chunk is ``[its text shard ; its image shard]`` (``ringdit.attention.token_layout``), each stream padded at
its own tail, text keys optionally masked per sample (QwenImage pads its prompts).
"""

from __future__ import annotations

import pytest
import torch

from ringdit.attention import Stream, TokenLayout, USPAttention, get_attn_backend, ring_attention
from ringdit.parallel import ParallelDims, gather_sequence, init_sequence_parallel, shard_sequence
from ringdit.parallel.collectives import chunk_length
from tests.distributed import run_ranks

HEADS, HEAD_SIZE = 4, 16
TEXT = 5  # divides no parallel degree
# fp32 against the fp64 truth, as tests/test_backends.py's FP32_TOL (head size <= 64, <= 42 keys): measured at most
# 1.2e-6 on one device and on every layout
FP32_TOL, FP64_TOL = 1e-5, 1e-12


def random_joint(batch, text_len, image_len, dtype, seed=0, head_size=HEAD_SIZE):
    """Full ``[text ; image]`` q, k, v, dout ``(B, P + S, H, D)``, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, text_len + image_len, HEADS, head_size)
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


def joint_layout(text_len, image_len, ranks, mask=None, text_first=True) -> TokenLayout:
    text = Stream(text_len, chunk_length(text_len, ranks), mask)
    image = Stream(image_len, chunk_length(image_len, ranks))
    return TokenLayout([text, image] if text_first else [image, text])


def shard_joint(t, text_len, dims, text_first=True):
    """This rank's chunk of a full ``[text ; image]`` tensor: its text shard and its image shard, each padded."""
    text, image = shard_sequence(t[:, :text_len], dims=dims), shard_sequence(t[:, text_len:], dims=dims)
    return torch.cat([text, image] if text_first else [image, text], dim=1)


def unshard_joint(t, text_len, image_len, dims, text_first=True):
    """The inverse of ``shard_joint``: the full ``[text ; image]`` rows, gathered over the SP group."""
    text_chunk = chunk_length(text_len, dims.sp_degree)
    text, image = (t[:, :text_chunk], t[:, text_chunk:]) if text_first else (t[:, -text_chunk:], t[:, :-text_chunk])
    if dims.sp_degree > 1:
        text = gather_sequence(text, length=text_len, dims=dims)
        image = gather_sequence(image, length=image_len, dims=dims)
    return torch.cat([text[:, :text_len], image[:, :image_len]], dim=1)


def padding_rows(text_len, image_len, dims, text_first=True) -> torch.Tensor:
    """(chunk,) bool: this rank's padded rows."""
    rows = joint_layout(text_len, image_len, dims.sp_degree, text_first=text_first).real_rows(dims.sp_rank)
    chunk = chunk_length(text_len, dims.sp_degree) + chunk_length(image_len, dims.sp_degree)
    return torch.zeros(chunk, dtype=torch.bool) if rows is None else ~rows


# ---- one device ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("masked", [False, True], ids=["all_text", "masked_text"])
@pytest.mark.parametrize(("name", "dtype"), [("math", torch.float64), ("math", torch.float32),
                                             ("torch_flash", torch.float32), ("torch_sdpa", torch.float32)])
def test_joint_attention_without_sp_matches_reference(name, dtype, masked):
    image_len = 11
    q, k, v, dout = random_joint(4, TEXT, image_len, dtype)
    mask = padded_text_mask(4, TEXT) if masked else None
    ref = reference(q, k, v, dout, TEXT, mask)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    attn = USPAttention(HEADS, HEAD_SIZE, backend=name)
    out = attn(*inputs, layout=joint_layout(TEXT, image_len, 1, mask))
    out.backward(dout)
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    for got, want, what in zip((out, *(x.grad for x in inputs)), ref, ("out", "dq", "dk", "dv")):
        assert max_error(got, want) <= tol, f"{name} {what}: {max_error(got, want):.3e}"
    if mask is not None:  # masked text keys: exactly zero gradient
        assert (inputs[1].grad[:, :TEXT][~mask] == 0).all() and (inputs[2].grad[:, :TEXT][~mask] == 0).all()


BF16_UNIT_ROUNDOFF = 2.0**-8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_ring_function_with_a_joint_layout_on_every_device(device, dtype):
    """The ring function on a ring of one (no communication) with a joint layout whose text and image are both
    padded and whose text is masked per sample, so its cut-key, index and per-sample paths run on every device's
    kernels, CUDA included (head size 64: the CUDA flash kernel for bf16, efficient for fp32)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    head_size, image_len, text_chunk, image_chunk = 64, 37, 7, 40
    q, k, v, dout = random_joint(4, TEXT, image_len, torch.float64, seed=1, head_size=head_size)
    mask = padded_text_mask(4, TEXT)
    ref = reference(q, k, v, dout, TEXT, mask)
    layout = TokenLayout([Stream(TEXT, text_chunk, mask.to(device)), Stream(image_len, image_chunk)])

    def padded(t):  # [text padded to 7 ; image padded to 40]
        pad = torch.nn.functional.pad
        return torch.cat([pad(t[:, :TEXT], (0, 0, 0, 0, 0, text_chunk - TEXT)),
                          pad(t[:, TEXT:], (0, 0, 0, 0, 0, image_chunk - image_len))], dim=1).to(device, dtype)

    inputs = [padded(t).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*inputs, get_attn_backend("torch_flash"), ParallelDims(), softmax_scale=head_size**-0.5,
                         layout=layout)
    out.backward(padded(dout))
    real = torch.cat([torch.arange(TEXT), text_chunk + torch.arange(image_len)])
    for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in inputs)), ref):
        if dtype == torch.bfloat16:  # the rounding budget of tests/test_backends.py: 2u (out), 4u (grads) of max
            tol = (2 if what == "out" else 4) * BF16_UNIT_ROUNDOFF * want.abs().max().item()
        else:
            tol = FP32_TOL
        assert max_error(got[:, real].cpu(), want) <= tol, f"{device} {dtype} {what}: {max_error(got[:, real].cpu(), want):.3e}"
        pad_rows = torch.ones(text_chunk + image_chunk, dtype=torch.bool)
        pad_rows[real] = False
        assert (got[:, pad_rows] == 0).all(), f"{what}: padding rows must be zero"


def test_reference_tells_text_counted_twice_or_not_at_all():
    """The comparisons above would fail if text K/V were counted once per hop (twice) or dropped."""
    q, k, v, dout = random_joint(2, TEXT, 12, torch.float64)
    right = reference(q, k, v, dout, TEXT)
    for copies in (0, 2):
        wrong = reference(q, k, v, dout, TEXT, text_copies=copies)
        assert min(max_error(a, b) for a, b in zip(wrong, right)) > 1e3 * FP32_TOL


def test_a_layout_that_does_not_fit_the_chunk_is_refused():
    attn = USPAttention(HEADS, HEAD_SIZE, backend="math")
    x = torch.randn(2, 9, HEADS, HEAD_SIZE)
    with pytest.raises(ValueError, match=r"the token layout has 10 tokens per rank, q has 9 \(dim 1\)"):
        attn(x, x, x, layout=joint_layout(3, 7, 1))


def test_layout_key_selections():
    """Views for one contiguous run, an index for two runs, per sample where samples differ; computed once."""
    one = TokenLayout.tail_padded(10, 4)  # chunks [0..3], [4..7], [8, 9, pad, pad]
    assert one.keys(0) is None and one.keys(2) == slice(0, 2) and one.keys(0, 3) == slice(0, 10)
    assert one.real_rows(0) is None and one.real_rows(2).tolist() == [True, True, False, False]
    two = joint_layout(5, 9, 2)  # chunk = 3 text + 5 image; rank 1: text [3, 4, pad], image [5..8, pad]
    assert two.keys(0) is None and torch.equal(two.keys(1), torch.tensor([0, 1, 3, 4, 5, 6]))
    assert two.keys(1) is two.keys(1)  # kept: one layout serves every layer of a forward
    masked = joint_layout(5, 9, 2, padded_text_mask(3, 5))  # text masks: all real, [T T F F F], none real
    all_real, right_padded, no_text = masked.keys(0)  # rank 0: text [0..2], image [0..4]
    assert all_real is None and torch.equal(right_padded, torch.tensor([0, 1, 3, 4, 5, 6, 7]))
    assert no_text == slice(3, 8)  # the image keys only: a view


# ---- sequence parallel on 4 gloo ranks ----------------------------------------------------------------------------
LAYOUTS = [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2)]  # (ring, ulysses)
# backend, dtype, batch, image length, masked text, text first
CASES = [
    ("torch_flash", torch.float32, 2, 27, False, True),  # 27 image tokens: tail padding on every layout
    ("torch_flash", torch.float32, 4, 24, True, True),  # every mask pattern, no image padding
    ("math", torch.float64, 4, 9, True, True),  # 9 tokens over 4 ranks: the last rank's image is only padding
    ("math", torch.float64, 2, 13, True, False),  # the text after the image (HunyuanVideo 1.5)
]


def check_joint_layouts(rank, world, errors_file):
    report = []
    for ring, ulysses in LAYOUTS:  # one group of processes for all layouts: spawning dominates the test's time
        dims = init_sequence_parallel(ring, ulysses)
        cases = CASES + ([("torch_sdpa", torch.float32, 4, 27, True, True)] if ring == 1 else [])  # no LSE
        for backend, dtype, batch, image_len, masked, text_first in cases:
            q, k, v, dout = random_joint(batch, TEXT, image_len, dtype, seed=image_len)
            mask = padded_text_mask(batch, TEXT) if masked else None
            ref = reference(q, k, v, dout, TEXT, mask)
            local = [shard_joint(t, TEXT, dims, text_first).requires_grad_() for t in (q, k, v)]
            layout = joint_layout(TEXT, image_len, dims.sp_degree, mask, text_first)
            out = USPAttention(HEADS, HEAD_SIZE, backend=backend, dims=dims)(*local, layout=layout)
            out.backward(shard_joint(dout, TEXT, dims, text_first))
            label = f"{ring}x{ulysses} {backend} {str(dtype)[6:]} B={batch} S={image_len} mask={masked} " \
                    f"text_first={text_first}"
            tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
            errors = {}
            for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in local)), ref):
                errors[what] = max_error(unshard_joint(got, TEXT, image_len, dims, text_first), want)
                assert errors[what] <= tol, f"{label} {what}: max abs error {errors[what]:.3e} > {tol:.0e}"
            report.append(f"{label}: " + " ".join(f"{w}={e:.1e}" for w, e in errors.items()))
            if mask is not None:  # masked text keys get no gradient, on any rank
                text_mask = shard_sequence(mask, dims=dims)
                text_rows = slice(0, text_mask.shape[1]) if text_first else slice(-text_mask.shape[1], None)
                assert all((g[:, text_rows][~text_mask] == 0).all() for g in (local[1].grad, local[2].grad)), label
            # text and image tail padding: zero output rows and zero gradients
            pad = padding_rows(TEXT, image_len, dims, text_first)
            assert all((t[:, pad] == 0).all() for t in (out, *(x.grad for x in local))), label
    if rank == 0:
        with open(errors_file, "w") as f:
            f.write("\n".join(report) + "\n")


def test_joint_attention_on_every_layout_matches_one_device(tmp_path):
    """Ring 2/4, Ulysses 2/4, 2x2; text of 5 tokens (divides nothing) sharded with the image, both padded, a rank
    whose image is only padding; masks of every kind incl. a sample with no real text; text before or after."""
    errors_file = tmp_path / "errors.txt"
    run_ranks(check_joint_layouts, 4, str(errors_file))
    print("\n" + errors_file.read_text())
