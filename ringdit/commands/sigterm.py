"""SIGTERM for work of any kind, without torch or Lightning (a command's settings are checked before they load):
the flag the signal sets, the ``Preempted`` stop and its one line, stopping at once where nothing is half-kept, and
``handling_sigterm``, the scope every command runs in (``ringdit.commands.task``). The ranks of a trainer stopping
together at a step boundary is ``ringdit.commands.preemption``'s, which builds on this.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Callable

from ringdit.commands.launcher import spawned_by_launcher

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


def requested() -> bool:
    """Whether SIGTERM has come in this scope (``StopOnSigterm`` votes on it at each step boundary)."""
    return _requested


def stop_at_once_from_now(what: str | None, kept: str | Callable[[], str] | None = None) -> None:
    """For the rest of the scope (``handling_sigterm``): SIGTERM stops this process where it is, saying ``what`` was
    stopped and ``kept`` (None: nothing was kept); ``what=None``: it only sets the flag, for the ranks to act on at
    their next step boundary (``ringdit.commands.preemption.StopOnSigterm``)."""
    global _at_once
    _at_once = None if what is None else (what, kept)
    if _at_once is not None:
        stop_if_sigterm(*_at_once)


class SigtermScope:
    """What ``handling_sigterm`` does when the work is stopped, filled in by whoever runs the work: whether this
    process writes the line (``reports``: a trainer's global rank 0), what to wait for before exiting
    (``before_exit``: the ranks it spawned) and what to undo on leaving (``on_leave``: the launcher mark)."""

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self.reports: Callable[[], bool] = lambda: True
        self.before_exit: list[Callable[[], None]] = []
        self.on_leave: list[Callable[[], None]] = []


@contextlib.contextmanager
def handling_sigterm(logger: logging.Logger):
    """Handle SIGTERM from now on and turn ``Preempted`` into its one line (``logger``) and exit code 143; yields the
    ``SigtermScope``. Ranks spawned by Lightning's launcher exit 0 (the launcher carries the run's exit code; a
    non-zero child would make Lightning kill the launcher before it has reported). A SIGTERM after the last step
    boundary stops nothing: the work has finished, exit code 0 (with a line that says so). On leaving, the previous
    SIGTERM handler is back."""
    global _requested, _at_once
    previous = signal.getsignal(signal.SIGTERM)
    _install()
    scope = SigtermScope(logger)
    try:
        yield scope
        if _requested:
            logger.warning("SIGTERM came after the last step boundary: the work had finished, nothing was stopped")
    except Preempted as stop:
        if spawned_by_launcher():
            sys.exit(0)
        if scope.reports():
            logger.warning(stop.report())
        for wait in scope.before_exit:
            wait()
        sys.exit(PREEMPTED_EXIT_CODE)
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        _requested, _at_once = False, None
        for leave in scope.on_leave:
            leave()
