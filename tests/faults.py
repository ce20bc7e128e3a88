"""Faults to inject into real runs from the command line (Hydra targets), for the reliability tests."""

from __future__ import annotations

import os
import signal
import time

import lightning as L
from torch.utils.data import Dataset

from ringdit.data import DigitsDataModule


class SlowSteps(L.Callback):
    """Sleep after every step, so a test can kill a run between two known points."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.seconds)


class _Failing(Dataset):
    def __init__(self, dataset: Dataset, after: int):
        self.dataset, self.after, self.reads = dataset, after, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        self.reads += 1
        if self.reads > self.after:
            raise OSError(f"injected data-loading fault after {self.after} reads")
        return self.dataset[index]


class FailingDigitsDataModule(DigitsDataModule):
    """The digits, whose loading fails on global rank ``fail_rank`` after ``after`` samples."""

    def __init__(self, fail_rank: int, after: int = 40, **kwargs):
        super().__init__(**kwargs)
        self.fail_rank, self.after = fail_rank, after

    def setup(self, stage=None) -> None:
        super().setup(stage)
        if self.trainer is not None and self.trainer.global_rank == self.fail_rank:
            self.train_set = _Failing(self.train_set, self.after)


class SignalAtStep(L.Callback):
    """A real signal (``sig``: SIGTERM, as a scheduler's would come, or SIGKILL) to this process on global rank
    ``rank`` once training has finished step ``step`` (after that step's checkpoint, which the checkpoint callback
    writes later in the same hook, for SIGTERM; before it for SIGKILL, whose process ends at once). For runs in the
    test's own processes: SIGTERM needs ``ringdit.commands.preemption`` handling it (else it would end the test's process)."""

    def __init__(self, rank: int, step: int, sig: str = "SIGTERM"):
        self.rank, self.step, self.sig = rank, step, getattr(signal, sig)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            if self.sig == signal.SIGTERM:
                from ringdit.commands import preemption

                assert signal.getsignal(signal.SIGTERM) is preemption._on_sigterm, "SIGTERM is not handled here"
            os.kill(os.getpid(), self.sig)


def save_a_big_checkpoint(path: str) -> None:
    """Write a 600 MB checkpoint to ``path`` through the training's atomic writer: seconds to write, time to kill the
    process in the middle (ones: no time spent drawing it)."""
    import torch

    from ringdit.training.checkpoint_io import AtomicCheckpointIO

    AtomicCheckpointIO().save_checkpoint({"step": 2, "w": torch.ones(150_000_000)}, path)
