"""Sequence parallelism: the process mesh and the differentiable collectives at the shard/gather boundary."""

from ringdit.parallel.collectives import (
    all_to_all,
    chunk_length,
    exchange_guidance_halves,
    gather_sequence,
    shard_sequence,
)
from ringdit.parallel.mesh import (
    ParallelDims,
    build_mesh,
    build_shard_mesh,
    check_degrees,
    init_sequence_parallel,
)
from ringdit.parallel.heads import check_heads_placeable, head_counts, head_imbalance

__all__ = [
    "ParallelDims",
    "all_to_all",
    "build_mesh",
    "build_shard_mesh",
    "check_degrees",
    "check_heads_placeable",
    "chunk_length",
    "exchange_guidance_halves",
    "gather_sequence",
    "head_counts",
    "head_imbalance",
    "init_sequence_parallel",
    "shard_sequence",
]
