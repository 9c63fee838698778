"""Nested state dicts as torch DCP holds them, for the front ends that speak DCP's habits
(:mod:`tessera.torch`, :mod:`tessera.olmo_core.v3`): a save request (tensor keys are dotted
paths, other values common), the DCP-format write (a Megatron ``torch_dist`` / DCP directory)
now or in the background, the in-place load, tensor metadata and whole tensors. Formats and
checks are the core's; this module only walks the dicts.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Dict, Iterable, List, Optional, Tuple, cast

import torch
import torch.distributed.checkpoint.state_dict as torch_state_dict

from .. import _native
from ..errors import KeyMismatchError, TesseraError
from . import io
from .descriptors import load_tensor, save_tensor
from .dtypes import tessera_dtype_to_torch
from .layout import layout
from .paths import Seg, dotted, from_native_path, leaves, set_path, to_native_path
from .staging import background_comm
from .storage import StorageOptions, location_url, native_location
from .values import TORCH_SAVE_KEY, from_plain, is_stateful, like_request, to_plain

__all__ = [
    "flatten_stateful",
    "save_request",
    "write_dcp",
    "write_dcp_in_background",
    "in_background",
    "load",
    "managed_save",
    "managed_restore",
    "torch_key_error",
    "tensors_metadata",
    "unshard",
]


def flatten_stateful(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """``state_dict`` with every top-level ``Stateful`` value replaced by its ``state_dict()``
    (as DCP does; nested values are data)."""
    return {k: (v.state_dict() if is_stateful(v) else v) for k, v in state_dict.items()}


def _split(state_dict: Dict[str, Any]) -> Tuple[List[Tuple[Tuple[Seg, ...], torch.Tensor]], List[Tuple[Tuple[Seg, ...], Any]]]:
    tensors: List[Tuple[Tuple[Seg, ...], torch.Tensor]] = []
    values: List[Tuple[Tuple[Seg, ...], Any]] = []
    for path, leaf in leaves(state_dict):
        (tensors if isinstance(leaf, torch.Tensor) else values).append((path, leaf))
    return tensors, values


def save_request(state_dict: Dict[str, Any], comm: Any, rank: int, kind: str = "tessera") -> Tuple[List[io.SaveItem], list]:
    """The tensors to save, described for the core, and the common values (on rank 0: every
    rank's, each key once; collective over ``comm``). For a DCP-format save (``kind``) a tuple
    is kept as its ``torch.save`` bytes, so that it is written (and DCP loads it) as a tuple,
    as DCP's own save writes it; tessera's format stores it as a list."""
    tensors, values = _split(flatten_stateful(state_dict))
    plain = to_plain if kind == "dcp" else _plain_with_tuples
    common = io.common_values(comm, rank, [(to_native_path(p), v) for p, v in values], plain)
    return _save_items(tensors, rank), common


def _save_items(tensors: List[Tuple[Tuple[Seg, ...], torch.Tensor]], rank: int, untie: bool = False) -> List[io.SaveItem]:
    """The save items of ``tensors``; with ``untie``, tied tensors once, under the first path
    (as a load describes them: ``io.tied_span``)."""
    items: List[io.SaveItem] = []
    seen: Dict[Tuple[Any, ...], None] = {}
    for path, t in tensors:
        local, shape, offset, replica = layout(t, rank)
        if untie and local.numel():
            span = io.tied_span(local, offset)
            if span in seen:
                continue
            seen[span] = None

        def describe(host: Any, key: str = dotted(path), t: Any = t, shape: Any = shape, offset: Any = offset, replica: Any = replica) -> Any:
            return save_tensor(key, t.dtype, host.shape, shape, offset, replica_id=replica, data=host)

        items.append((local, describe))
    return items


def managed_save(manager: Any, step: int, state_dict: Dict[str, Any], comm: Any, rank: int) -> bool:
    """Saves ``state_dict`` as ``step`` through a native ``CheckpointManager`` if its policy says
    so (collective). Each rank's copy in the memory tier holds its own plain values, so that an
    in-place restore gives every rank its own back."""
    tensors, values = _split(flatten_stateful(state_dict))
    common = [(to_native_path(p), _plain_with_tuples(v)) for p, v in values]
    # Tied tensors once, as managed_restore describes them: the copy's layout must be the one
    # the restore asks for.
    described, keep_alive = io.on_host(_save_items(tensors, rank, untie=True))
    try:
        return bool(manager.save(step, described, [], common, comm))
    finally:
        del keep_alive


def managed_restore(manager: Any, state_dict: Dict[str, Any], comm: Any) -> Optional[Dict[str, Any]]:
    """Restores the newest complete step of a native ``CheckpointManager`` into ``state_dict``
    in place, as :func:`load` fills it (tensors in place, other values replaced, a top-level
    ``Stateful`` given back what was restored); returns the step, the tier and the notes, or
    None when no tier holds a step."""
    flat = flatten_stateful(state_dict)
    tensors, _ = _split(flat)
    items: List[io.LoadItem] = []
    for path, t in tensors:
        local, shape, offset, _ = layout(t, 0)

        def describe(buf: Any, key: str = dotted(path), shape: Any = shape, offset: Any = offset) -> Any:
            return load_tensor(key, buf.dtype, buf.shape, shape, offset, data=buf)

        items.append((local, describe, offset))
    result = io.restore(manager, items, comm)
    if result is None:
        return None
    saved: Dict[Tuple[Seg, ...], Any] = {}
    for p, v in result["common"]:
        saved.update(_saved_leaves(from_native_path(p), v))
    missing: List[str] = []
    for key in flat:
        flat[key] = _replace_values(flat[key], (("k", key),), saved, missing)
    for key, value in state_dict.items():
        if is_stateful(value):
            value.load_state_dict(flat[key])
        else:
            state_dict[key] = flat[key]
    del result["common"]
    return result


def _plain_with_tuples(value: Any) -> Any:
    return to_plain(value, tuples=True)


def common_pt(common: List[Tuple[Any, Any]], rank: int) -> Optional[bytes]:
    """Rank 0's ``common.pt`` of a DCP-format save: ``torch.save`` of the common values as
    the nested dict they came from (None on other ranks)."""
    if rank != 0:
        return None
    import io as bytes_io

    root: Dict[Any, Any] = {}
    for native_path, value in common:
        set_path(root, from_native_path(native_path), from_plain(value))
    out = bytes_io.BytesIO()
    torch.save(root, out)
    return out.getvalue()


def in_background(work: Any) -> "Future[dict]":
    """A future of ``work()``'s result (or error), run on a thread of its own."""
    future: "Future[dict]" = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=run, name="tessera-async-save", daemon=True).start()
    return future


