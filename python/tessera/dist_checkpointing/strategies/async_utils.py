"""Async save: requests, a queue that finalizes them, and the saver that owns the staging memory.

``save(..., async_sharded_save=True)`` returns once this rank's bytes are copied into a
pre-faulted staging pool (Megatron's ``AsyncRequest`` is returned for the caller to schedule);
a native background thread writes the data file and, once every rank has written, commits over a
dedicated gloo process group. Nothing here polls with a collective: ``is_done`` is local, and
``finalize`` only collects the verdict that rank 0 broadcast, the same on every rank.
"""

from __future__ import annotations

import os
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from ... import _native
from ..._comm import TorchComm

logger = logging.getLogger(__name__)

__all__ = ["AsyncRequest", "AsyncCallsQueue", "AsyncSaver", "DEFAULT_STAGING_BUDGET"]

#: Most staging memory the saver created on first use takes, per process: it is sized to the
#: first save's tensor bytes up to this cap (``TESSERA_STAGING_BUDGET``, in bytes, sets the
#: budget exactly). A state larger than the budget is staged in waves.
DEFAULT_STAGING_BUDGET = 4 << 30


class _PinnedPool:
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

    def __init__(self, budget: Optional[int] = None, process_group: Any = None, buffer_size: Optional[int] = None) -> None:
        if budget is None:
            budget = int(os.environ.get("TESSERA_STAGING_BUDGET", DEFAULT_STAGING_BUDGET))
        self.process_group = process_group
        self.commit_comm = _commit_comm(process_group)
        self._native = _native.AsyncSaver(budget, self.commit_comm, buffer_size)
        self.pinned = _PinnedPool()

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


def _commit_comm(process_group: Any) -> Optional[TorchComm]:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
    # Only the group's own ranks take part; the commit group never carries training traffic.
    group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=ranks is not None)
    return TorchComm(group)


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
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_group()


def _is_live(group: Any) -> bool:
    """False once ``group`` was destroyed (it left torch's registry of groups)."""
    if group is None:
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


def default_saver(process_group: Any = None, state_bytes: int = DEFAULT_STAGING_BUDGET) -> AsyncSaver:
    """The saver of ``process_group`` (the default group for None), created (collectively) on
    first use with a budget of ``state_bytes`` (this rank's tensor bytes) capped at
    :data:`DEFAULT_STAGING_BUDGET`. Savers of destroyed groups are dropped."""
    group = _resolved_group(process_group)
    _DEFAULT_SAVERS[:] = [(g, s) for g, s in _DEFAULT_SAVERS if _is_live(g)]
    for g, saver in _DEFAULT_SAVERS:
        if g is group:
            return saver
    budget = os.environ.get("TESSERA_STAGING_BUDGET")
    size = int(budget) if budget is not None else max(min(state_bytes, DEFAULT_STAGING_BUDGET), 8 << 20)
    saver = AsyncSaver(size, process_group=process_group)
    _DEFAULT_SAVERS.append((group, saver))
    return saver


class AsyncRequest:
    """A save whose bytes are staged and being written in the background.

    ``finalize`` waits for it and raises its error (the same on every rank; nothing was
    committed), then runs the finalize functions in order. ``is_done`` is local.
    """

    def __init__(self, handle: Any, finalize_fns: Optional[List[Callable[[], Any]]] = None) -> None:
        self._handle = handle
        self.finalize_fns: List[Callable[[], Any]] = list(finalize_fns or [])
        self.call_idx: Optional[int] = None
        self.report: Optional[dict] = None
        self._finalized = False

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Runs ``fn()`` after a successful commit (e.g. to update a "latest" tracker file)."""
        if self._finalized:
            raise RuntimeError("the request is already finalized")
        self.finalize_fns.append(fn)

    def is_done(self) -> bool:
        """True once this rank's part is written and the commit decided. No communication."""
        return self._finalized or self._handle.is_done()

    @property
    def collective_finalize(self) -> bool:
        """True when finalizing is a collective (a ``torch_dist`` save commits then), so
        every rank must finalize together: a poll then agrees that every rank is done."""
        return bool(getattr(self._handle, "collective_finalize", False))

    def finalize(self) -> dict:
        """Waits for the commit; returns the save report or raises the save's error."""
        if self._finalized:
            if self.report is None:
                raise RuntimeError("the request failed when it was finalized")
            return self.report
        self._finalized = True
        self.report = self._handle.finalize()
        for fn in self.finalize_fns:
            fn()
        return self.report

    def execute_sync(self) -> dict:
        """Megatron's name for running a request to completion: :meth:`finalize`."""
        return self.finalize()


