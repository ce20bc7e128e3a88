"""Preemption: SIGTERM (SLURM, Kubernetes, ``kill``) stops every rank at the next step boundary, keeping the work.

Clusters send SIGTERM some seconds before SIGKILL. Lightning's own SIGTERM handling does collectives inside the
signal handler and ends the run with exit code 0, as if it had finished. Here the handler only sets a flag; at each
step boundary the ranks agree on it (one all-reduce through the strategy: the signal may reach only some ranks, e.g.
only the launching process), all of them keep what is finished and stop together, and the run exits with
``PREEMPTED_EXIT_CODE`` (143 = 128 + SIGTERM) and one line that says what was kept and how to go on:

- training (``trainer.fit``): after each optimizer step; every rank saves ``last.ckpt`` of that step.
- sampling (``trainer.predict``): before each model forward (each sampler step) and each batch; the finished batches
  are written by the prediction writer (``on_exception`` with ``Preempted``, e.g. ``ringdit.sampling.SampleWriter``).
  Data-parallel ranks can have a batch more than others: a rank that is done keeps voting until all are.
- work of one process alone, where stopping anywhere loses nothing that is kept (loading models, encoding a shard
  that is written only when complete, decoding files that can be decoded again): ``sigterm_stops_at_once`` stops it
  where it is, except inside ``sigterm_waits`` (writing a file), which finishes first.

The flag, ``Preempted``, stopping at once and ``handling_sigterm`` are ``ringdit.commands.sigterm``'s (no torch: a
command checks its settings before torch loads); this module adds the ranks' step boundary, for a trainer's work.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path
from typing import Callable

import lightning as L
import torch

from ringdit.commands.launcher import mark_launcher, unmark_launcher
# the SIGTERM core (no torch), named here too for the code that stops work of one process
from ringdit.commands.sigterm import (PREEMPTED_EXIT_CODE, Preempted, SigtermScope, _install, _on_sigterm,  # noqa: F401
                                      handling_sigterm, requested, sigterm_stops_at_once, sigterm_waits,
                                      stop_if_sigterm)

log = logging.getLogger("ringdit.train")


def _vote(strategy, working: bool = True) -> tuple[bool, bool]:
    """One reduce over every rank through the strategy (DDP / FSDP: a barrier and an all-reduce, ~0.6 ms with gloo
    on 2 CPU ranks): (has any rank had SIGTERM, is any rank still working)."""
    votes = torch.tensor([int(requested()), int(working)], device=strategy.root_device)
    votes = strategy.reduce(votes, reduce_op="sum")  # a single process: as it is
    return bool(votes[0] > 0), bool(votes[1] > 0)


class StopOnSigterm(L.Callback):
    """Checks the SIGTERM flag on all ranks after every optimizer step (training) and before every batch and model
    forward (sampling); when any rank has it, every rank stops with ``Preempted`` at the same point. Training saves
    ``last.ckpt`` first; sampling leaves the finished batches to the writer's ``on_exception``. Costs one all-reduce
    of two numbers per step."""

    def __init__(self):
        self._last_step = -1
        self._hook, self._joined = None, False

    # ---- training -------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        _install()  # again: Lightning put its own handler in place when fit() began (see keep_sigterm_handler)
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._last_step:  # gradient accumulation: no optimizer step in this batch
            return
        self._last_step = trainer.global_step
        if not _vote(trainer.strategy)[0]:
            return
        checkpoint = trainer.checkpoint_callback
        path = None
        if checkpoint is not None and checkpoint.dirpath:
            path = str(Path(checkpoint.dirpath) / f"{checkpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}")
            if checkpoint.save_last:
                checkpoint._save_last_checkpoint(trainer, checkpoint._monitor_candidates(trainer))
                path = checkpoint.last_model_path or path
            else:
                trainer.save_checkpoint(path)
        raise Preempted(trainer.global_step, path)

    # ---- sampling -------------------------------------------------------------------------------------------------
    def on_predict_start(self, trainer: L.Trainer, pl_module) -> None:
        _install()
        self._joined = False
        model = getattr(pl_module, "model", None)  # a SamplingModule's (built by now)
        if isinstance(model, torch.nn.Module):  # each sampler step calls the model: a step boundary on every rank
            self._hook = model.register_forward_pre_hook(lambda module, args: self._check(trainer))
        if _last_batch(trainer) == (-1, -1):  # no batch on this rank
            self._join(trainer)

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._check(trainer)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if (dataloader_idx, batch_idx) == _last_batch(trainer):  # after the writers before it have its samples
            self._join(trainer)

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module) -> None:
        self._join(trainer)  # batch counts unknown (an iterable dataset): here

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._unhook()

    def _check(self, trainer: L.Trainer) -> None:
        if _vote(trainer.strategy)[0]:
            self._unhook()
            raise Preempted(what=_sampling(trainer))

    def _join(self, trainer: L.Trainer) -> None:
        """This rank's batches are done, but a data-parallel rank may have one more: vote with it (as done) until
        every rank is done, so that each vote of the others has its partner here; or stop with them."""
        self._unhook()
        if self._joined:
            return
        self._joined = True
        while True:
            stop, working = _vote(trainer.strategy, working=False)
            if stop:
                raise Preempted(what=_sampling(trainer))
            if not working:
                return

    def _unhook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _sampling(trainer: L.Trainer) -> str:
    return "sampling on every rank" if trainer.world_size > 1 else "sampling"


def _last_batch(trainer: L.Trainer) -> tuple[int, int] | None:
    """(dataloader, batch) of this rank's last prediction batch; (-1, -1) for none; None when not known."""
    counts = list(trainer.num_predict_batches or [])
    if any(count == float("inf") for count in counts):
        return None
    filled = [i for i, count in enumerate(counts) if count > 0]
    return (filled[-1], int(counts[filled[-1]]) - 1) if filled else (-1, -1)