def load(
    state_dict: Dict[str, Any],
    location: Any,
    process_group: Any,
    strict: bool,
    storage_options: StorageOptions,
    no_dist: bool = False,
) -> List[Tuple[Any, Any]]:
    """Loads ``state_dict`` in place as DCP's ``load`` does (every tensor filled, whatever
    layout saved it; other values replaced by the saved ones; a top-level ``Stateful`` given
    back what was loaded), returning every common value the checkpoint holds (native paths),
    for the callers that read more of them than the request names."""
    where = native_location(location, storage_options)
    stored = _native.load_tensors_metadata(where)
    _init_fresh_optimizers(state_dict, stored)
    flat = flatten_stateful(state_dict)
    tensors, _ = _split(flat)
    items: List[io.LoadItem] = []
    stored_dtypes: List[Any] = []
    for path, t in tensors:
        local, shape, offset, _ = layout(t, 0)
        key = dotted(path)

        def describe(buf: Any, key: str = key, shape: Any = shape, offset: Any = offset) -> Any:
            return load_tensor(key, buf.dtype, buf.shape, shape, offset, data=buf)

        items.append((local, describe, offset))
        stored_dtypes.append(_torch_dtype_of(stored.get(key)))
    comm, _ = io.communicator(process_group, no_dist)
    strict_mode = "raise_unexpected" if strict else "return_unexpected"
    try:
        result = io.load(items, [], where, comm, stored_dtypes=stored_dtypes, strict=strict_mode)
    except KeyMismatchError as e:
        raise torch_key_error(location_url(location), list(e.unexpected), list(e.missing)) from None
    saved: Dict[Tuple[Seg, ...], Any] = {}
    for p, v in result["common"]:
        saved.update(_saved_leaves(from_native_path(p), v))
    missing: List[str] = []
    for key in flat:  # the request's keys are what is loaded
        flat[key] = _replace_values(flat[key], (("k", key),), saved, missing)
    if strict and missing:
        raise torch_key_error(location_url(location), missing, [])
    for key, value in state_dict.items():
        if is_stateful(value):
            value.load_state_dict(flat[key])
        else:
            state_dict[key] = flat[key]
    return cast(List[Tuple[Any, Any]], result["common"])


