"""`tessera.torch`: checkpoints of torch state dicts holding plain tensors and DTensors.

Sharding is derived from each DTensor's mesh and placements (``Shard`` and ``Replicate``, uneven
shards included); replicated copies are written once. Loading is in place, into whatever
layout the given state dict has: another mesh, another world size, or one process.

It follows ``torch.distributed.checkpoint`` (DCP): a top-level value with ``state_dict()`` and
``load_state_dict()`` (DCP's ``Stateful``: a model, an optimizer, torchtitan's wrappers and train
state) is saved as its ``state_dict()`` and, on load, loaded in place into its ``state_dict()``
and handed back through ``load_state_dict()``; ``checkpoint_id`` / ``storage_writer`` /
``storage_reader``, ``process_group`` and :func:`async_save` (a future) are DCP's; torch's
``get_model_state_dict`` / ``get_optimizer_state_dict`` / ``set_model_state_dict`` /
``set_optimizer_state_dict`` / ``StateDictOptions`` are re-exported. Plain values (numbers,
strings, bools, None, lists, tuples as lists, dicts of them) are stored as plain values that
every tool reads; anything else as a typed ``torch.save`` blob, only ever loaded here.
The model/optimizer helpers follow OLMo-core's `save_model_and_optim_state` /
`load_model_and_optim_state`, and work for FSDP2 (``fully_shard``) and plain modules.
Every function taking a location takes an object-store URL too (``s3://``, ``gs://``,
``az://``), configured from the environment or by ``storage_options`` (``object_store``
configuration keys, as polars and deltalake take them).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple, cast

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from .. import _native
from .._comm import default_comm
from .._storage import StorageOptions, location_url, native_location
from ..errors import KeyMismatchError
from ..dist_checkpointing._descriptors import load_tensor, save_tensor
from ..dist_checkpointing.mapping import tessera_dtype_to_torch
from ..dist_checkpointing.serialization import (
    _cpu_contiguous,
    _from_native_path,
    _from_plain,
    _is_stateful,
    _leaves,
    _like_request,
    _set_path,
    _to_native_path,
    _to_plain,
)

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeGuard

__all__ = [
    "save",
    "async_save",
    "load",
    "get_metadata",
    "unshard",
    "save_model_and_optim_state",
    "load_model_and_optim_state",
    "unshard_model_state",
    "unshard_optim_state",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]


def _flatten_stateful(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """``state_dict`` with every top-level ``Stateful`` value replaced by its ``state_dict()``
    (as DCP does; nested values are data)."""
    return {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state_dict.items()}


def _location(checkpoint_id: Any, storage: Any, what: str) -> Any:
    """The location from DCP's two ways of giving it: ``checkpoint_id`` (a path, URL or
    :class:`tessera.Location`), or a storage writer/reader object carrying it (torch's
    ``FileSystemWriter`` / ``Reader``: ``.path``; others: ``.checkpoint_id``)."""
    if storage is not None:
        from_storage = getattr(storage, "checkpoint_id", None) or getattr(storage, "path", None)
        if from_storage is None:
            raise TypeError(f"{what} {type(storage).__name__} carries no location (.path or .checkpoint_id)")
        if checkpoint_id is not None and location_url(checkpoint_id) != location_url(from_storage):
            raise ValueError(f"checkpoint_id {location_url(checkpoint_id)} and {what} location {from_storage!s} differ")
        checkpoint_id = from_storage
    if checkpoint_id is None:
        raise ValueError(f"where to? give checkpoint_id (a directory or URL) or {what}")
    return checkpoint_id if isinstance(checkpoint_id, _native.Location) else os.fspath(checkpoint_id)


def _key(path: Tuple[Any, ...]) -> str:
    return ".".join(str(seg) for _, seg in path)


def _is_dtensor(t: Any) -> "TypeGuard[DTensor]":
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def _layout(t: torch.Tensor, rank: int) -> Tuple[torch.Tensor, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """(local tensor, global shape, global offset, replica id) of a tensor or DTensor."""
    if not _is_dtensor(t):
        return t, tuple(t.shape), (0,) * t.dim(), (rank,)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if p.is_partial():
            raise ValueError("a DTensor with a Partial placement holds no defined values; redistribute it first")
        if not (p.is_shard() or p.is_replicate()) or type(p).__name__ == "_StridedShard":
            raise ValueError(f"unsupported DTensor placement {p!r} (supported: Shard, Replicate)")
    local = t.to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"DTensor local shape {tuple(local.shape)} differs from its placement's {tuple(shape)}")
    coord: Sequence[int] = t.device_mesh.get_coordinate() or []
    replica = tuple(int(coord[i]) for i, p in enumerate(t.placements) if p.is_replicate()) or (0,)
    return local, tuple(t.shape), tuple(int(x) for x in offset), replica


def _split(state_dict: Dict[str, Any]) -> Tuple[List[Tuple[Tuple[Any, ...], torch.Tensor]], List[Tuple[Tuple[Any, ...], Any]]]:
    tensors: List[Tuple[Tuple[Any, ...], torch.Tensor]] = []
    values: List[Tuple[Tuple[Any, ...], Any]] = []
    for path, leaf in _leaves(state_dict):
        (tensors if isinstance(leaf, torch.Tensor) else values).append((path, leaf))
    return tensors, values


def _where(checkpoint_id: Any, storage_writer: Any, process_group: Any) -> Tuple[Any, Any, int]:
    """A save's location, communicator and rank."""
    location = _location(checkpoint_id, storage_writer, "storage_writer")
    comm = default_comm(process_group)
    return location, comm, comm.rank() if comm is not None else 0


