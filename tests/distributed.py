"""Run a test function on several CPU ranks joined by a gloo process group."""

from __future__ import annotations

import datetime
import os
import socket
import traceback

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
PRELOAD = ["torch", "torch.distributed", "diffusers.models.transformers", "ringdit.attention", "ringdit.models", "ringdit.parallel",
           "tests.distributed"]


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
