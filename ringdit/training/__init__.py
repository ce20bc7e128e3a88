"""Lightning integration: the module, the ring-DDP strategy, callbacks, loggers, schedules, checkpoint IO."""

import warnings

# Lightning 2.6 on torch 2.13 warns about its own pytree use on every step; nothing for users to act on.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
# StepBatches gives every DataLoader worker its own steps, so its __len__ is exact with any num_workers...
warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
# ...and it starts at the checkpoint's step, so resuming mid-epoch reads exactly the uninterrupted run's batches.
warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended")

from ringdit.training.callbacks import SampleGrid, StepCheckpoint
from ringdit.training.fsdp import RingFSDPStrategy
from ringdit.training.checkpoint_io import AtomicCheckpointIO
from ringdit.training.distillation_module import DistillationModule
from ringdit.training.loggers import wandb_logger
from ringdit.training.module import DiffusionModule, NonFiniteLossError
from ringdit.training.schedules import WarmupCosine, warmup_cosine
from ringdit.training.strategy import RingDDPStrategy

from ringdit.training import module  # (loaded above) where __getattr__ finds the deprecated name DiTModule

__all__ = ["AtomicCheckpointIO", "DiffusionModule", "DistillationModule", "NonFiniteLossError", "RingDDPStrategy", "RingFSDPStrategy",
           "SampleGrid", "StepCheckpoint", "WarmupCosine", "wandb_logger", "warmup_cosine"]


def __getattr__(name: str):
    if name == "DiTModule":  # the deprecated name (ringdit.training.module says so when it is used)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
