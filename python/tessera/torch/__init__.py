"""`tessera.torch`: checkpoints of torch state dicts holding plain tensors and DTensors.

Sharding is derived from each DTensor's mesh and placements (``Shard``, ``Replicate``, and the
``_StridedShard`` of FSDP2 over tensor parallelism; uneven shards included); replicated copies
are written once. Loading is in place, into whatever
layout the given state dict has: another mesh, another world size, or one process.

It follows ``torch.distributed.checkpoint`` (DCP): a top-level value with ``state_dict()`` and
``load_state_dict()`` (DCP's ``Stateful``: a model, an optimizer, torchtitan's wrappers and train
state) is saved as its ``state_dict()`` and, on load, loaded in place into its ``state_dict()``
and handed back through ``load_state_dict()``; ``checkpoint_id`` / ``storage_writer`` /
``storage_reader``, ``process_group``, ``no_dist`` and :func:`async_save` (a future, or DCP's
``AsyncSaveResponse``) are DCP's; :mod:`tessera.torch.dcp` has DCP's defaults (overwrite, a DCP
directory); torch's
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
import torch.distributed.checkpoint.state_dict as torch_state_dict
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
from .._core import io
from .._core.dtypes import tessera_dtype_to_torch
from .._core.descriptors import load_tensor, save_tensor
from .._core.layout import is_dtensor, layout
from .._core.paths import Seg, dotted, from_native_path, leaves, set_path, to_native_path
from .._core.staging import background_comm
from .._core.storage import StorageOptions, location_url, native_location
from .._core.values import TORCH_SAVE_KEY, from_plain, is_stateful, like_request, to_plain
from ..errors import KeyMismatchError, TesseraError

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
    return {k: (v.state_dict() if is_stateful(v) else v) for k, v in state_dict.items()}


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


def _split(state_dict: Dict[str, Any]) -> Tuple[List[Tuple[Tuple[Seg, ...], torch.Tensor]], List[Tuple[Tuple[Seg, ...], Any]]]:
    tensors: List[Tuple[Tuple[Seg, ...], torch.Tensor]] = []
    values: List[Tuple[Tuple[Seg, ...], Any]] = []
    for path, leaf in leaves(state_dict):
        (tensors if isinstance(leaf, torch.Tensor) else values).append((path, leaf))
    return tensors, values


def _save_request(state_dict: Dict[str, Any], comm: Any, rank: int, kind: str = "tessera") -> Tuple[List[io.SaveItem], list]:
    """The tensors to save, described for the core, and the common values (on rank 0: every
    rank's, each key once; collective over ``comm``). For a DCP-format save (``kind``) a tuple
    is kept as its ``torch.save`` bytes, so that it is written (and DCP loads it) as a tuple,
    as DCP's own save writes it; tessera's format stores it as a list."""
    tensors, values = _split(_flatten_stateful(state_dict))
    items: List[io.SaveItem] = []
    for path, t in tensors:
        local, shape, offset, replica = layout(t, rank)

        def describe(host: Any, key: str = dotted(path), t: Any = t, shape: Any = shape, offset: Any = offset, replica: Any = replica) -> Any:
            return save_tensor(key, t.dtype, host.shape, shape, offset, replica_id=replica, data=host)

        items.append((local, describe))
    plain = to_plain if kind == "dcp" else _plain_with_tuples
    common = io.common_values(comm, rank, [(to_native_path(p), v) for p, v in values], plain)
    return items, common


def _plain_with_tuples(value: Any) -> Any:
    return to_plain(value, tuples=True)


def _dcp_call(what: str, planner: Any, use_collectives: bool) -> None:
    """Refuses what of DCP's call options tessera cannot honour, naming it: a planner other
    than DCP's default one (tessera plans the files itself; the default planner's options only
    shape DCP's own files), and a save without collectives (tessera's commit is collective)."""
    if planner is not None:
        from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

        if type(planner) not in (DefaultSavePlanner, DefaultLoadPlanner):
            raise TypeError(
                f"{what}: tessera plans its reads and writes itself, so a custom planner "
                f"({type(planner).__name__}) cannot be honoured; pass planner=None (DCP's default planner is accepted)"
            )
    if not use_collectives:
        raise ValueError(
            f"{what}: use_collectives=False is not supported: tessera's commit is collective "
            "(every rank's files are checked before the checkpoint counts as saved)"
        )


def save(
    state_dict: Dict[str, Any],
    checkpoint_id: Any = None,
    *,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    overwrite: bool = False,
    format: str = "tessera",
    content_metadata: Optional[dict] = None,
    storage_options: StorageOptions = None,
) -> dict:
    """Saves a (nested) state dict to ``checkpoint_id`` (a directory or an object-store URL;
    or where ``storage_writer`` points); under torch.distributed every rank of
    ``process_group`` calls it (with ``no_dist``, this process saves alone). Tensor keys are
    the dotted paths; other values are saved once each: a key several ranks hold from the
    lowest of them (the same for all, as training state is), a key of some ranks only (a
    per-rank dataloader state) from those, as DCP keeps every rank's. A checkpoint already
    there is kept unless ``overwrite`` (DCP overwrites; see the README). ``planner`` may be
    DCP's default planner (tessera plans its files itself); ``use_collectives=False`` is
    refused. ``storage_options`` configure an object store (``object_store`` keys, over the
    environment). Returns the report.

    A ``storage_writer`` that writes a format of its own (torch's ``HuggingFaceStorageWriter``)
    is handed to DCP's ``save`` with the state and the DCP arguments, and what it writes is
    that writer's: tessera does not write that format.

    ``format`` is what is written: ``"tessera"`` (tessera's own, self-checking format) or
    ``"dcp"``, a PyTorch DCP directory (``.metadata``, written last, is the commit) that torch
    DCP, Megatron and tessera load, and that tools finding checkpoints by DCP's ``.metadata``
    (torchtitan's resume) find. Its non-tensor values are stored as DCP's own save stores them
    (byte items holding ``torch.save(value)`` under DCP's flattened keys, their paths in
    ``planner_data``; a tuple stays a tuple), which ``torch.distributed.checkpoint.load`` and
    OLMo-core find, and again in Megatron's ``common.pt``, which Megatron reads; a value of
    some ranks only is the one those ranks hold, written into rank 0's data file."""
    if _for_dcp_itself(storage_writer):
        import torch.distributed.checkpoint as dcp

        return cast(dict, dcp.save(
            state_dict,
            checkpoint_id=checkpoint_id,
            storage_writer=storage_writer,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
            use_collectives=use_collectives,
        ))
    _dcp_call("save", planner, use_collectives)
    kind = _format(format, content_metadata)
    location = _location(checkpoint_id, storage_writer, "storage_writer")
    comm, rank = io.communicator(process_group, no_dist)
    items, common = _save_request(state_dict, comm, rank, kind)
    where = native_location(location, storage_options)
    if kind == "dcp":
        described, keep_alive = io.on_host(items)
        common_pt = _common_pt(common, rank)
        report = _native.save_torch_dist(described, [], common_pt, where, comm, overwrite=overwrite, common=common)
        del keep_alive
        return cast(dict, report)
    meta = to_plain(content_metadata) if content_metadata is not None else None
    return cast(dict, io.save(items, [], common, where, comm, overwrite=overwrite, content_metadata=meta))


def _for_dcp_itself(storage_writer: Any) -> bool:
    """Whether ``storage_writer`` writes a format of its own that tessera does not write, and
    so is handed to DCP's own save: torch's ``HuggingFaceStorageWriter`` (Hugging Face
    safetensors with DCP's sharding metadata, which torch's consolidation reads)."""
    if storage_writer is None:
        return False
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
    except ImportError:
        return False
    return isinstance(storage_writer, HuggingFaceStorageWriter)


_FORMATS = ("tessera", "dcp")


def _format(format: str, content_metadata: Any) -> str:
    if format not in _FORMATS:
        raise ValueError(f"format {format!r}: expected one of {', '.join(_FORMATS)}")
    if format == "dcp" and content_metadata is not None:
        raise ValueError("content_metadata is kept in tessera's format only; save it as a value of the state dict")
    return format


def _common_pt(common: List[Tuple[Any, Any]], rank: int) -> Optional[bytes]:
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


def async_save(
    state_dict: Dict[str, Any],
    checkpoint_id: Any = None,
    *,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: Any = None,
    async_checkpointer_type: Any = None,
    async_stager: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    overwrite: bool = False,
    format: str = "tessera",
    content_metadata: Optional[dict] = None,
    storage_options: StorageOptions = None,
) -> Any:
    """:func:`save` in the background, as DCP's ``async_save``: returns once this rank's bytes
    are staged (the state may change from then on) with a ``concurrent.futures.Future`` whose
    ``result()`` is the report, or raises the save's error (the same on every rank; nothing was
    committed). The commit needs no call from the training loop.

    DCP's staging options are taken as DCP takes them: with an ``async_stager`` that stages in
    the background (``DefaultStager`` with ``use_async_staging``), the result is DCP's
    ``AsyncSaveResponse`` (``staging_completion``, done when this returns: tessera has staged
    into its own page-locked pool; ``upload_completion``, the future above). Another stager
    stages the state first, and its copy is saved. ``async_checkpointer_type`` (thread or
    process) is accepted either way: tessera writes from native threads that do not hold the
    GIL, so a process brings nothing.

    With ``format="dcp"`` (see :func:`save`) the state is copied to host memory before this
    returns, and the whole save, its collectives included, runs in the background on a gloo
    group of its own, as DCP's thread-based ``async_save`` runs it."""
    if _for_dcp_itself(storage_writer):
        import torch.distributed.checkpoint as dcp

        return dcp.async_save(
            state_dict,
            checkpoint_id=checkpoint_id,
            storage_writer=storage_writer,
            planner=planner,
            process_group=process_group,
            async_checkpointer_type=async_checkpointer_type or dcp.state_dict_saver.AsyncCheckpointerType.THREAD,
            async_stager=async_stager,
            no_dist=no_dist,
            use_collectives=use_collectives,
        )
    _dcp_call("async_save", planner, use_collectives)
    kind = _format(format, content_metadata)
    location = _location(checkpoint_id, storage_writer, "storage_writer")
    default_stager = async_stager is None or _is_default_stager(async_stager)
    if not default_stager:
        staged = async_stager.stage(_flatten_stateful(state_dict))
        state_dict = staged.result() if isinstance(staged, Future) else staged
    comm, rank = io.communicator(process_group, no_dist)
    items, common = _save_request(state_dict, comm, rank, kind)
    where = native_location(location, storage_options)
    if kind == "dcp":
        described, keep_alive = io.on_host(items, copy=True)
        common_pt = _common_pt(common, rank)
        background = background_comm(process_group, no_dist)

        def write() -> Any:
            try:
                return _native.save_torch_dist(
                    described, [], common_pt, where, background, overwrite=overwrite, common=common
                )
            finally:
                keep_alive.clear()

        future = _in_background(write)
    else:
        saver = io.saver_for(process_group, items, no_dist)
        meta = to_plain(content_metadata) if content_metadata is not None else None
        handle = io.save(items, [], common, where, comm, saver=saver, overwrite=overwrite, content_metadata=meta)
        future = _in_background(handle.finalize)
    if async_stager is not None and default_stager and getattr(getattr(async_stager, "_config", None), "use_async_staging", False):
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        staged_future: "Future[None]" = Future()
        staged_future.set_result(None)
        # DCP's future holds its Metadata; this one holds tessera's report.
        return AsyncSaveResponse(staging_completion=staged_future, upload_completion=cast(Any, future))
    return future


def _in_background(work: Any) -> "Future[dict]":
    """A future of ``work()``'s result (or error), run on a thread of its own."""
    future: "Future[dict]" = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=run, name="tessera-async-save", daemon=True).start()
    return future


def _is_default_stager(stager: Any) -> bool:
    """Whether ``stager`` is DCP's own ``DefaultStager`` (a copy to host memory, which tessera's
    staging does itself)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager
    except ImportError:
        return False
    return type(stager) is DefaultStager


def load(
    state_dict: Dict[str, Any],
    checkpoint_id: Any = None,
    *,
    storage_reader: Any = None,
    planner: Any = None,
    process_group: Any = None,
    no_dist: bool = False,
    strict: bool = True,
    storage_options: StorageOptions = None,
) -> None:
    """Loads in place: every tensor (or DTensor shard) of ``state_dict`` is filled from the
    checkpoint, whatever layout it was saved in; other values are replaced by the saved ones
    (a tuple stays a tuple); a ``Stateful`` value is loaded into its ``state_dict()`` and
    given it back through ``load_state_dict()`` (an optimizer that has taken no step yet gets
    its state created first, as ``get_state_dict`` creates it). Tensors that share memory (tied
    weights) are filled once. A tensor stored in another dtype than the request's is cast
    into it (``Tensor.copy_``, as DCP casts: a bf16 export loads into an fp32 model). With ``strict``, a tensor or value the checkpoint lacks raises
    ``KeyMismatchError``, as DCP raises.

    Under torch.distributed every rank of ``process_group`` calls it (as DCP's ``load``): the
    ranks check the checksum blocks they share together, so from an object store each
    downloads only the bytes it needs; with ``no_dist`` this process loads alone. ``planner``
    may be DCP's default planner (tessera plans its reads itself)."""
    _dcp_call("load", planner, True)
    _load(state_dict, checkpoint_id, storage_reader, process_group, strict, storage_options, no_dist)


def _load(
    state_dict: Dict[str, Any],
    checkpoint_id: Any,
    storage_reader: Any,
    process_group: Any,
    strict: bool,
    storage_options: StorageOptions,
    no_dist: bool = False,
) -> List[Tuple[Any, Any]]:
    """:func:`load`, returning every common value the checkpoint holds (native paths), for
    the callers that read more of them than the request names."""
    location = _location(checkpoint_id, storage_reader, "storage_reader")
    where = native_location(location, storage_options)
    stored = _native.load_tensors_metadata(where)
    _init_fresh_optimizers(state_dict, stored)
    flat = _flatten_stateful(state_dict)
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
        raise _torch_key_error(location_url(location), list(e.unexpected), list(e.missing)) from None
    saved: Dict[Tuple[Seg, ...], Any] = {}
    for p, v in result["common"]:
        saved.update(_saved_leaves(from_native_path(p), v))
    missing: List[str] = []
    for key in flat:  # the request's keys are what is loaded
        flat[key] = _replace_values(flat[key], (("k", key),), saved, missing)
    if strict and missing:
        raise _torch_key_error(location_url(location), missing, [])
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
    _, rank = io.communicator()
    return rank != 0


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
    def whole(key: str) -> Any:
        return lambda buf: load_tensor(key, buf.dtype, buf.shape, buf.shape, (0,) * buf.dim(), data=buf)

    items: List[io.LoadItem] = [(t, whole(k), None) for k, t in out.items()]
    io.load(items, [], native_location(dir, storage_options), None)
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


def _torch_key_error(location: str, missing: List[str], unexpected: List[str]) -> Exception:
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
    model; or a checkpoint OLMo-core or torchtitan wrote through torch DCP, with the optimizer
    state flattened (``param_groups.<param>.lr``) or not (``param_groups.0.lr`` with the group's
    ``params``). The optimizer's state is created for every parameter the checkpoint has state
    for. With ``strict``, a model or optimizer tensor or value the checkpoint lacks raises
    ``KeyMismatchError`` (as ``Module.load_state_dict(strict=True)``); without, it keeps its
    value."""
    msd = get_model_state_dict(model, options=_state_dict_options())
    sd: Dict[str, Any] = {_MODEL: msd}
    osd: Dict[str, Any] = {}
    if optim is not None:
        osd = get_optimizer_state_dict(model, optim, options=_state_dict_options())
        _add_missing_optim_state(osd, msd, get_metadata(dir, storage_options=storage_options))
        # Values are matched by name below, whichever layout the checkpoint has.
        sd[_OPTIM] = {k: v for k, v in osd.items() if isinstance(v, torch.Tensor)}
    common = _load(sd, dir, None, process_group, strict, storage_options)
    set_model_state_dict(model, sd[_MODEL], options=_state_dict_options())
    if optim is not None:
        saved = _optim_values(common)
        missing = []
        for k, v in osd.items():
            if isinstance(v, torch.Tensor):
                osd[k] = sd[_OPTIM][k]
            elif k in saved:
                osd[k] = like_request(saved[k], v)
            else:
                missing.append(f"{_OPTIM}.{k}")
        if strict and missing:
            raise _torch_key_error(location_url(dir), missing, [])
        set_optimizer_state_dict(model, optim, osd, options=_state_dict_options())


def _optim_values(common: Iterable[Tuple[Any, Any]]) -> Dict[str, Any]:
    """The optimizer's saved values by their flattened name (``state.<param>.<name>``,
    ``param_groups.<param>.<name>``), from either layout: flattened, as tessera and
    ``flatten_optimizer_state_dict=True`` save it, or torch's own (``param_groups`` a list of
    groups naming their ``params``, as OLMo-core 3.0 saves by default)."""
    values: Dict[str, Any] = {}
    groups: Dict[int, Dict[str, Any]] = {}
    for native_path, v in common:
        path = from_native_path(native_path)
        if not path or path[0] != ("k", _OPTIM):
            continue
        rest = path[1:]
        if len(rest) >= 3 and rest[0] == ("k", "param_groups") and rest[1][0] == "i":
            # torch's layout: param_groups.<i>.<name>[...]
            set_path(groups.setdefault(rest[1][1], {}), rest[2:], from_plain(v))
            continue
        values[dotted(rest)] = from_plain(v)
    for group in groups.values():
        for param in group.get("params", ()):
            for name, v in group.items():
                if name != "params":
                    values[f"param_groups.{param}.{name}"] = v
    return values


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
    """The full optimizer state: ``{"state": {param: {name: tensor}}, "param_groups": {param:
    {name: value}}}``, whichever layout the checkpoint holds it in."""
    if _not_rank0(rank0_only, no_dist):
        return {}
    flat = _unshard_prefixed(dir, _OPTIM, device, rank0_only, no_dist, storage_options)
    state: Dict[str, Dict[str, Any]] = {}
    for k, v in flat.items():
        param, _, name = k[len("state.") :].rpartition(".")
        state.setdefault(param, {})[name] = v
    groups: Dict[str, Dict[str, Any]] = {}
    group_prefix = "param_groups."
    for key, v in _optim_values(_native.load_common(native_location(dir, storage_options))).items():
        if key.startswith(group_prefix):
            param, _, name = key[len(group_prefix) :].rpartition(".")
            groups.setdefault(param, {})[name] = v
    return {"state": state, "param_groups": groups}