def _save_request(state_dict: Dict[str, Any], rank: int, pinned: Any = None) -> Tuple[list, list, List[Any]]:
    """The core's tensor descriptors and common values of a state dict (and what keeps the
    tensors' memory alive)."""
    tensors, values = _split(_flatten_stateful(state_dict))
    keep_alive: List[Any] = []
    native = []
    for path, t in tensors:
        local, shape, offset, replica = _layout(t, rank)
        if pinned is not None and local.device.type == "cuda":
            data = pinned.take(local.numel(), local.dtype).view(local.shape)
            data.copy_(local.detach(), non_blocking=True)
        else:
            data = _cpu_contiguous(local)
        keep_alive.append(data)
        native.append(save_tensor(_key(path), t.dtype, data.shape, shape, offset, replica_id=replica, data=data))
    common = [(_to_native_path(p), _to_plain(v, tuples=True)) for p, v in values] if rank == 0 else []
    return native, common, keep_alive


def save(
    state_dict: Dict[str, Any],
    checkpoint_id: Any = None,
    *,
    storage_writer: Any = None,
    process_group: Any = None,
    overwrite: bool = False,
    content_metadata: Optional[dict] = None,
    storage_options: StorageOptions = None,
) -> dict:
    """Saves a (nested) state dict to ``checkpoint_id`` (a directory or an object-store URL;
    or where ``storage_writer`` points); under torch.distributed every rank of
    ``process_group`` calls it. Tensor keys are the dotted paths; other values are saved once,
    from rank 0. A checkpoint already there is kept unless ``overwrite``. ``storage_options``
    configure an object store (``object_store`` keys, over the environment). Returns the
    report."""
    location, comm, rank = _where(checkpoint_id, storage_writer, process_group)
    native, common, keep_alive = _save_request(state_dict, rank)
    meta = _to_plain(content_metadata) if content_metadata is not None else None
    where = native_location(location, storage_options)
    report = _native.save(native, [], common, where, comm, overwrite=overwrite, content_metadata=meta)
    del keep_alive
    return report