def _all_ranks(flag: bool) -> bool:
    """``flag`` and-ed over the default process group (the flag itself without one)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return flag
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


class _CallRequest:
    """A Megatron-shaped request (a function to run in the background and functions to run
    once it is done) on a background thread: the queue's view of a request tessera did not make."""

    def __init__(self, request: Any) -> None:
        self.request = request
        self.call_idx: Optional[int] = None
        self._error: Optional[BaseException] = None
        args = list(request.async_fn_args or ())
        if request.preload_fn is not None:
            # As Megatron: the preloaded state replaces the second argument.
            args[1] = request.preload_fn()
        kwargs = dict(getattr(request, "async_fn_kwargs", None) or {})

        def run() -> None:
            try:
                if request.async_fn is not None:
                    request.async_fn(*args, **kwargs)
            except BaseException as e:  # re-raised by finalize, on the caller's thread
                self._error = e

        self._thread = threading.Thread(target=run, name="tessera-async-call", daemon=True)
        self._thread.start()

    def is_done(self) -> bool:
        return not self._thread.is_alive()

    def finalize(self) -> None:
        self._thread.join()
        if self._error is not None:
            # As in Megatron, whose background writer process just dies: the failure is
            # reported here and the finalize functions still run on every rank, where the
            # request's own check (e.g. the local checkpoint manager's, collective) decides.
            logger.error("async call %s failed: %r", self.call_idx, self._error, exc_info=self._error)
        for fn in self.request.finalize_fns or ():
            fn()


class AsyncCallsQueue:
    """Schedules async requests and finalizes them in order (Megatron's ``AsyncCallsQueue``).

    Polling (``maybe_finalize_async_calls(blocking=False)``) costs no collective on any rank:
    every rank finalizes a request when its own copy is done, and all get the same verdict.
    """

    def __init__(self, persistent: bool = False) -> None:
        # Accepted for Megatron compatibility: the background work always lives in native threads.
        self.persistent = persistent
        self._pending: List[AsyncRequest] = []
        self._next_idx = 0

    def schedule_async_request(self, async_request: Any) -> int:
        """Takes ownership of a request; returns its call index. A request of Megatron's own
        shape (``async_fn``, ``async_fn_args``, ``preload_fn``, ``finalize_fns``, as
        nvidia-resiliency-ext's local checkpointing makes them) is run as Megatron runs it:
        preloaded now, ``async_fn`` on a background thread, finalize functions at finalization."""
        if not isinstance(async_request, AsyncRequest):
            async_request = _CallRequest(async_request)
        async_request.call_idx = self._next_idx
        self._next_idx += 1
        self._pending.append(async_request)
        return async_request.call_idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalizes the requests that are done (all of them if ``blocking``), oldest first;
        returns their call indices. The first failure is raised after the requests before it
        were finalized. tessera's native saves are polled without a collective (each commits in
        the background; every rank gets the same verdict); a request whose finalization is
        collective (a ``torch_dist`` save, a Megatron-shaped request) is finalized once it is
        done on every rank (one all-reduce per poll, as Megatron's queue does, skipped with
        ``no_dist``)."""
        done: List[int] = []
        while self._pending:
            head = self._pending[0]
            if not blocking:
                ready = head.is_done()
                if (isinstance(head, _CallRequest) or head.collective_finalize) and not no_dist:
                    ready = _all_ranks(ready)
                if not ready:
                    break
            self._pending.pop(0)
            head.finalize()
            done.append(head.call_idx if head.call_idx is not None else -1)
        return done

    def get_num_unfinalized_calls(self) -> int:
        """Requests scheduled and not yet finalized."""
        return len(self._pending)

    def close(self, abort: bool = False) -> None:
        """Finalizes every pending request (``abort``: drop them without waiting)."""
        if abort:
            self._pending.clear()
            return
        self.maybe_finalize_async_calls(blocking=True)