def keep_sigterm_handler(trainer: L.Trainer, install: Callable[[], None] = _install) -> None:
    """Lightning installs its SIGTERM handler (collectives inside a signal handler; under DDP it kills the other
    ranks) just before the loop starts; ``install`` ours back at once, so that no SIGTERM meets its handler in
    between (before the first step)."""
    connector = getattr(trainer, "_signal_connector", None)
    register = getattr(connector, "register_signal_handlers", None)
    if register is None or getattr(register, "_ringdit", False):
        return

    def register_then_ours() -> None:
        register()
        install()

    register_then_ours._ringdit = True
    connector.register_signal_handlers = register_then_ours


@contextlib.contextmanager
def stop_on_sigterm(trainer: L.Trainer | None = None, logger: logging.Logger | None = None):
    """Run ``trainer.fit`` / ``trainer.predict`` inside (or, without a trainer, work of one process that uses
    ``sigterm_stops_at_once`` / ``stop_if_sigterm``): ``handling_sigterm`` with the trainer's ranks stopping together
    (``stop_ranks_together``). The commands get this from their wrapper (``ringdit.commands.task``)."""
    with handling_sigterm(logger or log) as scope:
        if trainer is not None:
            stop_ranks_together(scope, trainer)
        yield scope


def stop_ranks_together(scope: SigtermScope, trainer: L.Trainer) -> None:
    """From now on in ``scope``, SIGTERM sets the flag that ``StopOnSigterm`` (added to ``trainer``) has every rank act
    on at its next step boundary; global rank 0 writes the line, after the ranks it spawned have ended. The ranks this
    process spawns know it for their launcher until the scope ends."""
    if mark_launcher():  # a train.py this process starts later launches its own ranks (it exited 0 on SIGTERM, as a
        scope.on_leave.append(unmark_launcher)  # rank)
    trainer.callbacks.append(StopOnSigterm())
    keep_sigterm_handler(trainer)
    scope.reports = lambda: trainer.is_global_zero
    scope.before_exit.append(lambda: _wait_for_spawned_ranks(trainer))


def drain_on_sigterm(trainer: L.Trainer, drain: Callable[[], None]) -> None:
    """From now on (until the scope ends), SIGTERM calls ``drain`` instead (a server finishes its running batch and
    exits 0), Lightning's handler kept away from ``trainer``'s run."""

    def install() -> None:
        if threading.current_thread() is threading.main_thread():  # elsewhere Python refuses handlers
            signal.signal(signal.SIGTERM, lambda *_: drain())

    install()
    keep_sigterm_handler(trainer, install)  # not Lightning's: under DDP it would kill the other ranks at once


def _wait_for_spawned_ranks(trainer: L.Trainer, timeout_s: float = 60.0) -> None:
    """The launcher leaves after the ranks it started, so nothing keeps writing once the job is reported done."""
    for proc in getattr(trainer.strategy.launcher, "procs", None) or []:
        with contextlib.suppress(Exception):
            proc.wait(timeout=timeout_s)