def async_save(
    state_dict: Dict[str, Any],
    checkpoint_id: Any = None,
    *,
    storage_writer: Any = None,
    process_group: Any = None,
    overwrite: bool = False,
    content_metadata: Optional[dict] = None,
    storage_options: StorageOptions = None,
) -> "Future[dict]":
    """:func:`save` in the background, as DCP's ``async_save``: returns once this rank's bytes
    are staged (the state may change from then on) with a ``concurrent.futures.Future`` whose
    ``result()`` is the report, or raises the save's error (the same on every rank; nothing was
    committed). The commit needs no call from the training loop."""
    from ..dist_checkpointing.strategies.async_utils import default_saver

    location, comm, rank = _where(checkpoint_id, storage_writer, process_group)
    held = sum(t.numel() * t.element_size() for _, t in _split(_flatten_stateful(state_dict))[0])
    saver = default_saver(process_group, held)
    native, common, keep_alive = _save_request(state_dict, rank, saver.pinned)
    if any(t.device.type == "cuda" for t in keep_alive):
        torch.cuda.synchronize()
    meta = _to_plain(content_metadata) if content_metadata is not None else None
    try:
        where = native_location(location, storage_options)
        handle = saver.start(native, [], common, where, comm, overwrite=overwrite, content_metadata=meta)
    finally:
        # Staged: the pinned buffers and host copies are free for the next save.
        del keep_alive
        saver.pinned.give_back_all()
    future: "Future[dict]" = Future()

    def wait() -> None:
        try:
            future.set_result(handle.finalize())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=wait, name="tessera-async-save", daemon=True).start()
    return future


def load(
    state_dict: Dict[str, Any],
    checkpoint_id: Any = None,
    *,
    storage_reader: Any = None,
    process_group: Any = None,
    strict: bool = True,
    storage_options: StorageOptions = None,
) -> None:
    """Loads in place: every tensor (or DTensor shard) of ``state_dict`` is filled from the
    checkpoint, whatever layout it was saved in; other values are replaced by the saved ones
    (a tuple stays a tuple); a ``Stateful`` value is loaded into its ``state_dict()`` and
    given it back through ``load_state_dict()``. With ``strict``, a tensor the checkpoint
    lacks raises ``KeyMismatchError``. ``process_group`` is accepted for DCP's signature: each
    rank reads what it needs, no communication."""
    location = _location(checkpoint_id, storage_reader, "storage_reader")
    flat = _flatten_stateful(state_dict)
    tensors, _ = _split(flat)
    targets = []
    native = []
    for path, t in tensors:
        local, shape, offset, _ = _layout(t, 0)
        buf = local if (local.device.type == "cpu" and local.is_contiguous()) else torch.empty(
            local.shape, dtype=local.dtype
        )
        targets.append((local, buf))
        native.append(load_tensor(_key(path), t.dtype, local.shape, shape, offset, data=buf))
    strict_mode = "raise_unexpected" if strict else "return_unexpected"
    try:
        # entries of different types (listed in _native.load's docstring)
        where = native_location(location, storage_options)
        result = cast(Dict[str, Any], _native.load(native, [], where, None, strict=strict_mode))
    except KeyMismatchError as e:
        raise _torch_key_error(location_url(location), e) from None
    with torch.no_grad():
        for (local, buf), loaded in zip(targets, result["loaded"]):
            if loaded and buf is not local:
                local.copy_(buf)
    saved = {_from_native_path(p): _from_plain(v) for p, v in result["common"]}
    for key in flat:  # the request's keys are what is loaded
        flat[key] = _replace_values(flat[key], (("k", key),), saved)
    for key, value in state_dict.items():
        if _is_stateful(value):
            value.load_state_dict(flat[key])
        else:
            state_dict[key] = flat[key]


def get_metadata(dir: Any, *, storage_options: StorageOptions = None) -> Dict[str, Dict[str, Any]]:
    """Key → ``{"dtype": torch.dtype, "shape": tuple}`` of every stored tensor."""
    return {
        k: {"dtype": tessera_dtype_to_torch(d), "shape": tuple(s)}
        for k, (d, s) in _native.load_tensors_metadata(native_location(dir, storage_options)).items()
    }


def _not_rank0(rank0_only: bool, no_dist: bool) -> bool:
    """With ``rank0_only``, ranks other than 0 of an initialized process group get nothing."""
    if not rank0_only or no_dist:
        return False
    comm = default_comm()
    return comm is not None and comm.rank() != 0


