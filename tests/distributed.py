"""Run a test function on several CPU ranks joined by a gloo process group."""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
# server runs no torch op, so no thread pool is forked.
PRELOAD = ["torch", "torch.distributed", "diffusers.models.transformers", "ringdit.attention", "ringdit.models",
           "ringdit.parallel", "lightning", "hydra", "ringdit.training.run", "ringdit.inference", "tests.distributed",
           "tests.helpers"]


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


def _command_rank(rank: int, world_size: int, port: int, script: str, overrides: tuple, env: dict, results) -> None:
    """One rank of ``python script overrides`` (``-m module``: ``python -m module overrides``), as torchrun starts
    it: its rank in the environment, Lightning's cluster environment (torchelastic's) reads it, and the run joins the
    others instead of spawning them."""
    from tests.helpers import in_process

    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      GROUP_RANK="0", NODE_RANK="0", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      TORCHELASTIC_RUN_ID="ringdit-tests")
    if "OMP_NUM_THREADS" in env:  # read by torch when it starts: this process (forked) has its server's pool
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    proc, _ = in_process(script, *overrides)
    results.put((rank, proc.returncode, proc.stdout, proc.stderr))


def run_command_ranks(script: str, overrides: tuple, world_size: int, env: dict, timeout: float) -> SimpleNamespace:
    """``python script overrides`` on ``world_size`` ranks forked from the fork server (the imports paid once per
    pytest worker, not once per rank and run): (``returncode``, ``stdout``, ``stderr``) as one launch reports them --
    the first failing rank's exit code, every rank's output, rank 0's first."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results, port = ctx.SimpleQueue(), free_port()
    ranks = [ctx.Process(target=_command_rank, args=(rank, world_size, port, script, overrides, env, results))
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    reports, deadline = {}, time.monotonic() + timeout
    while len(reports) < world_size and time.monotonic() < deadline:
        if not results.empty():
            rank, *report = results.get()
            reports[rank] = report
        elif not any(process.is_alive() for process in ranks) and results.empty():
            break  # a rank died without reporting
        else:
            time.sleep(0.05)
    for process in ranks:
        process.join(timeout=max(1.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    codes = [reports[rank][0] if rank in reports else (ranks[rank].exitcode or 1) for rank in range(world_size)]
    missing = [rank for rank in range(world_size) if rank not in reports]
    stdout = "".join(reports[rank][1] for rank in sorted(reports))
    stderr = "".join(reports[rank][2] for rank in sorted(reports)) + "".join(
        f"\nrank {rank} ended without a report (exit code {ranks[rank].exitcode}; timeout {timeout} s)" for rank in missing)
    return SimpleNamespace(returncode=next((code for code in codes if code), 0), stdout=stdout, stderr=stderr)
