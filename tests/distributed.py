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


def run_ranks(fn, world_size: int, *args) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; fail with the first rank's error.

    ``fn`` must be a module-level function (it is pickled into the spawned processes).
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_entry, args=(fn, world_size, free_port(), args, errors), nprocs=world_size, start_method="spawn")
    except Exception as error:
        details = []
        while not errors.empty():
            rank, tb = errors.get()
            details.append(f"--- rank {rank} ---\n{tb}")
        raise AssertionError("\n".join(details) or str(error)) from None