def unshard(
    dir: Any,
    keys: Optional[Iterable[str]] = None,
    *,
    device: Any = None,
    rank0_only: bool = False,
    no_dist: bool = False,
    storage_options: StorageOptions = None,
) -> Dict[str, torch.Tensor]:
    """Full tensors (all, or ``keys``) read straight from the checkpoint; no communication.
    With ``rank0_only`` other ranks of an initialized process group get ``{}``."""
    if _not_rank0(rank0_only, no_dist):
        return {}
    meta = get_metadata(dir, storage_options=storage_options)
    wanted = list(meta) if keys is None else list(keys)
    out = {k: torch.empty(meta[k]["shape"], dtype=meta[k]["dtype"]) for k in wanted if k in meta}
    missing = [k for k in wanted if k not in meta]
    if missing:
        raise KeyError(f"not in the checkpoint: {missing}")
    native = [load_tensor(k, t.dtype, t.shape, t.shape, (0,) * t.dim(), data=t) for k, t in out.items()]
    _native.load(native, [], native_location(dir, storage_options), None)
    if device is not None:
        out = {k: t.to(device) for k, t in out.items()}
    return out


# ---------------------------------------------------------------------------------------------
# Model and optimizer (OLMo-core style)

_MODEL, _OPTIM = "model", "optim"


def _state_dict_options() -> Any:
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _holds_tensor(node: Any) -> bool:
    if isinstance(node, torch.Tensor):
        return True
    if isinstance(node, dict):
        return any(_holds_tensor(v) for v in node.values())
    if isinstance(node, list):
        return any(_holds_tensor(v) for v in node)
    return False


def _replace_values(node: Any, path: Tuple[Any, ...], saved: Dict[Tuple[Any, ...], Any]) -> Any:
    """Gives every part of the request ``node`` (at ``path``) that holds no tensor the value
    saved there (rebuilt whole from the saved leaves under ``path``: a list or dict may have
    another length than the request's; a tuple the request holds stays a tuple); a part the
    checkpoint has nothing for is kept. Returns the node to put at ``path``."""
    if _holds_tensor(node):
        if isinstance(node, dict):
            for k in list(node):
                node[k] = _replace_values(node[k], path + (("k", k),), saved)
        elif isinstance(node, list):
            for i in range(len(node)):
                node[i] = _replace_values(node[i], path + (("i", i),), saved)
        return node
    if path in saved:
        return _like_request(saved[path], node)
    under = [(p, v) for p, v in saved.items() if len(p) > len(path) and p[: len(path)] == path]
    if not under:
        return node
    root: Dict[str, Any] = {}
    for p, v in under:
        _set_path(root, (("k", "value"),) + p[len(path) :], v)
    return _like_request(root["value"], node)


def _torch_key_error(location: str, e: Any) -> Exception:
    """The core's key mismatch in ``Module.load_state_dict``'s words: "missing" are keys the
    caller asked for that the checkpoint lacks (the core's Megatron-named ``unexpected``)."""
    missing, unexpected = list(e.unexpected), list(e.missing)
    parts = []
    if missing:
        parts.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
    if unexpected:
        parts.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
    err = KeyMismatchError(f"Error(s) in loading state_dict from {location}:\n\t" + "\n\t".join(parts))
    err.missing, err.unexpected = e.missing, e.unexpected
    # torch's names too, set on this instance only (the extension's class declares missing/unexpected)
    err.missing_keys, err.unexpected_keys = missing, unexpected  # type: ignore[attr-defined]
    return err


def save_model_and_optim_state(
    dir: Any,
    model: torch.nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    *,
    overwrite: bool = False,
    process_group: Any = None,
    save_overwrite: Optional[bool] = None,
    storage_options: StorageOptions = None,
) -> dict:
    """Saves model and optimizer state (FSDP2 DTensors or plain tensors), optimizer state keyed
    by parameter name so that it reshards with the parameters. ``save_overwrite`` is
    OLMo-core's name of ``overwrite``."""
    sd: Dict[str, Any] = {_MODEL: get_model_state_dict(model, options=_state_dict_options())}
    if optim is not None:
        sd[_OPTIM] = get_optimizer_state_dict(model, optim, options=_state_dict_options())
    overwrite = overwrite if save_overwrite is None else save_overwrite
    return save(sd, dir, overwrite=overwrite, process_group=process_group, storage_options=storage_options)


