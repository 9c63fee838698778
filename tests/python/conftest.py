"""Shared helpers: an in-process communicator whose ranks are Python threads."""

from __future__ import annotations

import threading
from typing import Any, Callable, List

import pytest


class ThreadGroup:
    """State shared by the ranks of one in-process job."""

    def __init__(self, world: int, timeout: float = 30.0) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=timeout)
        self.slots: List[bytes] = [b""] * world


class ThreadComm:
    """A tessera communicator (rank, world_size, all_gather, broadcast) for one thread-rank."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def world_size(self) -> int:
        return self.group.world

    def all_gather(self, data: bytes) -> List[bytes]:
        g = self.group
        g.slots[self._rank] = bytes(data)
        g.barrier.wait()  # every contribution is in
        out = list(g.slots)
        g.barrier.wait()  # everyone has read before the next round writes
        return out

    def broadcast(self, data: bytes, root: int) -> bytes:
        return self.all_gather(data if self._rank == root else b"")[root]

    @staticmethod
    def group(world: int) -> List["ThreadComm"]:
        g = ThreadGroup(world)
        return [ThreadComm(g, r) for r in range(world)]


def run_ranks(world: int, fn: Callable[[ThreadComm], Any]) -> List[Any]:
    """Runs ``fn(comm)`` on ``world`` threads; returns each rank's result or raised exception."""
    comms = ThreadComm.group(world)
    results: List[Any] = [None] * world

    def body(comm: ThreadComm) -> None:
        try:
            results[comm.rank()] = fn(comm)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            results[comm.rank()] = e

    threads = [threading.Thread(target=body, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def run_ranks_ok(world: int, fn: Callable[[ThreadComm], Any]) -> List[Any]:
    """Like :func:`run_ranks`, re-raising the first rank's exception."""
    results = run_ranks(world, fn)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.fixture
def ranks():
    """``ranks(world, fn)``: run ``fn(comm)`` per rank, return results (exceptions re-raised)."""
    return run_ranks_ok


@pytest.fixture
def ranks_raw():
    """``ranks_raw(world, fn)``: run ``fn(comm)`` per rank, return results or exceptions."""
    return run_ranks
