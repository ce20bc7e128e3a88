"""Run a test function on several CPU ranks joined by a gloo process group."""

from __future__ import annotations

import datetime
import os
import random
import socket
import time
import traceback
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port for a rendezvous that nothing holds now and that nothing else takes before rank 0 listens on it: below
    Linux's ephemeral range (32768 and up), where the many connections of the other worker's gloo ranks take theirs
    (a port the kernel handed out free was once taken so, EADDRINUSE), in a stretch of its own for each xdist worker."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    start = 20000 + 1500 * (worker % 8)
    for port in random.Random().sample(range(start, start + 1500), 1500):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}-{start + 1499}")


def _entry(rank: int, fn, world_size: int, port: int, args: tuple, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # every rank done with the group before any rank tears it down
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


# The ranks are forked from a fork server that imported these once (per pytest worker), instead of each spawned
# rank importing torch, diffusers and ringdit again: that start-up was most of a short multi-rank test's time. The
# server runs no torch op, so no thread pool is forked. The last one does in the server what each forked rank would
# otherwise do again at its start (tests/forkserver_warmup.py).
PRELOAD = ["torch", "torch.distributed", "diffusers.models.transformers", "ringdit.attention", "ringdit.models",
           "ringdit.parallel", "lightning", "hydra", "ringdit.training.run", "ringdit.commands.sample", "tests.distributed",
           "tests.helpers", "tests.forkserver_warmup"]


def run_ranks(fn, world_size: int, *args) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` new processes; fail with the first rank's error.

    ``fn`` must be a module-level function (it is pickled into the processes).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call of this pytest process
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_entry, args=(fn, world_size, free_port(), args, errors), nprocs=world_size,
                           start_method="forkserver")
    except Exception as error:
        details = []
        while not errors.empty():
            rank, tb = errors.get()
            details.append(f"--- rank {rank} ---\n{tb}")
        raise AssertionError("\n".join(details) or str(error)) from None


# ---- train.py / infer.py on several ranks, forked as torchrun would start them -------------------------------------


def _command(rank: int, world_size: int | None, port: int, script: str, overrides: tuple, env: dict, results) -> None:
    """One process of ``python script overrides`` (``-m module``: ``python -m module overrides``): with a
    ``world_size``, rank ``rank`` as torchrun starts it (its rank in the environment, which Lightning's cluster
    environment, torchelastic's, reads, so that the run joins the others instead of spawning them); without, a run of
    its own, as a user starts one."""
    from tests.helpers import LAUNCH_VARIABLES, in_process

    for name in LAUNCH_VARIABLES:  # what an in-process run left in the server's environment (one port for all runs)
        os.environ.pop(name, None)
    os.environ.update(env)
    if world_size is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          GROUP_RANK="0", NODE_RANK="0", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                          TORCHELASTIC_RUN_ID="ringdit-tests")
    if "OMP_NUM_THREADS" in env:  # read by torch when it starts: this process (forked) has its server's pool
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    proc, _ = in_process(script, *overrides)
    results.put((rank, proc.returncode, proc.stdout, proc.stderr))


def _forked(script: str, overrides: tuple, count: int, world_size: int | None, env: dict, timeout: float,
            while_running: Callable[[list[int]], None] | None = None) -> list[SimpleNamespace]:
    """``count`` processes of ``python script overrides`` forked from the fork server (the imports paid once per pytest
    worker, not once per process and run), started together: each one's (``returncode``, ``stdout``, ``stderr``).
    ``while_running(pids)``, called once they have started, acts on them (a signal) before the wait."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results, port = ctx.SimpleQueue(), free_port()
    processes = [ctx.Process(target=_command, args=(i, world_size, port, script, overrides, env, results))
                 for i in range(count)]
    for process in processes:
        process.start()
    if while_running is not None:
        while_running([process.pid for process in processes])
    reports, deadline = {}, time.monotonic() + timeout
    while len(reports) < count and time.monotonic() < deadline:
        if not results.empty():
            i, *report = results.get()
            reports[i] = report
        elif not any(process.is_alive() for process in processes) and results.empty():
            break  # a process died without reporting
        else:
            time.sleep(0.05)
    for process in processes:
        process.join(timeout=max(1.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    return [SimpleNamespace(returncode=reports[i][0], stdout=reports[i][1], stderr=reports[i][2]) if i in reports else
            SimpleNamespace(returncode=processes[i].exitcode or 1, stdout="",
                            stderr=f"\nrank {i} ended without a report (exit code {processes[i].exitcode}; timeout "
                                   f"{timeout} s)") for i in range(count)]


def run_command_ranks(script: str, overrides: tuple, world_size: int, env: dict, timeout: float,
                      while_running: Callable[[list[int]], None] | None = None) -> SimpleNamespace:
    """``python script overrides`` on ``world_size`` ranks forked as torchrun starts them: (``returncode``,
    ``stdout``, ``stderr``) as one launch reports them -- the first failing rank's exit code, every rank's output,
    rank 0's first. ``while_running(pids)``: as for ``_forked``."""
    ranks = _forked(script, overrides, world_size, world_size, env, timeout, while_running)
    return SimpleNamespace(returncode=next((rank.returncode for rank in ranks if rank.returncode), 0),
                           stdout="".join(rank.stdout for rank in ranks), stderr="".join(rank.stderr for rank in ranks))


def run_commands_side_by_side(script: str, overrides: tuple, count: int, env: dict,
                              timeout: float) -> list[SimpleNamespace]:
    """``count`` separate runs of ``python script overrides`` started at the same moment, each a process of its
    own: each one's (``returncode``, ``stdout``, ``stderr``)."""
    return _forked(script, overrides, count, None, env, timeout)
