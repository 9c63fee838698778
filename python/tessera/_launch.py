"""One launcher for tessera's multi-process tests, benchmarks and interop scripts: ``world``
spawned processes joined by a gloo process group on 127.0.0.1 (a free port), each calling
``fn(rank, world, *args)``. Not API: torch's ``torchrun`` is how users launch.

Every rank finishes every collective (torch's own included: DTensor's ``full_tensor`` on
sub-meshes) at one barrier before any group is torn down: a gloo worker still holding work at
teardown aborts the process ('terminate called without an active exception').
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> None:
    """Calls ``fn(rank, world, *args)`` on ``world`` spawned processes (``fn`` importable by
    name: a module-level function); re-raises the first failure."""
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(world, free_port(), fn, args), nprocs=world, join=True, start_method="spawn")
