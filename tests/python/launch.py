"""Runs a test body on N processes joined by a gloo process group on 127.0.0.1."""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        fn(rank, world, *args)
        # Every rank done with every collective (torch's own included: DTensor's full_tensor
        # on sub-meshes) before any group is torn down: a gloo worker still holding work at
        # teardown aborts the process ('terminate called without an active exception').
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> None:
    """Calls ``fn(rank, world, *args)`` on ``world`` spawned processes; re-raises a failure."""
    mp.start_processes(_worker, args=(world, _free_port(), fn, args), nprocs=world, join=True, start_method="spawn")
