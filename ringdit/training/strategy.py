"""``RingDDPStrategy``: Lightning's DDP with a sequence-parallel mesh inside it.

Lightning launches the processes (locally, under torchrun or SLURM) and creates the default process group; this
strategy then builds the ring / Ulysses groups (``init_sequence_parallel``) and tells data loading that only the
**data-parallel** rank and size matter: the ranks of one sequence-parallel group read the same samples and split
their tokens. DDP's gradient average over all ranks stays correct because the loss is normalised for it (see
``ringdit.parallel.sharded_mean``).
"""

from __future__ import annotations

import datetime

from lightning.pytorch.strategies import DDPStrategy

from ringdit.training.checkpoint_io import AtomicCheckpointIO
from ringdit.parallel import ParallelDims, check_degrees, current_parallel_dims, init_sequence_parallel


class RingDDPStrategy(DDPStrategy):
    strategy_name = "ring_ddp"

    def __init__(self, ring_degree: int = 1, ulysses_degree: int = 1, timeout_s: float | None = None,
                 cfg_parallel: bool = False, **kwargs):
        check_degrees(ring_degree, ulysses_degree)
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        kwargs.setdefault("checkpoint_io", AtomicCheckpointIO())
        super().__init__(**kwargs)
        self.ring_degree, self.ulysses_degree, self.cfg_parallel = ring_degree, ulysses_degree, cfg_parallel

    def setup_distributed(self) -> None:
        super().setup_distributed()
        check_degrees(self.ring_degree, self.ulysses_degree, self.world_size)
        init_sequence_parallel(self.ring_degree, self.ulysses_degree, timeout=self._timeout,
                               cfg_parallel=self.cfg_parallel)

    @property
    def parallel_dims(self) -> ParallelDims:
        return current_parallel_dims()

    @property
    def distributed_sampler_kwargs(self) -> dict:
        rank, size = self.parallel_dims.data_parallel
        return {"num_replicas": size, "rank": rank}
