"""``RingDDPStrategy``: Lightning's DDP with a sequence-parallel mesh inside it.

Every rank holds all parameters, gradients and optimizer state. The mesh, timeouts, rendezvous watchdog and
data-parallel sampler come from ``SequenceParallelStrategy``; here only what DDP adds: single-file checkpoints
written atomically (``AtomicCheckpointIO``). DDP's gradient average over all ranks is the one-device gradient: every
rank's loss is the whole sample's, on the gathered prediction (see ``DiffusionModule.diffusion_loss``).
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy

from ringdit.models.fp8 import keep_float8_out_of_ddp
from ringdit.training.checkpoint_io import AtomicCheckpointIO
from ringdit.training.parallel_strategy import SequenceParallelStrategy


class RingDDPStrategy(SequenceParallelStrategy, DDPStrategy):
    """DDP over all dp x sp ranks, plus the sequence-parallel mesh (arguments: ``SequenceParallelStrategy``'s, then
    ``DDPStrategy``'s)."""

    strategy_name = "ring_ddp"
    layout_strategy = "ddp"  # how ringdit.parallel.layout.Layout (and the memory estimate) knows it: every rank holds all

    def __init__(self, **kwargs):
        kwargs.setdefault("checkpoint_io", AtomicCheckpointIO())
        super().__init__(**kwargs)

    def _init_process_group(self) -> None:
        DDPStrategy.setup_environment(self)  # the device, then the default process group

    def setup(self, trainer) -> None:
        # an fp8 LoRA base: kept out of the start-up broadcast (DDP's, or Lightning's when sampling): gloo cannot
        # send fp8, and every rank holds the same base already
        keep_float8_out_of_ddp(self.model)
        super().setup(trainer)
