"""``RingDDPStrategy``: Lightning's DDP with a sequence-parallel mesh inside it.

Lightning launches the processes (locally, under torchrun or SLURM) and creates the default process group; this
strategy then builds the ``(dp, ring, ulysses)`` device mesh, hands it to the LightningModule (which hands it to
the model it builds: ``ringdit.parallel.set_parallel_dims``) and tells data loading that only the
**data-parallel** rank and size matter: the ranks of one sequence-parallel group read the same samples and split
their tokens. DDP's gradient average over all ranks stays correct because the loss is normalised for it (see
``ringdit.parallel.sharded_mean``).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading

from lightning.pytorch.strategies import DDPStrategy

from ringdit.launcher import spawned_by_launcher
from ringdit.training.checkpoint_io import AtomicCheckpointIO
from ringdit.parallel import ParallelDims, init_sequence_parallel, set_parallel_dims


class RingDDPStrategy(DDPStrategy):
    strategy_name = "ring_ddp"

    def __init__(self, ring_degree: int = 1, ulysses_degree: int = 1, timeout_s: float | None = None,
                 rendezvous_timeout_s: float | None = 60.0, cfg_parallel: bool = False, **kwargs):
        # The degrees were validated at config time (ringdit.config.validate_parallel).
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        kwargs.setdefault("checkpoint_io", AtomicCheckpointIO())
        super().__init__(**kwargs)
        self.ring_degree, self.ulysses_degree, self.cfg_parallel = ring_degree, ulysses_degree, cfg_parallel
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.parallel_dims = ParallelDims()

    def setup_distributed(self) -> None:
        # Ranks that never come (a second node nobody started, a stray LOCAL_RANK) would keep this rank waiting for
        # the whole process-group timeout or for ever; the rendezvous gets its own, shorter bound.
        self._watchdog, self._waited_s = None, 0.0
        if self.rendezvous_timeout_s is not None and self.num_nodes * self.num_processes > 1:
            self._arm_watchdog()
        try:
            super().setup_distributed()
            self.parallel_dims = init_sequence_parallel(
                self.ring_degree, self.ulysses_degree, timeout=self._timeout, cfg_parallel=self.cfg_parallel,
                device_type=self.root_device.type,
            )
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
        if self.lightning_module is not None:
            set_parallel_dims(self.lightning_module, self.parallel_dims)

    def _arm_watchdog(self) -> None:
        self._watchdog = threading.Timer(self.rendezvous_timeout_s, self._rendezvous_timed_out)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _local_ranks_still_starting(self) -> bool:
        """One machine, every rank started here by Lightning and still alive: they are slow (a loaded machine), not
        missing; a rank that dies makes Lightning end the launch anyway."""
        if self.num_nodes != 1:
            return False
        children = getattr(self.launcher, "procs", None) or []
        if children:  # the launcher: its spawned ranks are alive
            return all(child.poll() is None for child in children)
        return spawned_by_launcher()  # a spawned rank whose launcher lives

    def _rendezvous_timed_out(self) -> None:
        """Runs on the watchdog thread while the main thread is blocked inside torch.distributed: say what was being
        waited for and end the process (nothing has been trained, so nothing is lost). Local ranks that are alive
        get up to the process-group timeout (trainer.strategy.timeout_s)."""
        self._waited_s += self.rendezvous_timeout_s
        limit = self._timeout.total_seconds() if self._timeout is not None else 1800.0
        if self._local_ranks_still_starting() and self._waited_s < limit:
            self._arm_watchdog()
            return
        env = self.cluster_environment
        address = f"{os.environ.get('MASTER_ADDR', env.main_address)}:{os.environ.get('MASTER_PORT', env.main_port)}"
        print(f"Error: rank {self.global_rank} waited {self._waited_s:g} s for all "
              f"{self.num_nodes * self.num_processes} ranks (trainer.num_nodes={self.num_nodes} x "
              f"{self.num_processes} per node) to join at {address}, and some never came. Start every node's "
              f"processes (torchrun / srun, or NODE_RANK and MASTER_ADDR on each node), check that {address} is "
              f"reachable from them, or raise trainer.strategy.rendezvous_timeout_s", file=sys.stderr, flush=True)
        os._exit(2)

    @property
    def distributed_sampler_kwargs(self) -> dict:
        rank, size = self.parallel_dims.data_parallel
        return {"num_replicas": size, "rank": rank}
