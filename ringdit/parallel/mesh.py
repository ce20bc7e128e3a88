"""The sequence-parallel process mesh: world = dp x sp, sp = ring x ulysses.

Rank layout (DESIGN.md): the ranks of one sequence-parallel (SP) group are contiguous,
``global_rank = dp_rank * sp + sp_rank``; inside it Ulysses groups are contiguous and ring groups strided,
``sp_rank = ring_rank * ulysses + ulysses_rank``. Ulysses all-to-alls (heavy, latency-bound) therefore stay among
neighbouring ranks (same node, NVLink), while the ring's point-to-point traffic, which overlaps with compute, spans
the farther ranks.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the mesh and the process groups it talks over (None where a degree is 1)."""

    ring_degree: int = 1
    ulysses_degree: int = 1
    dp_degree: int = 1
    rank: int = 0
    dp_rank: int = 0
    sp_rank: int = 0
    ring_rank: int = 0
    ulysses_rank: int = 0
    sp_group: ProcessGroup | None = None
    ring_group: ProcessGroup | None = None
    ulysses_group: ProcessGroup | None = None
    # Global ranks of this rank's ring, indexed by ring rank: the neighbours of point-to-point transfers.
    ring_ranks: tuple[int, ...] = (0,)
    # CFG parallel (sampling): data-parallel replicas 2j and 2j + 1 compute the conditional (cfg_rank 0) and the
    # unconditional (cfg_rank 1) half of the same samples; cfg_group pairs the ranks of equal sp_rank.
    cfg_group: ProcessGroup | None = None
    cfg_rank: int = 0

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) over which samples are split: a CFG-parallel pair shares its samples."""
        if self.cfg_group is not None:
            return self.dp_rank // 2, self.dp_degree // 2
        return self.dp_rank, self.dp_degree

    @property
    def sp_degree(self) -> int:
        return self.ring_degree * self.ulysses_degree

    @property
    def world_size(self) -> int:
        return self.dp_degree * self.sp_degree


_current = ParallelDims()


def current_parallel_dims() -> ParallelDims:
    """The mesh made current by the last ``init_sequence_parallel`` (no parallelism before that)."""
    return _current


def check_degrees(ring_degree: object, ulysses_degree: object, world_size: int | None = None) -> None:
    """Raise a clear ValueError for degrees that cannot form a mesh (used at config time and at init)."""
    for setting, value in (("ring_degree", ring_degree), ("ulysses_degree", ulysses_degree)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{setting} must be an integer >= 1, got {value!r}; use 1 to disable that parallelism")
    sp = ring_degree * ulysses_degree  # type: ignore[operator]
    if world_size is not None and world_size % sp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"world size {world_size} (devices x nodes) is not divisible by ring_degree x ulysses_degree = "
            f"{ring_degree} x {ulysses_degree} = {sp}; choose degrees whose product divides {world_size} "
            f"(one of {divisors}) or set the device count to a multiple of {sp}"
        )


def check_heads_divisible(num_heads: int, ulysses_degree: int) -> None:
    if num_heads % ulysses_degree:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"num_heads={num_heads} is not divisible by ulysses_degree={ulysses_degree}: Ulysses gives each rank "
            f"num_heads / ulysses_degree heads; use ulysses_degree in {divisors} (or move the rest to ring_degree)"
        )


def init_sequence_parallel(
    ring_degree: int = 1, ulysses_degree: int = 1, *, timeout: datetime.timedelta | None = None,
    cfg_parallel: bool = False,
) -> ParallelDims:
    """Build the ring / Ulysses groups from the default process group and make them current.

    Collective: every rank of the default group must call it with the same degrees. ``timeout`` bounds every
    collective on the new groups, so a dead rank ends the others with an error instead of a hang. Without
    torch.distributed (or with both degrees 1 on one process) there is nothing to build.
    """
    global _current
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    check_degrees(ring_degree, ulysses_degree, world_size)
    sp = ring_degree * ulysses_degree
    if cfg_parallel and (world_size // sp) % 2:
        raise ValueError(f"cfg_parallel needs an even number of data-parallel replicas (one for each half of the "
                         f"guidance), got {world_size // sp}; set dp_degree=2 (or another even number)")
    if world_size == 1:
        _current = ParallelDims()
        return _current

    rank = dist.get_rank()
    dp_rank, sp_rank = divmod(rank, sp)
    ring_rank, ulysses_rank = divmod(sp_rank, ulysses_degree)
    groups: dict[str, ProcessGroup | None] = {"sp": None, "ring": None, "ulysses": None}
    ring_ranks: tuple[int, ...] = (rank,)
    # new_group is collective over the whole world: every rank creates every group, in the same order.
    for dp in range(world_size // sp):
        base = dp * sp
        layouts = {
            "sp": [[base + s for s in range(sp)]] if sp > 1 else [],
            "ring": [[base + r * ulysses_degree + u for r in range(ring_degree)] for u in range(ulysses_degree)]
            if ring_degree > 1
            else [],
            "ulysses": [[base + r * ulysses_degree + u for u in range(ulysses_degree)] for r in range(ring_degree)]
            if ulysses_degree > 1
            else [],
        }
        for kind, rank_lists in layouts.items():
            for ranks in rank_lists:
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    groups[kind] = group
                    if kind == "ring":
                        ring_ranks = tuple(ranks)
    cfg_group = None
    if cfg_parallel:  # after the groups above, in the same order on every rank
        for pair in range(world_size // sp // 2):
            for sp_index in range(sp):
                ranks = [2 * pair * sp + sp_index, (2 * pair + 1) * sp + sp_index]
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    cfg_group = group
    _current = ParallelDims(
        ring_degree=ring_degree,
        ulysses_degree=ulysses_degree,
        dp_degree=world_size // sp,
        rank=rank,
        dp_rank=dp_rank,
        sp_rank=sp_rank,
        ring_rank=ring_rank,
        ulysses_rank=ulysses_rank,
        sp_group=groups["sp"],
        ring_group=groups["ring"],
        ulysses_group=groups["ulysses"],
        ring_ranks=ring_ranks,
        cfg_group=cfg_group,
        cfg_rank=dp_rank % 2 if cfg_parallel else 0,
    )
    return _current


def reset_sequence_parallel() -> None:
    """Forget the current mesh (its groups stay valid until the process group is destroyed)."""
    global _current
    _current = ParallelDims()
