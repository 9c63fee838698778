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
from concurrent.futures import Future
from typing import Any, Dict, Iterable, Optional, Tuple, cast

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
from .._core import io, statedict
from .._core.paths import dotted, from_native_path, set_path
from .._core.storage import StorageOptions, location_url, native_location
from .._core.values import from_plain, like_request, to_plain
from .manager import CheckpointManager

__all__ = [
    "CheckpointManager",
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
    items, common = statedict.save_request(state_dict, comm, rank, kind)
    where = native_location(location, storage_options)
    if kind == "dcp":
        return statedict.write_dcp(items, common, rank, where, comm, overwrite)
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
        staged = async_stager.stage(statedict.flatten_stateful(state_dict))
        state_dict = staged.result() if isinstance(staged, Future) else staged
    comm, rank = io.communicator(process_group, no_dist)
    items, common = statedict.save_request(state_dict, comm, rank, kind)
    where = native_location(location, storage_options)
    if kind == "dcp":
        future = statedict.write_dcp_in_background(items, common, rank, where, process_group, no_dist, overwrite)
    else:
        saver = io.saver_for(process_group, items, no_dist)
        meta = to_plain(content_metadata) if content_metadata is not None else None
        handle = io.save(items, [], common, where, comm, saver=saver, overwrite=overwrite, content_metadata=meta)
        future = statedict.in_background(handle.finalize)
    if async_stager is not None and default_stager and getattr(getattr(async_stager, "_config", None), "use_async_staging", False):
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        staged_future: "Future[None]" = Future()
        staged_future.set_result(None)
        # DCP's future holds its Metadata; this one holds tessera's report.
        return AsyncSaveResponse(staging_completion=staged_future, upload_completion=cast(Any, future))
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
    statedict.load(state_dict, _location(checkpoint_id, storage_reader, "storage_reader"), process_group, strict, storage_options, no_dist)


def get_metadata(dir: Any, *, storage_options: StorageOptions = None) -> Dict[str, Dict[str, Any]]:
    """Key → ``{"dtype": torch.dtype, "shape": tuple}`` of every stored tensor."""
    return statedict.tensors_metadata(native_location(dir, storage_options))


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
    out = statedict.unshard(native_location(dir, storage_options), keys)
    if device is not None:
        out = {k: t.to(device) for k, t in out.items()}
    return out


# ---------------------------------------------------------------------------------------------
# Model and optimizer (OLMo-core style)

_MODEL, _OPTIM = "model", "optim"


def _state_dict_options() -> Any:
    return StateDictOptions(flatten_optimizer_state_dict=True)


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
    common = statedict.load(sd, dir, process_group, strict, storage_options)
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
            raise statedict.torch_key_error(location_url(dir), missing, [])
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
