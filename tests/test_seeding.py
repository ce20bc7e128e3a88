"""The named random streams: a draw depends on (stream, seed, key) only."""

from __future__ import annotations

import torch

from ringdit.sampling import SampleRequests
from ringdit.common.seeding import Stream, generator, seed_of


def test_a_draw_depends_on_its_stream_seed_and_key_only():
    assert seed_of(Stream.TRAIN, 0, 5, 0, 3) == seed_of(Stream.TRAIN, 0, 5, 0, 3)
    draws = {seed_of(stream, seed, *key) for stream in Stream for seed in (0, 1) for key in [(), (0,), (0, 0), (1,)]}
    assert len(draws) == len(Stream) * 2 * 4  # no two streams, seeds or keys (trailing zeros included) collide
    assert all(0 <= s < 2**63 for s in draws)  # fits the int64 tensors infer.py's batches carry
    a, b = generator(Stream.PREVIEW, 3, 7), torch.Generator().manual_seed(seed_of(Stream.PREVIEW, 3, 7))
    assert torch.equal(torch.randn(4, generator=a), torch.randn(4, generator=b))


def test_inference_sample_seeds_do_not_depend_on_the_job_size():
    few, many = SampleRequests([1, 2, 3], seed=4), SampleRequests(list(range(10)), seed=4)
    assert [few[i][2] for i in range(3)] == [many[i][2] for i in range(3)]
    assert len({many[i][2] for i in range(10)}) == 10
