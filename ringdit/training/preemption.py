"""Preemption: SIGTERM (SLURM, Kubernetes, ``kill``) stops every rank at the next optimizer step with a checkpoint.

Clusters send SIGTERM some seconds before SIGKILL. Lightning's own SIGTERM handling does collectives inside the
signal handler and ends the run with exit code 0, as if it had finished. Here the handler only sets a flag; at the end
of each optimizer step the ranks agree on it (one all-reduce of a flag: the signal may reach only some ranks, e.g.
only the launching process), all of them save ``last.ckpt`` of that step through the checkpoint callback and stop,
and the run exits with ``PREEMPTED_EXIT_CODE`` (143 = 128 + SIGTERM) and one line that says how to resume.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

import lightning as L

log = logging.getLogger("ringdit.train")

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # 143: what shells and schedulers read as "terminated by SIGTERM"
_LAUNCHER_PID = "RINGDIT_LAUNCHER_PID"  # set by the launching process; Lightning copies it into the ranks it spawns


class Preempted(Exception):
    """Every rank stopped at ``step`` after SIGTERM; ``checkpoint`` holds that step (None: nothing was saved)."""

    def __init__(self, step: int, checkpoint: str | None):
        super().__init__(f"stopped by SIGTERM at step {step}")
        self.step, self.checkpoint = step, checkpoint


_requested = False


def _on_sigterm(signum, frame) -> None:  # only a flag: the ranks act on it together, between two steps
    global _requested
    if not _requested:
        print(f"SIGTERM received (pid {os.getpid()}): stopping after this step with a checkpoint", file=sys.stderr,
              flush=True)
    _requested = True


def _install() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)


class StopOnSigterm(L.Callback):
    """Checks the SIGTERM flag on all ranks after every optimizer step; when any rank has it, saves ``last.ckpt``
    on all ranks and raises ``Preempted``. Costs one all-reduce of one number per step."""

    def __init__(self):
        self._last_step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        _install()  # again: Lightning put its own handler in place when fit() began
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._last_step:  # gradient accumulation: no optimizer step in this batch
            return
        self._last_step = trainer.global_step
        if not trainer.strategy.reduce_boolean_decision(_requested, all=False):
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


def _spawned_by_this_launcher() -> bool:
    """A rank that Lightning's launcher (our parent process) started, as opposed to rank 0 or a torchrun/SLURM rank."""
    return os.environ.get(_LAUNCHER_PID) == str(os.getppid())


@contextlib.contextmanager
def stop_on_sigterm(trainer: L.Trainer):
    """Run ``trainer.fit`` inside: adds ``StopOnSigterm``, handles SIGTERM from now on (also while ranks start), and
    turns ``Preempted`` into the log line and exit code. Ranks spawned by Lightning's launcher exit 0 (the launcher
    carries the run's exit code; a non-zero child would make Lightning kill the launcher before it has reported)."""
    _install()
    os.environ.setdefault(_LAUNCHER_PID, str(os.getpid()))
    trainer.callbacks.append(StopOnSigterm())
    try:
        yield
    except Preempted as stop:
        if _spawned_by_this_launcher():
            sys.exit(0)
        if trainer.is_global_zero:
            where = f"checkpoint {stop.checkpoint}" if stop.checkpoint else "no checkpoint (callbacks=none)"
            resume = f"resume with ckpt_path=last (or ckpt_path={stop.checkpoint})" if stop.checkpoint else \
                "nothing to resume from"
            log.warning("preempted: SIGTERM stopped every rank at step %d with %s; %s; exit code %d", stop.step,
                        where, resume, PREEMPTED_EXIT_CODE)
        _wait_for_spawned_ranks(trainer)
        sys.exit(PREEMPTED_EXIT_CODE)


def _wait_for_spawned_ranks(trainer: L.Trainer, timeout_s: float = 60.0) -> None:
    """The launcher leaves after the ranks it started, so nothing keeps writing once the job is reported done."""
    for proc in getattr(trainer.strategy.launcher, "procs", None) or []:
        with contextlib.suppress(Exception):
            proc.wait(timeout=timeout_s)
