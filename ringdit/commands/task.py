"""The wrapper every ringdit command runs in, as lightning-hydra-template's ``task_wrapper``: train, infer, serve,
prepare, export, plan, decode and calibrate each write only their own work,

    @command("plan", doing="planning")      # conf/plan.yaml; ``doing``: what a SIGTERM line says it stopped
    def plan(cfg, task):
        ...                                  # check the settings (a ValueError here: one line, exit code 2)
        task.start()                         # the work begins
        ...

and the wrapper owns, alike for all of them:

- the settings phase: until ``task.start()``, a ``ValueError`` / ``TypeError`` / ``FileNotFoundError`` / Hydra
  instantiation error is a mistake in the settings: its one line and exit code 2 (``HYDRA_FULL_ERROR=1``: the
  traceback); after it, only the kinds ``start(errors=...)`` names (training's non-finite loss, a full disk) -- anything
  else is a fault and keeps its traceback. Hydra's own mistakes are ``ringdit.commands.cli.hydra_main``'s.
- SIGTERM, from the first line of the task to its last: work of this process alone stops where it is, with one line
  that says what it stopped and what was kept (``task.stopping``; a command with nothing to lose: "nothing to keep")
  and exit code 143; a trainer's ranks (``start(trainer=...)``) stop together at their next step boundary, keeping
  what is finished (``ringdit.commands.preemption``); a server drains instead (``start(drain=...)``).
- the run folder of the commands that keep their records in one (train, infer, serve: ``task.claim``): refused when
  it holds a run, marked as this run's (``ringdit.commands.run_folder``), and logged. The others write only their
  ``out=``, which refuses to replace what is there unless ``overwrite=true`` (``ringdit.checkpoints.location``).
- the loggers' teardown: the wandb runs of ``start(loggers=...)`` (and those added to ``task.loggers`` later) are
  finished in a ``finally``, so that a run that fails or is stopped leaves complete files (offline: ready for
  ``wandb sync``) and the next run in this process gets a run of its own.

The Python API (``ringdit.train`` / ``sample`` / ``serve``) runs the same task (``entry.run(cfg)``), a settings
mistake raised (a ``ConfigError``) instead of ending the process.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Callable

from omegaconf.errors import OmegaConfBaseException

from ringdit.commands.cli import SETTINGS_ERRORS, exit_with_one_line, hydra_main
from ringdit.commands.launcher import first_process
from ringdit.commands.run_folder import claim_run_folder
from ringdit.commands.sigterm import SigtermScope, handling_sigterm, stop_at_once_from_now

NOTHING_TO_KEEP = "nothing to keep"


class Task:
    """One run of a command, as its work tells the wrapper what it does (see the module's docstring)."""

    def __init__(self, name: str, *, one_line: bool):
        self.name = name
        self.errors: tuple[type[BaseException], ...] = SETTINGS_ERRORS if one_line else ()
        self.loggers: list = []  # finished in the wrapper's ``finally``
        self.scope: SigtermScope | None = None  # the wrapper's, while the work runs

    def claim(self, run_folder: str | Path, *, resumes: str | None = None) -> None:
        """This run's folder: refused (a settings error) when it holds a run of this command, unless ``resumes`` (a
        checkpoint) lies in it; marked as this run's otherwise. Call it once every other check has passed."""
        claim_run_folder(run_folder, self.name, resumes=resumes)
        if first_process():
            self.scope.logger.info("%s: run folder %s", self.name, Path(run_folder).expanduser().resolve())

    def stopping(self, what: str, kept: str | Callable[[], str] | None = None) -> None:
        """From now on, SIGTERM stops this process where it is, saying it stopped ``what`` and kept ``kept`` (a
        callable: asked when the line is written)."""
        stop_at_once_from_now(what, kept)

    def start(self, *, trainer=None, loggers=(), errors: tuple[type[BaseException], ...] = (),
              drain: Callable[[], None] | None = None) -> None:
        """The settings are checked; the work begins. From now on only ``errors`` end in one line (exit code 2);
        ``loggers``' wandb runs are finished whatever happens; SIGTERM stops ``trainer``'s ranks together at their
        next step boundary, or calls ``drain`` (with ``trainer``: Lightning's own handler kept away), or else still
        stops this process at once."""
        self.errors = tuple(errors)
        self.loggers.extend(loggers)
        if trainer is None and drain is None:
            return
        # start-up time: Lightning (the trainer's stops) loads only for the commands that run a trainer, which have
        # loaded it by now; the others check their settings and stop on SIGTERM without it
        from ringdit.commands.preemption import drain_on_sigterm, stop_ranks_together

        stop_at_once_from_now(None)  # the signal is a flag from here on: the ranks, or the drain, act on it
        if drain is not None:
            drain_on_sigterm(trainer, drain)
        else:
            stop_ranks_together(self.scope, trainer)


def run_task(work: Callable, cfg, *, name: str, doing: str, kept: str = NOTHING_TO_KEEP, one_line: bool):
    """``work(cfg, task)`` in the wrapper; its result. ``one_line``: the command line's (a settings mistake ends the
    process with its one line, exit code 2), else the Python API's (it is raised)."""
    task = Task(name, one_line=one_line)
    try:
        with handling_sigterm(logging.getLogger(f"ringdit.{name}")) as task.scope:
            task.stopping(doing, kept)  # the settings phase: nothing is written yet
            return work(cfg, task)
    except Exception as error:  # noqa: BLE001 - what is not the user's to fix is raised again, in full
        # OmegaConf's own (a value that does not resolve) are hydra_main's, which names the key
        if isinstance(error, task.errors) and not isinstance(error, OmegaConfBaseException):
            exit_with_one_line(error)
        raise
    finally:  # after the SIGTERM handler is back, as the process ends: failed, stopped (exit 143) or done
        finish_runs(task.loggers)


def finish_runs(loggers) -> None:
    """End the wandb runs ``loggers`` opened in this process: their files are complete on disk (offline: ready for
    ``wandb sync``), and a next run in the same process (a notebook's second ``ringdit.train``) starts its own run
    instead of logging into this one (wandb keeps one run per process until it is finished)."""
    if not loggers:
        return
    # start-up time: Lightning loads only for the commands that made loggers (which have loaded it by then)
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger._experiment.finish()


def command(name: str, *, doing: str, kept: str = NOTHING_TO_KEEP):
    """``@command("train", doing="training")``: ``work(cfg, task)`` as the command configured by ``conf/<name>.yaml``
    (``hydra_main``), run in the wrapper; ``kept``: what a SIGTERM keeps until the work says otherwise. The result,
    ``entry(argv=None)``, also has ``entry.run(cfg)``: the same task for the Python API."""

    def decorator(work: Callable):
        @functools.wraps(work)
        def task(cfg):
            return run_task(work, cfg, name=name, doing=doing, kept=kept, one_line=True)

        entry = hydra_main(name)(task)
        entry.run = functools.partial(run_task, work, name=name, doing=doing, kept=kept, one_line=False)
        return entry

    return decorator
