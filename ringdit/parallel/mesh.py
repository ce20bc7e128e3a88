"""The sequence-parallel process mesh: world = dp x sp, sp = ring x ulysses, as a ``DeviceMesh``.

Rank layout: the ranks of one sequence-parallel (SP) group are contiguous,
``global_rank = dp_rank * sp + sp_rank``; inside it Ulysses groups are contiguous and ring groups strided,
``sp_rank = ring_rank * ulysses + ulysses_rank``. That is exactly the row-major layout of a mesh of shape
``(dp, ring, ulysses)``. Ulysses all-to-alls (heavy, latency-bound) therefore stay among neighbouring ranks (same
node, NVLink), while the ring's point-to-point traffic, which overlaps with compute, spans the farther ranks.

There is no "current" mesh: the strategy builds it once, and the model is parallelized over its ``ParallelDims``
(``ringdit.models.parallelize``); layers and collectives take it explicitly. The degrees are validated at config
time (``ringdit.spec``); here they are trusted.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend  # noqa: I001 (its Options: what DeviceMesh takes)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ringdit.common.errors import require_count

ProcessGroup = dist.ProcessGroup
MESH_DIMS = ("dp", "ring", "ulysses")


@dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the mesh and the process groups it talks over (None where a degree is 1).

    ``ParallelDims()`` is one process: no parallelism, no mesh.
    """

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
    # CFG parallel with sequence parallelism: both replicas' SP groups together (the ranks that hold parts of one
    # sample's two guidance halves), for a reduction over a whole sample in one collective (ringdit.caching).
    cfg_sp_group: ProcessGroup | None = None
    # The (dp, ring, ulysses) mesh the groups come from; FSDP shards over it.
    mesh: DeviceMesh | None = None

    @classmethod
    def build(cls, ring: int, ulysses: int, *, device_type: str = "cpu", cfg_parallel: bool = False,
              timeout: datetime.timedelta | None = None) -> ParallelDims:
        """The ``(dp, ring, ulysses)`` mesh of these (checked) degrees over the default process group, dp the rest of
        the world, and this rank's place in it (torchtitan's ``ParallelDims.build_mesh``): the degrees go down into
        the mesh and come along with it, never read back from its shape.

        Collective: every rank of the default group must call it with the same arguments (the SP and CFG groups are
        created here, for every rank in the same order).
        """
        dp = dist.get_world_size() // (ring * ulysses)
        mesh = build_mesh(ring, ulysses, device_type=device_type, timeout=timeout)
        dp_rank, ring_rank, ulysses_rank = (mesh.get_local_rank(name) for name in MESH_DIMS)
        ranks = mesh.mesh.reshape(dp, ring * ulysses)  # (dp, sp) global ranks: row d is replica d's SP group
        sp_group = None
        if ring > 1 and ulysses > 1:  # one SP group per replica: the (ring, ulysses) block, flattened
            sp_group = _subgroup(ranks.tolist(), timeout)
        elif ring * ulysses > 1:
            sp_group = mesh.get_group("ring" if ring > 1 else "ulysses")
        cfg_group = None
        if cfg_parallel:  # replicas 2j and 2j + 1 at equal sp_rank
            cfg_group = _subgroup([pair.tolist() for pair in ranks.reshape(dp // 2, 2, -1).transpose(1, 2).flatten(0, 1)],
                                  timeout)
        cfg_sp_group = None
        if cfg_parallel and ring * ulysses > 1:  # replicas 2j and 2j + 1, all their ranks
            cfg_sp_group = _subgroup(ranks.reshape(dp // 2, -1).tolist(), timeout)
        return cls(
            ring_degree=ring,
            ulysses_degree=ulysses,
            dp_degree=dp,
            rank=mesh.get_rank(),
            dp_rank=dp_rank,
            sp_rank=ring_rank * ulysses + ulysses_rank,
            ring_rank=ring_rank,
            ulysses_rank=ulysses_rank,
            sp_group=sp_group,
            ring_group=mesh.get_group("ring") if ring > 1 else None,
            ulysses_group=mesh.get_group("ulysses") if ulysses > 1 else None,
            ring_ranks=tuple(mesh["ring"].mesh.tolist()),
            cfg_group=cfg_group,
            cfg_rank=dp_rank % 2 if cfg_parallel else 0,
            cfg_sp_group=cfg_sp_group,
            mesh=mesh,
        )

    def __deepcopy__(self, memo) -> ParallelDims:
        # A copy of a model (the EMA) talks over the same process groups: share them, never copy them.
        return self

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) over which samples are split: a CFG-parallel pair shares its samples."""
        if self.cfg_group is not None:
            return self.dp_rank // 2, self.dp_degree // 2
        return self.dp_rank, self.dp_degree

    @property
    def sp_degree(self) -> int:
        return self.ring_degree * self.ulysses_degree


def build_mesh(ring_degree: int = 1, ulysses_degree: int = 1, *, device_type: str = "cpu",
               timeout: datetime.timedelta | None = None) -> DeviceMesh:
    """The ``(dp, ring, ulysses)`` mesh over the default process group (dp = world / (ring x ulysses)).

    Collective over the default group. ``timeout`` bounds every collective on the mesh's groups, so a dead rank
    ends the others with an error instead of a hang.
    """
    dp = dist.get_world_size() // (ring_degree * ulysses_degree)
    override = {name: _timeout_override(timeout) for name in MESH_DIMS} if timeout is not None else None
    return init_device_mesh(device_type, (dp, ring_degree, ulysses_degree), mesh_dim_names=MESH_DIMS,
                            backend_override=override)


def build_shard_mesh(world_size: int, replicate_degree: int = 1, device_type: str = "cpu",
                     timeout: datetime.timedelta | None = None) -> DeviceMesh:
    """FSDP's mesh: every rank in global order, ``("world",)``; or HSDP's ``("replicate", "shard")``, the shard
    groups contiguous (sharded within a group, replicated across groups). Collective over the default group."""
    if replicate_degree > 1:
        shape, names = (replicate_degree, world_size // replicate_degree), ("replicate", "shard")
    else:
        shape, names = (world_size,), ("world",)
    override = {name: _timeout_override(timeout) for name in names} if timeout is not None else None
    return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)


def _subgroup(rank_lists: list[list[int]], timeout: datetime.timedelta | None) -> ProcessGroup:
    """This rank's group among ``rank_lists`` (which cover every rank once). Collective: every rank creates every
    group, in the same order. Public API on every supported torch, unlike DeviceMesh's private flatten/unflatten."""
    group, _ = dist.new_subgroups_by_enumeration(rank_lists, timeout=timeout)
    return group


def _timeout_override(timeout: datetime.timedelta | None):
    """DeviceMesh passes a timeout to the groups it creates only inside backend options."""
    if timeout is None:
        return None
    # NCCL takes only its own options class; gloo takes any (and reads just the timeout).
    options = dist.ProcessGroupNCCL.Options() if dist.get_backend() == "nccl" else C10dBackend.Options(dist.get_backend())
    options._timeout = timeout
    return options


def check_degrees(ring_degree: object, ulysses_degree: object, world_size: int | None = None) -> None:
    """Raise a clear ValueError for degrees that cannot form a mesh: the one check, run at config time
    (``ringdit.spec``, before any process starts) and by ``init_sequence_parallel`` for
    callers that build a mesh without the configs."""
    for setting, value in (("ring_degree", ring_degree), ("ulysses_degree", ulysses_degree)):
        require_count(setting, value, hint="use 1 to disable that parallelism")
    sp = ring_degree * ulysses_degree  # type: ignore[operator]
    if world_size is not None and world_size % sp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"world size {world_size} (devices x nodes) is not divisible by ring_degree x ulysses_degree = "
            f"{ring_degree} x {ulysses_degree} = {sp}; choose degrees whose product divides {world_size} "
            f"(one of {divisors}) or set the device count to a multiple of {sp}"
        )


def init_sequence_parallel(
    ring_degree: int = 1, ulysses_degree: int = 1, *, timeout: datetime.timedelta | None = None,
    cfg_parallel: bool = False, device_type: str = "cpu",
) -> ParallelDims:
    """Build the mesh from the default process group and return this rank's ``ParallelDims`` (nothing global).

    Collective: every rank of the default group must call it with the same degrees.
    Without torch.distributed there is nothing to build: one process, no parallelism.
    """
    if not (dist.is_available() and dist.is_initialized()):
        check_degrees(ring_degree, ulysses_degree, 1)
        return ParallelDims()
    check_degrees(ring_degree, ulysses_degree, dist.get_world_size())
    return ParallelDims.build(ring_degree, ulysses_degree, device_type=device_type, cfg_parallel=cfg_parallel,
                              timeout=timeout)

