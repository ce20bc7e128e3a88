"""Streams packed after the tokens in the tokens' own tensors (``ParallelPlan.packed``): a toy model that embeds,
positions and projects ``[tokens ; reference]`` as one sequence, as Qwen-Image-Edit does, and attends over it, with
the plan cutting each stream over the ranks on its own -- in float64 under ring 2 and Ulysses 2 against the same model
unsharded: the prediction (the tokens only) and every parameter gradient. Lengths 7 and 5 divide no degree: both
streams are tail-padded. A packed tensor of other lengths, and a packed stream named twice, are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from ringdit.models import parallelize
from ringdit.models.parallel_plan import TOKENS, PackedStreams, ParallelPlan, StreamPlan
from ringdit.parallel import init_sequence_parallel
from tests.diffusers_helpers import ddp_average
from tests.distributed import run_ranks
from tests.helpers import assert_same_numbers
from tests.toy_attention import Attention

DIM, TOKEN_LEN, REFERENCE_LEN = 8, 7, 5
OUT_ATOL, GRAD_OF_MAX = 1e-13, 1e-12  # float64: only the order of sums differs


class Positions(nn.Module):
    """A learned (S + R, D) position table of the packed sequence (made whole, as RoPE modules make rotations)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(TOKEN_LEN + REFERENCE_LEN, DIM))

    def forward(self):
        return self.table


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = Attention(), nn.Linear(DIM, DIM)

    def forward(self, x, positions):
        x = x + self.attn(x + positions)
        return x + self.mlp(x).tanh()


class PackedModel(nn.Module):
    """(tokens (B, 7, D), reference (B, 5, D), lengths (7, 5)) -> the tokens' prediction (B, 7, D)."""

    parallel_plan = ParallelPlan(
        blocks=("blocks",),
        self_attention=("blocks.*.attn",),
        split_inputs={"blocks.0": {0: 1}}, split_outputs={"positions": {None: 0}}, gather_outputs={"out": {None: 1}},
        packed=PackedStreams(streams=("reference",), module="", key="lengths", lengths=tuple),
        attention_streams={"blocks.*.attn": (TOKENS, "reference")},
    )

    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.positions = Positions()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, tokens, reference, *, lengths):
        x = self.embed(torch.cat([tokens, reference], dim=1))  # (B, S + R, D)
        positions = self.positions()
        for block in self.blocks:
            x = block(x, positions)
        return self.out(x)[:, : lengths[0]]  # the tokens' prediction, as the edit pipelines slice it


def packed_case(dims=None):
    torch.manual_seed(0)
    reference = PackedModel().double()
    model = PackedModel().double()
    model.load_state_dict(reference.state_dict())
    parallelize(model, dims=dims, backend="math")
    g = torch.Generator().manual_seed(1)
    tokens, ref = (torch.randn(2, n, DIM, generator=g, dtype=torch.float64) for n in (TOKEN_LEN, REFERENCE_LEN))
    dout = torch.randn(2, TOKEN_LEN, DIM, generator=g, dtype=torch.float64)
    return reference, model, (tokens, ref), dout


def forward_backward(model, inputs, dout, lengths=(TOKEN_LEN, REFERENCE_LEN)):
    model.zero_grad()
    out = model(*inputs, lengths=lengths)
    (out * dout).sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_matches(got, expected, where):
    (out, grads), (ref_out, ref_grads) = got, expected
    assert_same_numbers(out, ref_out, atol=OUT_ATOL, where=f"{where} output")
    largest = max(grad.abs().max() for grad in ref_grads.values())
    assert_same_numbers(grads, ref_grads, atol=GRAD_OF_MAX * largest, where=f"{where} gradient")


def check_packed_layouts(rank, world):
    for ring, ulysses in ((2, 1), (1, 2)):
        reference, model, inputs, dout = packed_case(init_sequence_parallel(ring, ulysses))
        seen = []  # the blocks' local sequence: [4 of the 7 tokens ; 3 of the 5 reference], each cut on its own
        model.blocks[1].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
        expected = forward_backward(reference, inputs, dout)
        out, grads = forward_backward(model, inputs, dout)
        assert seen == [4 + 3], seen  # one stream of 12 would be 6 a rank
        ddp_average(grads)  # DDP's average over the dp x sp ranks
        assert_matches((out, grads), expected, f"ring {ring} x ulysses {ulysses}")


def test_packed_streams_match_the_unsharded_model_under_ring_and_ulysses():
    run_ranks(check_packed_layouts, 2)


def test_packed_streams_on_one_process_match_the_unsharded_model():
    reference, model, inputs, dout = packed_case()
    assert_matches(forward_backward(model, inputs, dout), forward_backward(reference, inputs, dout), "one process")


def test_packed_lengths_that_do_not_describe_the_tensor_are_refused():
    _, model, inputs, dout = packed_case()
    with pytest.raises(ValueError, match=r"a planned tokens split saw 12 tokens, but the streams packed there "
                                         r"\(\['tokens', 'reference'\]\) hold \[6, 5\] = 11"):
        forward_backward(model, inputs, dout, lengths=(6, 5))


def test_a_packed_stream_named_twice_is_refused():
    plan = replace(PackedModel.parallel_plan, streams={"reference": StreamPlan()})
    with pytest.raises(ValueError, match="the parallel plan's packed streams name 'reference', which it describes "
                                         "already"):
        parallelize(PackedModel(), plan)