def _saved_leaves(path: Tuple[Seg, ...], value: Any) -> Iterable[Tuple[Tuple[Seg, ...], Any]]:
    """A saved common value as the leaves a request is matched against: tessera's format
    stores every leaf apart, a DCP directory's ``common.pt`` whole dicts under top-level keys
    (whose keys may hold dots, as torchtitan's flattened optimizer state has them)."""
    if isinstance(value, dict) and value and set(value) != {TORCH_SAVE_KEY}:
        for k, v in value.items():
            yield from _saved_leaves(path + (("k", k),), v)
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            yield from _saved_leaves(path + (("i", i),), v)
    else:
        yield path, from_plain(value)


def _torch_dtype_of(stored: Any) -> Any:
    """The torch dtype of a stored tensor's metadata (``(dtype, shape)``), None when it is not
    stored or torch has no such dtype (the core then names the mismatch)."""
    if stored is None:
        return None
    try:
        return tessera_dtype_to_torch(stored[0])
    except TesseraError:
        return None


def _init_fresh_optimizers(state_dict: Dict[str, Any], stored: Dict[str, Any]) -> None:
    """Gives every top-level optimizer that has no state yet (no step taken) the state the
    checkpoint holds tensors for (``stored``: the checkpoint's tensor metadata), created as
    ``get_state_dict`` creates it (a step with zero gradients and a zero learning rate: the
    parameters do not move), so that loading fills it."""
    fresh = [k for k, v in state_dict.items() if isinstance(v, torch.optim.Optimizer) and not v.state]
    if not fresh:
        return
    for key in fresh:
        if not any(k.startswith(f"{key}.state.") for k in stored):
            continue  # saved fresh too: nothing to create
        init = getattr(torch_state_dict, "_init_optim_state", None)
        if init is None:
            raise KeyMismatchError(
                f"the optimizer {key!r} has no state yet and this torch ({torch.__version__}) cannot create it "
                "for loading: take one optimizer step before loading, or use "
                "tessera.torch.load_model_and_optim_state(dir, model, optim)"
            )
        init(state_dict[key])


def _holds_tensor(node: Any) -> bool:
    if isinstance(node, torch.Tensor):
        return True
    if isinstance(node, dict):
        return any(_holds_tensor(v) for v in node.values())
    if isinstance(node, list):
        return any(_holds_tensor(v) for v in node)
    return False


def _replace_values(node: Any, path: Tuple[Seg, ...], saved: Dict[Tuple[Seg, ...], Any], missing: List[str]) -> Any:
    """Gives every part of the request ``node`` (at ``path``) that holds no tensor the value
    saved there (rebuilt whole from the saved leaves under ``path``: a list or dict may have
    another length than the request's; a tuple the request holds stays a tuple). A part the
    checkpoint has nothing for is kept, and its dotted key added to ``missing``. Returns the
    node to put at ``path``."""
    if _holds_tensor(node):
        if isinstance(node, dict):
            for k in list(node):
                node[k] = _replace_values(node[k], path + (("k", k),), saved, missing)
        elif isinstance(node, list):
            for i in range(len(node)):
                node[i] = _replace_values(node[i], path + (("i", i),), saved, missing)
        return node
    if path in saved:
        return like_request(saved[path], node)
    under = [(p, v) for p, v in saved.items() if len(p) > len(path) and p[: len(path)] == path]
    if not under:
        missing.append(dotted(path))
        return node
    root: Dict[str, Any] = {}
    for p, v in under:
        set_path(root, (("k", "value"),) + p[len(path) :], v)
    return like_request(root["value"], node)


