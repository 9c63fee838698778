"""A checkpoint manager for training loops: a checkpoint every few steps to a memory tier
(node-local memory, protected by Reed–Solomon parity across nodes), drained every few steps to
a persistent location, and a restore that resumes from the newest complete step, rebuilding what
lost nodes held. The policy and every format are the core's (``tessera::memory_tier``)."""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from typing import Any, Dict, Optional, Tuple

from .. import _native
from .._core import io, statedict
from .._core.staging import background_comm
from .._core.storage import StorageOptions, native_location

__all__ = ["CheckpointManager"]

# Managers still open, closed at interpreter exit: a manager left to the finalizer with work
# queued would wait for a background thread that can no longer take the GIL.
_open: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()


@atexit.register
def _close_open_managers() -> None:
    for mgr in list(_open):
        try:
            mgr.close()
        except BaseException as e:  # noqa: BLE001 - every manager is closed; each failure is said
            print(f"tessera: closing a CheckpointManager at exit: {e}", file=sys.stderr)


class CheckpointManager:
    """Saves a state dict on a schedule and restores the newest complete step.

    ``memory``: the node-local root of the memory tier (``/dev/shm/<job>``; None: none), with
    ``redundancy=(k, m)``: up to k ranks' copies per group on k nodes, m parity shards on m
    more, so any m nodes may be lost; ``node`` names this process's node (default
    ``$TESSERA_NODE``, else the host name). ``persistent``: a directory or object-store URL
    (each step an ordinary tessera checkpoint ``step-NNNNNNNNNNNN`` under it). ``every``: save
    every that many steps; ``persist_every``: drain to ``persistent`` every that many steps (a
    multiple of ``every``; 0: never; without a memory tier, every save goes there).
    ``keep_last`` steps are kept in memory per node, ``keep_last_persistent`` persistent ones.

    Collective: every rank of ``process_group`` makes the same calls with the same steps. The
    background work runs on a gloo group of its own.
    """

    def __init__(
        self,
        memory: Any = None,
        persistent: Any = None,
        *,
        every: int = 1,
        persist_every: int = 0,
        keep_last: int = 2,
        keep_last_persistent: int = 3,
        redundancy: Tuple[int, int] = (4, 1),
        node: Optional[str] = None,
        chunk_bytes: int = 8 << 20,
        staging_bytes: int = 256 << 20,
        process_group: Any = None,
        storage_options: StorageOptions = None,
    ) -> None:
        self._comm, self._rank = io.communicator(process_group)
        self._native = _native.CheckpointManager(
            memory_root=None if memory is None else os.fspath(memory),
            node=node,
            data_shards=redundancy[0],
            parity_shards=redundancy[1],
            chunk_bytes=chunk_bytes,
            persistent=None if persistent is None else native_location(persistent, storage_options),
            every=every,
            persist_every=persist_every,
            keep_last_memory=keep_last,
            keep_last_persistent=keep_last_persistent,
            staging_bytes=staging_bytes,
            background_comm=background_comm(process_group),
        )
        _open.add(self)

    def save(self, step: int, state_dict: Dict[str, Any]) -> bool:
        """Saves ``state_dict`` as ``step`` if the policy says so; returns whether it did, once
        the state is staged (the tensors may change from then on)."""
        return statedict.managed_save(self._native, step, state_dict, self._comm, self._rank)

    def restore(self, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """Restores the newest step complete in some tier into ``state_dict`` in place; returns
        ``{"step", "tier", "rebuilt_ranks", "notes"}``, or None when there is none (a fresh
        start). Raises when steps exist but none can be restored, saying why."""
        return statedict.managed_restore(self._native, state_dict, self._comm)

    def wait(self) -> None:
        """Waits for the background work (copies, parity, drains, deletions); raises its first
        failure since the last call."""
        self._native.wait()

    def close(self) -> None:
        """Waits for the background work, then stops the manager's background thread; raises
        the work's first failure since the last :meth:`wait`. Before the process group is
        destroyed, close the manager (or use it as a context manager): its background work
        runs collectives on the group. A manager still open at interpreter exit is closed
        then, by an exit handler."""
        _open.discard(self)
        self._native.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
