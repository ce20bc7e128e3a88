"""Lightning integration: the module, the ring-DDP strategy, callbacks, loggers, schedules, checkpoint IO."""

from ringdit.training.callbacks import SampleGrid
from ringdit.training.checkpoint_io import AtomicCheckpointIO
from ringdit.training.loggers import wandb_logger
from ringdit.training.module import DiTModule
from ringdit.training.schedules import WarmupCosine, warmup_cosine
from ringdit.training.strategy import RingDDPStrategy

__all__ = ["AtomicCheckpointIO", "DiTModule", "RingDDPStrategy", "SampleGrid", "WarmupCosine", "wandb_logger",
           "warmup_cosine"]