def torch_key_error(location: str, missing: List[str], unexpected: List[str]) -> Exception:
    """A key mismatch in ``Module.load_state_dict``'s words: ``missing`` are keys the caller
    asked for that the checkpoint lacks (the core's Megatron-named ``unexpected``), and
    ``unexpected`` keys the checkpoint holds that the caller did not ask for."""
    parts = []
    if missing:
        parts.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
    if unexpected:
        parts.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
    hint = "\n\t(load with strict=False to keep the values the checkpoint lacks)" if missing else ""
    err = KeyMismatchError(f"Error(s) in loading state_dict from {location}:\n\t" + "\n\t".join(parts) + hint)
    # The core's names (Megatron's: missing = stored but not requested) and torch's.
    err.missing, err.unexpected = unexpected, missing
    err.missing_keys, err.unexpected_keys = missing, unexpected  # type: ignore[attr-defined]
    return err


def write_dcp(items: List[io.SaveItem], common: list, rank: int, where: Any, comm: Any, overwrite: bool) -> dict:
    """Writes a save request (of ``kind`` "dcp") as a DCP directory (collective): tensors from
    host memory, the common values as DCP's own save stores them (byte items under DCP's keys,
    their paths in ``planner_data``) and again in Megatron's ``common.pt``; returns the report."""
    described, keep_alive = io.on_host(items)
    report = _native.save_torch_dist(described, [], common_pt(common, rank), where, comm, overwrite=overwrite, common=common)
    del keep_alive
    return dict(report)


def write_dcp_in_background(
    items: List[io.SaveItem], common: list, rank: int, where: Any, process_group: Any, no_dist: bool, overwrite: bool
) -> "Future[dict]":
    """:func:`write_dcp` in the background: the tensors are copied to host memory before this
    returns, then the whole save, its collectives included, runs on a thread of its own over
    a gloo group of its own (as DCP's thread-based ``async_save``). The future holds the report
    or the save's error."""
    described, keep_alive = io.on_host(items, copy=True)
    common_bytes = common_pt(common, rank)
    background = background_comm(process_group, no_dist)

    def write() -> Any:
        try:
            return _native.save_torch_dist(described, [], common_bytes, where, background, overwrite=overwrite, common=common)
        finally:
            keep_alive.clear()

    return in_background(write)


def tensors_metadata(where: Any) -> Dict[str, Dict[str, Any]]:
    """Key → ``{"dtype": torch.dtype, "shape": tuple}`` of every stored tensor (the checkpoint
    opened and validated by the core)."""
    return {k: {"dtype": tessera_dtype_to_torch(d), "shape": tuple(s)} for k, (d, s) in _native.load_tensors_metadata(where).items()}


def unshard(
    where: Any, keys: Optional[Iterable[str]] = None, meta: Optional[Dict[str, Dict[str, Any]]] = None
) -> Dict[str, torch.Tensor]:
    """Full tensors (all, or ``keys``) on CPU, read by this process alone (``meta``: the
    checkpoint's :func:`tensors_metadata`, when the caller has it already)."""
    meta = tensors_metadata(where) if meta is None else meta
    wanted = list(meta) if keys is None else list(keys)
    missing = [k for k in wanted if k not in meta]
    if missing:
        raise KeyError(f"not in the checkpoint: {missing}")
    out = {k: torch.empty(meta[k]["shape"], dtype=meta[k]["dtype"]) for k in wanted}

    def whole(key: str) -> Any:
        return lambda buf: load_tensor(key, buf.dtype, buf.shape, buf.shape, (0,) * buf.dim(), data=buf)

    items: List[io.LoadItem] = [(t, whole(k), None) for k, t in out.items()]
    io.load(items, [], where, None)
    return out

