"""One native save and one native load for every front end.

A front end describes its tensors as ``(tensor, describe)`` pairs: ``describe(host)`` makes the
core's descriptor (:mod:`.descriptors`) over host memory this module provides. The save owns
the staging sequence (host or page-locked copies, one device synchronisation, start, give the
buffers back); the load owns the targets (the caller's memory when the core can write it, a
host stand-in copied back otherwise) and tied tensors (one memory under several keys is filled
once, as torch DCP fills it).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

from .. import _native
from .comm import TorchComm, default_comm
from .layout import cpu_contiguous
from .staging import AsyncSaver, default_saver

__all__ = ["communicator", "common_values", "save", "saver_for", "on_host", "load", "restore", "SaveItem", "LoadItem"]

#: A tensor to save (None: described without data) and how to describe it over host memory.
SaveItem = Tuple[Any, Callable[[Any], _native.SaveTensor]]
#: A tensor to fill, how to describe it over host memory, and what else tells its piece apart
#: from another over the same memory (its flat range or offset), for tied tensors.
LoadItem = Tuple[Any, Callable[[Any], _native.LoadTensor], Any]


def communicator(process_group: Any = None, no_dist: bool = False) -> Tuple[Optional[TorchComm], int]:
    """The communicator of ``process_group`` (the default group; None for one process or
    ``no_dist``) and this rank in it: the one choice every front end makes."""
    comm = default_comm(process_group, no_dist)
    return comm, comm.rank() if comm is not None else 0


def common_values(
    comm: Optional[TorchComm], rank: int, values: Sequence[Tuple[List[Any], Any]], plain: Callable[[Any], Any]
) -> List[Tuple[List[Any], Any]]:
    """The common values a save stores, given on rank 0 (empty elsewhere): every rank's
    ``values`` (native path, value), each path once, from the lowest rank that holds it, as
    ``plain`` makes it. Ranks usually hold the same paths (training state): one all-gather of
    a digest of each rank's paths finds that, and rank 0's values are stored. Where they differ
    (a per-rank dataloader state, as torchtitan keeps it under ``dp_rank_<r>``), the paths are
    gathered and each rank sends rank 0's missing ones it is the lowest holder of, so that
    every rank's state is saved, as DCP saves every rank's. Collective over ``comm``."""
    if comm is None or comm.world_size() == 1:
        return [(p, plain(v)) for p, v in values]
    paths = sorted(_encode(p) for p, _ in values)
    digest = hashlib.sha256(b"".join(len(p).to_bytes(8, "little") + p for p in paths)).digest()
    if len(set(comm.all_gather(digest))) == 1:
        return [(p, plain(v)) for p, v in values] if rank == 0 else []
    held: List[set] = [set(_decode(m)) for m in comm.all_gather(_encode(paths))]
    lower: set = set().union(*held[:rank]) if rank else set()
    sent = [[p, plain(v)] for p, v in values if rank and _encode(p) not in lower]
    gathered = comm.all_gather(_encode(sent))
    if rank != 0:
        return []
    out = [(p, plain(v)) for p, v in values]
    for message in gathered[1:]:
        out.extend((p, v) for p, v in _decode(message))
    return out


def _encode(value: Any) -> bytes:
    """The core's encoding of a plain value (typed loosely: exchanged values are plain)."""
    return _native.encode_value(value)


def _decode(data: bytes) -> Any:
    return _native.decode_value(data)


def saver_for(process_group: Any, items: Sequence[SaveItem], no_dist: bool = False) -> AsyncSaver:
    """The async saver of ``process_group`` (of this process alone with ``no_dist``), sized on
    first use to these tensors' bytes."""
    held = sum(t.numel() * t.element_size() for t, _ in items if t is not None)
    return default_saver(process_group, held, no_dist)


def save(
    items: Sequence[SaveItem],
    objects: List[Any],
    common: List[Any],
    location: Any,
    comm: Optional[TorchComm],
    *,
    saver: Optional[AsyncSaver] = None,
    **native_kwargs: Any,
) -> Any:
    """Saves through the core: the report, or with ``saver`` the native handle of an async
    save, returned once every tensor is staged (the caller's tensors may change from then on).
    Tensors that are not CPU C-contiguous memory are copied to the host first (to the saver's
    page-locked buffers for CUDA tensors of an async save, with one synchronisation)."""
    described, keep_alive, device_copies = _staged(items, saver.pinned if saver is not None else None)
    if saver is None:
        return _native.save(described, objects, common, location, comm, **native_kwargs)
    try:
        if device_copies:
            import torch

            torch.cuda.synchronize()
        return saver.start(described, objects, common, location, comm, **native_kwargs)
    finally:
        # Staged: the page-locked buffers and host copies are free for the next save.
        del keep_alive
        saver.pinned.give_back_all()


