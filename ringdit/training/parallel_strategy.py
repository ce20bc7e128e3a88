"""``SequenceParallelStrategy``: what ringdit's DDP and FSDP strategies share, written once.

Lightning launches the processes (locally, under torchrun or SLURM) and creates the default process group; this
base then has its ``layout`` (``ringdit.parallel.layout.Layout``, checked once from the config) build the
``(dp, ring, ulysses)`` device mesh as ``parallel_dims``, which the LightningModule's ``configure_model`` parallelizes
the model over, and tells data loading that only the
**data-parallel** rank and size matter: the ranks of one sequence-parallel group read the same samples and split
their tokens. It also bounds the wait for ranks that never come (``rendezvous_timeout_s``) and every collective
(``timeout_s``).

It is a mixin, listed before the Lightning strategy it extends (``class RingDDPStrategy(SequenceParallelStrategy,
DDPStrategy)``); a subclass says how its Lightning strategy sets up the device and creates the process group
(``_init_process_group``) and holds only what differs: DDP's wrapping, FSDP's sharding and checkpoint folders.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading

import hydra

from ringdit.commands.launcher import spawned_by_launcher
from ringdit.parallel import ParallelDims
from ringdit.parallel.layout import Layout

# trainer.strategy's settings that are the layout's (``Layout.from_config`` reads them, and checks them against the
# top-level degrees): the strategy takes them as its ``layout``, never one by one
LAYOUT_SETTINGS = ("ring_degree", "ulysses_degree", "cfg_parallel", "replicate_degree", "cpu_offload")


def build_strategy(config: dict, layout: Layout, **keywords):
    """The Lightning strategy ``config`` (``trainer.strategy``, resolved) names, running ``layout``; ``keywords``:
    more of its arguments."""
    own = {key: value for key, value in config.items() if key not in LAYOUT_SETTINGS}
    # the layout after instantiation: Hydra would turn a dataclass argument into a config of its fields
    return hydra.utils.instantiate(own, _partial_=True, **keywords)(layout=layout)


class SequenceParallelStrategy:
    """The sequence-parallel layout, timeouts and rendezvous watchdog of a Lightning strategy.

    Args:
        layout: the ranks and how they split the work (``Layout.from_config``, checked at config time): it builds
            the mesh. None: one process, no sequence parallelism.
        timeout_s: a collective that waits longer ends the run with an error instead of hanging.
        rendezvous_timeout_s: ranks that have not all joined by then (a node never started) end the launch.
        **kwargs: the Lightning strategy's own arguments.
    """

    def __init__(self, layout: Layout | None = None, *, timeout_s: float | None = None,
                 rendezvous_timeout_s: float | None = 60.0, **kwargs):
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        super().__init__(**kwargs)
        self.layout = Layout() if layout is None else layout
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.parallel_dims = ParallelDims()
        self._watchdog: threading.Timer | None = None
        self._waited_s = 0.0

    def _init_process_group(self) -> None:
        """The Lightning strategy's own set-up of this rank's device and of the default process group."""
        raise NotImplementedError(f"{type(self).__name__} must say how it creates the process group")

    def setup_environment(self) -> None:
        # Ranks that never come (a second node nobody started, a stray LOCAL_RANK) would keep this rank waiting for
        # the whole process-group timeout or for ever; the rendezvous gets its own, shorter bound.
        self._watchdog, self._waited_s = None, 0.0
        if self.rendezvous_timeout_s is not None and self.num_nodes * self.num_processes > 1:
            self._arm_watchdog()
        try:
            self._init_process_group()
            self.parallel_dims = self.layout.build_mesh(self.root_device.type, timeout=self._timeout)
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()

    @property
    def distributed_sampler_kwargs(self) -> dict:
        rank, size = self.parallel_dims.data_parallel
        return {"num_replicas": size, "rank": rank}

    # ---- the rendezvous watchdog --------------------------------------------------------------------------------
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
