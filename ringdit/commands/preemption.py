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
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Callable

import lightning as L
import torch

from ringdit.commands.launcher import mark_launcher, spawned_by_launcher, unmark_launcher

log = logging.getLogger("ringdit.train")

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # 143: what shells and schedulers read as "terminated by SIGTERM"


class Preempted(BaseException):
    """Every rank stopped after SIGTERM where nothing was half-written. A ``BaseException``, as KeyboardInterrupt:
    code that catches ``Exception`` (e.g. to skip an unreadable file) must not take it for a failure of its own.

    Training: at optimizer ``step``; ``checkpoint`` holds that step (None: nothing was saved). Elsewhere: ``what`` was
    stopped, and ``kept`` says what was kept (one phrase of the log line); whoever keeps the work may fill it in, as
    the prediction writer does in ``on_exception``."""

    def __init__(self, step: int | None = None, checkpoint: str | None = None, *, what: str = "training",
                 kept: str | Callable[[], str] | None = None):
        super().__init__(f"stopped by SIGTERM at step {step}" if step is not None else f"{what} stopped by SIGTERM")
        self.step, self.checkpoint, self.what, self.kept = step, checkpoint, what, kept

    def report(self) -> str:
        if self.step is not None:
            where = f"checkpoint {self.checkpoint}" if self.checkpoint else "no checkpoint (callbacks=none)"
            resume = f"resume with ckpt_path=last (or ckpt_path={self.checkpoint})" if self.checkpoint else \
                "nothing to resume from"
            return f"preempted: SIGTERM stopped every rank at step {self.step} with {where}; {resume}; exit code " \
                   f"{PREEMPTED_EXIT_CODE}"
        kept = self.kept() if callable(self.kept) else self.kept
        return f"preempted: SIGTERM stopped {self.what}; {kept or 'nothing was kept'}; exit code {PREEMPTED_EXIT_CODE}"


_requested = False
_at_once: tuple[str, str | Callable[[], str]] | None = None  # (what, kept) while SIGTERM stops this process at once


def _on_sigterm(signum, frame) -> None:  # a flag: the ranks act on it together, at a step boundary
    global _requested
    first, _requested = not _requested, True
    if _at_once is not None and first:  # work of this process alone, nothing half-kept: stop right here (once)
        raise Preempted(what=_at_once[0], kept=_at_once[1])
    if first:
        print(f"SIGTERM received (pid {os.getpid()}): stopping at the next step, keeping what is finished",
              file=sys.stderr, flush=True)


def _install() -> None:
    if threading.current_thread() is threading.main_thread():  # elsewhere Python refuses handlers: none then
        signal.signal(signal.SIGTERM, _on_sigterm)


def stop_if_sigterm(what: str, kept: str | Callable[[], str]) -> None:
    """A boundary of work that is this process's alone (no other rank waits on it): stop here after SIGTERM."""
    if _requested:
        raise Preempted(what=what, kept=kept)


@contextlib.contextmanager
def sigterm_stops_at_once(what: str, kept: str | Callable[[], str]):
    """Inside (in ``stop_on_sigterm``), SIGTERM stops this process where it is: for work of this process alone that
    keeps nothing half-done (``kept``: what is kept then; a callable is asked when the line is written). Writing a
    file goes in ``sigterm_waits``."""
    global _at_once
    stop_if_sigterm(what, kept)
    outer, _at_once = _at_once, (what, kept)
    try:
        yield
    finally:
        _at_once = outer


@contextlib.contextmanager
def sigterm_waits():
    """A part that must not be cut short (writing a file): a SIGTERM that comes meanwhile stops the process right
    after it (inside ``sigterm_stops_at_once``; elsewhere, at the next step boundary as always)."""
    global _at_once
    held, _at_once = _at_once, None
    try:
        yield
    finally:
        _at_once = held
    if held is not None:
        stop_if_sigterm(*held)


def _vote(strategy, working: bool = True) -> tuple[bool, bool]:
    """One reduce over every rank through the strategy (DDP / FSDP: a barrier and an all-reduce, ~0.6 ms with gloo
    on 2 CPU ranks): (has any rank had SIGTERM, is any rank still working)."""
    votes = torch.tensor([int(_requested), int(working)], device=strategy.root_device)
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
    ``sigterm_stops_at_once`` / ``stop_if_sigterm``): adds ``StopOnSigterm``, handles SIGTERM from now on (also while
    ranks start), and turns ``Preempted`` into the log line and exit code 143. Ranks spawned by Lightning's launcher
    exit 0 (the launcher carries the run's exit code; a non-zero child would make Lightning kill the launcher before
    it has reported). A SIGTERM after the last step boundary stops nothing: the work has finished, exit code 0 (with
    a line that says so). On leaving, the previous SIGTERM handler is back."""
    global _requested, _at_once
    previous = signal.getsignal(signal.SIGTERM)
    _install()
    marked = False
    if trainer is not None:
        marked = mark_launcher()
        trainer.callbacks.append(StopOnSigterm())
        keep_sigterm_handler(trainer)
    try:
        yield
        if _requested:
            (logger or log).warning("SIGTERM came after the last step boundary: the work had finished, nothing was "
                                    "stopped")
    except Preempted as stop:
        if spawned_by_launcher():
            sys.exit(0)
        if trainer is None or trainer.is_global_zero:
            (logger or log).warning(stop.report())
        if trainer is not None:
            _wait_for_spawned_ranks(trainer)
        sys.exit(PREEMPTED_EXIT_CODE)
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        _requested, _at_once = False, None
        if marked:  # a train.py this process starts later launches its own ranks (it exited 0 on SIGTERM, as a rank)
            unmark_launcher()


def _wait_for_spawned_ranks(trainer: L.Trainer, timeout_s: float = 60.0) -> None:
    """The launcher leaves after the ranks it started, so nothing keeps writing once the job is reported done."""
    for proc in getattr(trainer.strategy.launcher, "procs", None) or []:
        with contextlib.suppress(Exception):
            proc.wait(timeout=timeout_s)
