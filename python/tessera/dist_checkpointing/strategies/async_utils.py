"""Async save: requests, a queue that finalizes them, and the saver that owns the staging memory.

``save(..., async_sharded_save=True)`` returns once this rank's bytes are copied into a
pre-faulted staging pool (Megatron's ``AsyncRequest`` is returned for the caller to schedule);
a native background thread writes the data file and, once every rank has written, commits over a
dedicated gloo process group. ``is_done`` is local and ``finalize`` collects the verdict rank 0
broadcast; the queue's poll agrees over the default group that a request is done everywhere
before any rank finalizes it.

torch is an optional extra of the package, so it is imported where it is used, not with this
module.
"""

from __future__ import annotations

import os
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..._core.comm import initialized_dist
from ..._core.staging import DEFAULT_STAGING_BUDGET, AsyncSaver, default_saver

logger = logging.getLogger(__name__)

__all__ = ["AsyncRequest", "AsyncCallsQueue", "AsyncSaver", "DEFAULT_STAGING_BUDGET", "default_saver"]

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
    """``flag`` and-ed over the default process group (the flag itself without one). The
    reduction runs where Megatron's queue runs it: on the current CUDA device when the default
    group has a CUDA backend (NCCL has no CPU tensors), on the host otherwise (gloo)."""
    dist = initialized_dist()
    if dist is None:
        return flag
    import torch

    device = "cpu"
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()).lower():
        device = f"cuda:{torch.cuda.current_device()}"
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
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

    Polling (``maybe_finalize_async_calls(blocking=False)``) all-reduces "done" over the default
    group once per request it looks at, as Megatron's queue does, so that ranks finalize in step.
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
        were finalized. Without ``blocking``, a request is finalized only once every rank
        agrees it is done, whatever its kind (one all-reduce per request looked at, as
        Megatron's queue does; skipped with ``no_dist``): every rank then finalizes the same
        requests at the same poll and runs the same collectives, so no rank's all-reduce can
        pair with another rank's training collective."""
        done: List[int] = []
        while self._pending:
            head = self._pending[0]
            if not blocking:
                ready = head.is_done()
                if not no_dist:
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
