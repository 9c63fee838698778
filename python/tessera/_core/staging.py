"""Staging memory of async saves: the page-locked pool for device-to-host copies and the
saver that owns a process's staging memory and commit channel (one per live process group).

The staging sequence every async save runs (pin, copy, synchronise, start, give back) is
``tessera._core.io.save``'s; this module holds the memory it uses.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple, cast

from .. import _native
from .comm import commit_comm, initialized_dist

__all__ = ["DEFAULT_STAGING_BUDGET", "PinnedPool", "AsyncSaver", "default_saver", "background_comm"]

#: Most staging memory the saver created on first use takes, per process: it is sized to the
#: first save's tensor bytes up to this cap (``TESSERA_STAGING_BUDGET``, in bytes, sets the
#: budget exactly). A state larger than the budget is staged in waves.
DEFAULT_STAGING_BUDGET = 4 << 30


class PinnedPool:
    """Reusable page-locked host tensors for CUDA device-to-host copies, keyed by size.

    Pinned memory is slow to allocate and register, so each buffer is kept for the next save;
    a save takes at most one buffer per tensor and gives them all back when it is staged.
    """

    def __init__(self, pin: bool = True) -> None:
        self._pin = pin
        self._free: Dict[Tuple[int, Any], List[Any]] = {}
        self._lent: List[Tuple[Tuple[int, Any], Any]] = []

    def take(self, numel: int, dtype: Any) -> Any:
        import torch

        key = (numel, dtype)
        free = self._free.get(key)
        buf = free.pop() if free else torch.empty(numel, dtype=dtype, pin_memory=self._pin)
        self._lent.append((key, buf))
        return buf

    def give_back_all(self) -> None:
        for key, buf in self._lent:
            self._free.setdefault(key, []).append(buf)
        self._lent.clear()

    def held_bytes(self) -> int:
        bufs = [b for free in self._free.values() for b in free] + [b for _, b in self._lent]
        return sum(b.numel() * b.element_size() for b in bufs)


class AsyncSaver:
    """The staging memory and commit channel of async saves; one per process (per group).

    Creating it is collective over ``process_group`` (every rank creates its saver at the same
    point) because it opens a gloo group of the same ranks for the background commit.
    ``budget`` bytes of host memory are allocated and faulted in once and reused by every save.
    """

    def __init__(
        self,
        budget: Optional[int] = None,
        process_group: Any = None,
        buffer_size: Optional[int] = None,
        no_dist: bool = False,
    ) -> None:
        if budget is None:
            budget = int(os.environ.get("TESSERA_STAGING_BUDGET", DEFAULT_STAGING_BUDGET))
        self.process_group = process_group
        # ``no_dist``: this process saves alone, whatever process group exists.
        self.commit_comm = None if no_dist else commit_comm(process_group)
        self._native = _native.AsyncSaver(budget, self.commit_comm, buffer_size)
        self.pinned = PinnedPool()

    @property
    def capacity(self) -> int:
        """Bytes of staging memory held."""
        return self._native.capacity

    @property
    def peak_bytes_in_use(self) -> int:
        """Most staging bytes ever in use at once."""
        return self._native.peak_bytes_in_use

    def is_idle(self) -> bool:
        """True when no save is in flight (local)."""
        return self._native.is_idle()

    def start(self, *args: Any, **kwargs: Any) -> Any:
        """Stages a save (arguments of ``tessera._native.save``); returns the native handle."""
        return self._native.save(*args, **kwargs)


# One saver per live process group: (group object, saver). Keyed by the group object itself, not
# by ``None`` or ``id()``: once a group is destroyed (``destroy_process_group``, as megatron's
# tests do between tests) its saver's commit group is dead, and a re-created group with the same
# ranks gets a fresh saver.
_DEFAULT_SAVERS: List[Tuple[Any, AsyncSaver]] = []


def _resolved_group(process_group: Any) -> Any:
    """The group object a save over ``process_group`` runs on (the default group for None);
    None without torch.distributed."""
    if process_group is not None:
        return process_group
    dist = initialized_dist()
    return None if dist is None else dist.distributed_c10d._get_default_group()


def _is_live(group: Any) -> bool:
    """False once ``group`` was destroyed (it left torch's registry of groups)."""
    if group is None or group is _NO_DIST:
        return True
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        return True
    if not dist.is_initialized():
        return False
    world = getattr(c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    return pg_map is None or group in pg_map


#: The key of the saver of a process that saves alone (``no_dist``) beside a process group.
_NO_DIST = object()


def _per_live_group(cache: List[Tuple[Any, Any]], group: Any, make: Any) -> Any:
    """The value ``cache`` holds for ``group`` (compared by identity), made by ``make()`` on
    first use; entries of destroyed groups are dropped first."""
    cache[:] = [(g, v) for g, v in cache if _is_live(g)]
    for g, value in cache:
        if g is group:
            return value
    value = make()
    cache.append((group, value))
    return value


def default_saver(process_group: Any = None, state_bytes: int = DEFAULT_STAGING_BUDGET, no_dist: bool = False) -> AsyncSaver:
    """The saver of ``process_group`` (the default group for None; this process alone with
    ``no_dist``), created (collectively, but for ``no_dist``) on first use with a budget of
    ``state_bytes`` (this rank's tensor bytes) capped at :data:`DEFAULT_STAGING_BUDGET`.
    Savers of destroyed groups are dropped."""

    def make() -> AsyncSaver:
        budget = os.environ.get("TESSERA_STAGING_BUDGET")
        size = int(budget) if budget is not None else max(min(state_bytes, DEFAULT_STAGING_BUDGET), 8 << 20)
        return AsyncSaver(size, process_group=None if no_dist else process_group, no_dist=no_dist)

    group = _NO_DIST if no_dist else _resolved_group(process_group)
    return cast(AsyncSaver, _per_live_group(_DEFAULT_SAVERS, group, make))


# One background communicator per live process group: (group object, communicator).
_BACKGROUND_COMMS: List[Tuple[Any, Any]] = []


def background_comm(process_group: Any = None, no_dist: bool = False) -> Any:
    """A communicator of its own for a save that runs whole in the background (its plan
    exchange too, as DCP's thread-based ``async_save`` runs): a gloo group of
    ``process_group``'s ranks, created (collectively) on first use and kept while the group
    lives, so that the save's collectives never meet the training loop's. None for one
    process (or ``no_dist``)."""
    if no_dist or initialized_dist() is None:
        return None
    return _per_live_group(_BACKGROUND_COMMS, _resolved_group(process_group), lambda: commit_comm(process_group))