def load_model_and_optim_state(
    dir: Any,
    model: torch.nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    *,
    strict: bool = True,
    process_group: Any = None,
    storage_options: StorageOptions = None,
) -> None:
    """Loads, in place, what `save_model_and_optim_state` saved, into any layout of the same
    model. The optimizer's state is created for every parameter the checkpoint has state for.
    With ``strict``, a model or optimizer tensor the checkpoint lacks raises
    ``KeyMismatchError`` (as ``Module.load_state_dict(strict=True)``); without, it keeps its
    value."""
    msd = get_model_state_dict(model, options=_state_dict_options())
    sd: Dict[str, Any] = {_MODEL: msd}
    if optim is not None:
        osd = get_optimizer_state_dict(model, optim, options=_state_dict_options())
        _add_missing_optim_state(osd, msd, get_metadata(dir, storage_options=storage_options))
        sd[_OPTIM] = osd
    load(sd, dir, strict=strict, process_group=process_group, storage_options=storage_options)
    set_model_state_dict(model, sd[_MODEL], options=_state_dict_options())
    if optim is not None:
        set_optimizer_state_dict(model, optim, sd[_OPTIM], options=_state_dict_options())


def _add_missing_optim_state(osd: Dict[str, Any], msd: Dict[str, Any], meta: Dict[str, Dict[str, Any]]) -> None:
    """A fresh optimizer has no state yet: create targets shaped (and sharded) like their
    parameter for every ``optim.state.<param>.<name>`` the checkpoint holds."""
    prefix = f"{_OPTIM}.state."
    for key, m in meta.items():
        if not key.startswith(prefix):
            continue
        flat = key[len(_OPTIM) + 1 :]
        if flat in osd:
            continue
        param_name, _, _state_name = flat[len("state.") :].rpartition(".")
        param = msd.get(param_name)
        if param is not None and tuple(param.shape) == tuple(m["shape"]):
            osd[flat] = torch.empty_like(param, dtype=m["dtype"])
        else:
            osd[flat] = torch.empty(m["shape"], dtype=m["dtype"])


def _unshard_prefixed(
    dir: Any, prefix: str, device: Any, rank0_only: bool, no_dist: bool, storage_options: StorageOptions
) -> Dict[str, Any]:
    keys = [k for k in get_metadata(dir, storage_options=storage_options) if k.startswith(prefix + ".")]
    full = unshard(
        dir, keys, device=device, rank0_only=rank0_only, no_dist=no_dist, storage_options=storage_options
    )
    return {k[len(prefix) + 1 :]: v for k, v in full.items()}


def unshard_model_state(
    dir: Any,
    device: Any = None,
    rank0_only: bool = False,
    no_dist: bool = False,
    *,
    storage_options: StorageOptions = None,
) -> Dict[str, torch.Tensor]:
    """The full model state dict saved by `save_model_and_optim_state`."""
    return _unshard_prefixed(dir, _MODEL, device, rank0_only, no_dist, storage_options)


def unshard_optim_state(
    dir: Any,
    device: Any = None,
    rank0_only: bool = False,
    no_dist: bool = False,
    *,
    storage_options: StorageOptions = None,
) -> Dict[str, Any]:
    """The full optimizer state: ``{"state": {param: {name: tensor}}, "param_groups": [...]}``."""
    if _not_rank0(rank0_only, no_dist):
        return {}
    flat = _unshard_prefixed(dir, _OPTIM, device, rank0_only, no_dist, storage_options)
    state: Dict[str, Dict[str, Any]] = {}
    for k, v in flat.items():
        param, _, name = k[len("state.") :].rpartition(".")
        state.setdefault(param, {})[name] = v
    groups: Dict[str, Dict[str, Any]] = {}
    group_prefix = "param_groups."
    for path, v in _native.load_common(native_location(dir, storage_options)):
        if len(path) == 2 and path[0] == _OPTIM and str(path[1]).startswith(group_prefix):
            param, _, name = str(path[1])[len(group_prefix) :].rpartition(".")
            groups.setdefault(param, {})[name] = _from_plain(v)
    return {"state": state, "param_groups": groups}
