"""Which process this is: the one that launched the run, a rank Lightning's launcher spawned, or a rank of an
external launcher (torchrun, SLURM, MPI).

Lightning starts the other ranks of a CPU / single-node run by executing ``train.py`` / ``infer.py`` again with the
same command line; those ranks pass the same checks and build the same objects. The launching process marks itself
(``mark_launcher``: ``RINGDIT_LAUNCHER_PID``, which the spawned ranks inherit), so that one-off work done before
spawning (scanning every value of the data, claiming the run folder) is not repeated in each rank, and so that a
spawned rank can leave the run's exit code to its launcher.
"""

from __future__ import annotations

import os

LAUNCHER_PID = "RINGDIT_LAUNCHER_PID"

# Set (to this process's rank) by whatever started the ranks: Lightning's launcher, torchrun, SLURM, MPI.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                   "JSM_NAMESPACE_RANK")


def mark_launcher() -> bool:
    """Called by the launching process before Lightning spawns the other ranks (a spawned rank keeps the mark).
    True when this call set the mark: its run must take it away when it ends (``unmark_launcher``), or a train.py
    that this process starts later (a notebook after ``ringdit.train``) would take itself for a rank of this one."""
    if LAUNCHER_PID in os.environ:
        return False
    os.environ[LAUNCHER_PID] = str(os.getpid())
    return True


def unmark_launcher() -> None:
    """The launching process's run has ended: it launches no ranks any more."""
    os.environ.pop(LAUNCHER_PID, None)


def spawned_by_launcher() -> bool:
    """A rank that Lightning's launcher (this process's parent) started, as opposed to the launcher itself or a
    torchrun / SLURM rank."""
    return os.environ.get(LAUNCHER_PID) == str(os.getppid())


def first_process() -> bool:
    """Global rank 0 of the job, before any process group exists: no launcher has given this process another rank."""
    return all(os.environ.get(name, "0") == "0" for name in _RANK_VARIABLES)
