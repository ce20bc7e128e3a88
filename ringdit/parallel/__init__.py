"""Sequence parallelism: the process mesh and the differentiable collectives at the shard/gather boundary."""

from ringdit.parallel.collectives import (
    all_to_all,
    chunk_length,
    exchange_guidance_halves,
    gather_sequence,
    shard_sequence,
)
from ringdit.parallel.loss import sharded_mean
from ringdit.parallel.mesh import (
    ParallelDims,
    check_degrees,
    check_heads_divisible,
    current_parallel_dims,
    init_sequence_parallel,
    reset_sequence_parallel,
)

__all__ = [
    "ParallelDims",
    "all_to_all",
    "check_degrees",
    "check_heads_divisible",
    "chunk_length",
    "current_parallel_dims",
    "exchange_guidance_halves",
    "gather_sequence",
    "init_sequence_parallel",
    "reset_sequence_parallel",
    "shard_sequence",
    "sharded_mean",
]