def on_host(items: Sequence[SaveItem], copy: bool = False) -> Tuple[List[_native.SaveTensor], List[Any]]:
    """The items described over host memory, and that memory: for a native call that keeps it
    alive itself until it writes (``tessera._native.plan_torch_dist``: a planned save). Tensors
    that are not CPU C-contiguous memory are copied to the host; with ``copy`` every tensor is
    (the caller's tensors may change before the core writes them)."""
    described, keep_alive, _ = _staged(items, None, copy)
    return described, keep_alive


def _staged(items: Sequence[SaveItem], pinned: Any, copy: bool = False) -> Tuple[List[_native.SaveTensor], List[Any], bool]:
    """(the items described over host memory, that memory, whether a device copy is in flight):
    CUDA tensors go to ``pinned`` buffers without waiting when a pool is given (the caller
    synchronises once for all of them), other tensors through :func:`cpu_contiguous`."""
    described = []
    keep_alive: List[Any] = []
    device_copies = False
    for t, describe in items:
        if t is None:
            described.append(describe(None))
            continue
        if pinned is not None and t.device.type == "cuda":
            host = pinned.take(t.numel(), t.dtype).view(t.shape)
            host.copy_(t.detach(), non_blocking=True)
            device_copies = True
        else:
            host = cpu_contiguous(t, copy)
        keep_alive.append(host)
        described.append(describe(host))
    return described, keep_alive, device_copies


def load(
    items: Sequence[LoadItem],
    objects: List[Any],
    location: Any,
    comm: Optional[TorchComm],
    *,
    stored_dtypes: Optional[Sequence[Any]] = None,
    **native_kwargs: Any,
) -> Dict[str, Any]:
    """Loads through the core into the items' tensors; returns the core's result with
    ``loaded`` given per item (a tied item as the one it shares memory with). Where
    ``stored_dtypes`` gives an item a dtype other than its tensor's, the item is read into a
    host buffer of that dtype and cast into the tensor (``Tensor.copy_``, as DCP casts); its
    ``describe`` must then take the buffer's dtype."""

    def run(described: List[Any]) -> Dict[str, Any]:
        return cast(Dict[str, Any], _native.load(described, objects, location, comm, **native_kwargs))

    return _into_targets(items, stored_dtypes, run)


def restore(manager: Any, items: Sequence[LoadItem], comm: Optional[TorchComm]) -> Optional[Dict[str, Any]]:
    """Restores the newest complete step of a native ``CheckpointManager`` into the items'
    tensors, as :func:`load` fills them; None when no tier holds a step."""
    restored: List[Any] = []

    def run(described: List[Any]) -> Dict[str, Any]:
        r = manager.restore(described, [], comm)
        restored.append(r)
        return {"loaded": list(r.loaded) if r is not None else None}

    _into_targets(items, None, run)
    r = restored[0]
    if r is None:
        return None
    return {"step": r.step, "tier": r.tier, "rebuilt_ranks": list(r.rebuilt_ranks), "notes": list(r.notes), "common": r.common}


def tied_span(t: Any, extra: Any) -> Tuple[Any, ...]:
    """What makes two tensors one (tied weights: the same memory, viewed alike), with ``extra``
    (where the tensor sits in the global one): a save describes each span once, and a load
    fills each once."""
    return (t.device, t.data_ptr(), t.numel() * t.element_size(), t.dtype, tuple(t.stride()), extra)


def _into_targets(
    items: Sequence[LoadItem], stored_dtypes: Optional[Sequence[Any]], run: Callable[[List[Any]], Dict[str, Any]]
) -> Dict[str, Any]:
    """Describes the items' targets (the caller's memory when the core can write it, a host
    stand-in otherwise; tied items once), runs the native fill, copies stand-ins back."""
    described = []
    targets: List[Tuple[Any, Any]] = []
    slot_of: List[int] = []
    seen: Dict[Tuple[Any, ...], int] = {}
    for i, (t, describe, extra) in enumerate(items):
        nbytes = t.numel() * t.element_size()
        span = tied_span(t, extra)
        if nbytes and span in seen:
            slot_of.append(seen[span])
            continue
        stored = stored_dtypes[i] if stored_dtypes is not None else None
        if stored is not None and stored != t.dtype:
            buf = _host_like(t, stored)
        elif t.device.type == "cpu" and t.is_contiguous():
            buf = t
        else:
            buf = _host_like(t, t.dtype)
        seen[span] = len(targets)
        slot_of.append(len(targets))
        targets.append((t, buf))
        described.append(describe(buf))
    result = run(described)
    loaded = result.get("loaded")
    if loaded is not None:
        import torch

        with torch.no_grad():
            for (t, buf), ok in zip(targets, loaded):
                if ok and buf is not t:
                    t.copy_(buf)
        result["loaded"] = [loaded[i] for i in slot_of]
    return result


def _host_like(t: Any, dtype: Any) -> Any:
    import torch

    return torch.empty(t.shape, dtype=dtype)
