"""The native engine under this package's entry points and strategies: a sharded state dict saved
and loaded by tessera's core (through ``tessera._core.io``), for a strategy the core runs.

``serialization.save`` / ``load`` pick the strategies, as Megatron's do, and hand a strategy the
core runs to :func:`save` / :func:`load` here; the strategies' own ``save`` / ``load`` methods
(which Megatron-style code may call directly) come here too. Both sit above this module, which
never calls back into them.

This module is glue: it walks sharded state dicts, turns their leaves into the core's
descriptors, and puts the results back. Planning, validation and IO happen in Rust.

Values that are not plain (None/bool/int/float/str/bytes and lists/str-keyed dicts of them)
go through ``torch.save`` and come back through ``torch.load(weights_only=True)``, with
``argparse.Namespace`` allowed: loading never runs arbitrary code.

torch is imported where a tensor is made (a load's buffers) or an error of its own is raised:
the package imports without it.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from .. import _native
from .._core import io
from .._core.descriptors import sharded_load_object, sharded_load_tensor, sharded_save_object, sharded_save_tensor
from .._core.dtypes import tessera_dtype_to_torch
from .._core.paths import from_native_path, leaves, set_path, to_native_path
from .._core.storage import StorageOptions, native_location
from .._core.values import decode_object, encode_object, from_plain, is_stateful, match_request, to_plain, torch_save_bytes
from ..errors import KeyMismatchError, NotCoveredError, TesseraError
from .core import COMMON_STATE_FNAME
from .dict_utils import extract_matching_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from .strategies.async_utils import AsyncRequest
from .strategies.filesystem_async import TorchDistWrites
from .validation import (
    StrictHandling,
    _validate_common_state_dict,
    maybe_report_missing_and_unexpected_keys,
    mismatch_message,
    verify_checkpoint_and_load_strategy,
)

__all__ = [
    "CONTENT_METADATA_KEY",
    "split_state_dict",
    "save",
    "save_by_strategy",
    "load",
    "load_by_strategy",
    "tensors_metadata",
    "sharded_metadata",
    "common_state",
    "load_sharded_objects",
    "remove_sharded_tensors",
]

#: Where ``save(..., content_metadata=...)`` keeps it in the common state (Megatron's key).
CONTENT_METADATA_KEY = "content_metadata"


def split_state_dict(sharded_state_dict: Dict[str, Any]) -> Tuple[list, list, list]:
    """Sharded tensors, sharded objects and common (path, value) leaves of a state dict."""
    tensors, objects, common = [], [], []
    for path, leaf in leaves(sharded_state_dict):
        if not path:
            continue  # an empty state dict: the root holds nothing to save
        if isinstance(leaf, ShardedTensor):
            tensors.append((path, leaf))
        elif isinstance(leaf, ShardedObject):
            objects.append((path, leaf))
        elif isinstance(leaf, LocalNonpersistentObject):
            continue
        elif isinstance(leaf, ShardedTensorFactory):
            raise TesseraError(f"factory {leaf.key!r} was not applied")
        else:
            common.append((path, leaf.state_dict() if is_stateful(leaf) else leaf))
    return tensors, objects, common


def _save_items(tensors: List[Tuple[Any, ShardedTensor]]) -> List[io.SaveItem]:
    """Each sharded tensor as ``tessera._core.io`` saves it: its data and how to describe it."""
    return [(sh.data, partial(sharded_save_tensor, sh)) for _, sh in tensors]


# ---------------------------------------------------------------------------------------------
# Save


def save(
    strategy: Any,
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: Any,
    *,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
    content_metadata: Optional[dict] = None,
    overwrite: bool = False,
    process_group: Any = None,
    async_saver: Any = None,
    storage_options: StorageOptions = None,
    sharded_part_only: bool = False,
) -> Any:
    """Saves the whole state (tensors, objects, common state) in one commit with the core's
    writer that ``strategy.native_writer`` names: tessera's format, or Megatron's
    ``torch_dist``. Arguments as ``serialization.save`` takes them; ``sharded_part_only``: the
    state is what Megatron's protocol gives a strategy, after its common strategy wrote
    ``common.pt`` (a ``torch_dist`` save keeps that file). Returns None, or with
    ``async_sharded_save`` the :class:`~.strategies.async_utils.AsyncRequest`."""
    if content_metadata is not None:
        sharded_state_dict[CONTENT_METADATA_KEY] = content_metadata
    apply_factories(sharded_state_dict)
    tensors, objects, common = split_state_dict(sharded_state_dict)
    if validate_access_integrity:
        common_state_dict: Dict[str, Any] = {}
        for path, value in common:
            set_path(common_state_dict, path, value)
        if preprocess_common_before_consistancy_check is not None:
            common_state_dict = preprocess_common_before_consistancy_check(common_state_dict)
        _validate_common_state_dict(common_state_dict)
    comm, rank = io.communicator(process_group)
    location = native_location(checkpoint_dir, storage_options)
    if strategy.native_writer == "torch_dist":
        return _save_torch_dist(
            tensors, objects, common, location, comm, rank, async_sharded_save,
            keep_common_pt=sharded_part_only,
            overwrite=overwrite, validate=validate_access_integrity,
            # Megatron's thread_count: the data files each rank writes.
            files_per_rank=max(1, int(getattr(getattr(strategy, "base_strategy", strategy), "thread_count", 1) or 1)),
        )
    items = _save_items(tensors)
    saver = None
    if async_sharded_save:
        saver = async_saver if async_saver is not None else io.saver_for(process_group, items)
    native_objects = [sharded_save_object(o, encode_object(o.data)) for _, o in objects]
    native_common = [(to_native_path(p), to_plain(v)) for p, v in common] if rank == 0 else []
    kwargs: Dict[str, Any] = dict(
        overwrite=overwrite,
        validate=validate_access_integrity,
        content_metadata=to_plain(content_metadata) if content_metadata is not None else None,
    )
    plan_cache = getattr(strategy, "plan_cache", None)
    if plan_cache is None:
        plan_cache = getattr(getattr(strategy, "base_strategy", None), "plan_cache", None)
    if plan_cache is not None:
        kwargs["plan_cache"] = plan_cache
    handle = io.save(items, native_objects, native_common, location, comm, saver=saver, **kwargs)
    # Megatron's synchronous save returns nothing.
    return AsyncRequest(handle) if saver is not None else None


def save_by_strategy(strategy: Any, sharded_state_dict: Dict[str, Any], checkpoint_dir: Any, async_save: bool) -> Any:
    """``strategy.save`` / ``strategy.async_save`` of a strategy the core writes for: called the
    way Megatron's ``serialization.save`` calls a strategy, with the sharded part after the
    common strategy wrote ``common.pt``, so a ``torch_dist`` save keeps that file."""
    return save(strategy, sharded_state_dict, checkpoint_dir, async_sharded_save=async_save, sharded_part_only=True)


def _save_torch_dist(
    tensors: list,
    objects: list,
    common: list,
    location: Any,
    comm: Any,
    rank: int,
    async_save: bool,
    keep_common_pt: bool = False,
    files_per_rank: int = 1,
    **kwargs: Any,
) -> Any:
    """Writes ``torch_dist`` with the core's writer, as megatron's ``FileSystemWriterAsync``
    does: the core plans the save (collective), each of this rank's ``files_per_rank`` data
    files is written by ``FileSystemWriterAsync.write_preloaded_data`` on a thread of its own
    (in the background when ``async_save``: the request's ``finalize`` then commits), and the
    commit is collective. ``keep_common_pt``: the state is the sharded part only (a strategy's
    ``save`` called the way Megatron's ``serialization.save`` calls it, after its common
    strategy wrote ``common.pt``): the ``common.pt`` already there is committed again rather
    than replaced by an empty one."""
    # An async save writes after the caller has moved on: it writes copies.
    native_tensors, keep_alive = io.on_host(_save_items(tensors), copy=async_save)
    native_objects = [sharded_save_object(o, encode_object(o.data)) for _, o in objects]
    common_pt = b""
    if rank == 0:
        existing = _native.read_file(location, COMMON_STATE_FNAME) if keep_common_pt and not common else None
        if existing is not None:
            common_pt = existing
        else:
            state: Dict[str, Any] = {}
            for path, value in common:
                set_path(state, path, value)
            common_pt = torch_save_bytes(state)
    # The planned save holds keep_alive, the tensors (or copies) whose memory it writes.
    planned = _native.plan_torch_dist(
        native_tensors, native_objects, common_pt, location, keep_alive, comm, files_per_rank=files_per_rank, **kwargs
    )
    writes = TorchDistWrites(planned, location, comm, rank, background=async_save)
    if not async_save:
        writes.finalize()
        return None
    return AsyncRequest(writes)


# ---------------------------------------------------------------------------------------------
# Load


def load(
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: Any,
    sharded_strategy: Any,
    common_strategy: Any,
    strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    process_group: Any = None,
    verify_checksums: bool = True,
    exchange_reads: bool = False,
    collective: bool = True,
) -> Any:
    """Loads ``sharded_state_dict`` with the native reader, for ``sharded_strategy`` (one the
    core reads for, checked against the checkpoint) and ``common_strategy``; returns what
    ``serialization.load`` returns. Arguments as it takes them; a strategy with
    ``exchange_reads`` makes the load exchange its reads over its ``parallelization_group``.

    ``collective``: every rank of ``process_group`` makes this load at once (Megatron's ``load``
    is called by every rank), so the ranks share the checks of the bytes they read: each
    checksum block is verified once, by a rank that reads it, and each rank downloads only the
    bytes it needs. False for a load a rank may make alone; then every rank checks what it reads
    itself, and neither ``exchange_reads`` nor the strict modes that need every rank's request
    (``*_ALL``: missing keys are then the ones this rank did not ask for) reach other ranks."""
    if getattr(sharded_strategy, "exchange_reads", False):
        exchange_reads = True
        process_group = getattr(sharded_strategy, "parallelization_group", None) or process_group
    factories, _ = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sharded_state_dict)
    tensors, objects, _ = split_state_dict(sharded_state_dict)
    comm = io.communicator(process_group)[0] if collective else None
    taken: Set[int] = set()
    targets = [_load_target(sh, taken) for _, sh in tensors]
    # Each target is memory of its own (see _load_target), so io.load fills every one.
    items: List[io.LoadItem] = [(buf, partial(sharded_load_tensor, sh), None) for (_, sh), (buf, _) in zip(tensors, targets)]
    native_objects = [sharded_load_object(o) for _, o in objects]
    # The core finds the mismatched keys; the LOG_* modes are reported here, through `logging`
    # as Megatron does, so the core is asked to return them instead of printing them.
    native_strict = _RETURNED_INSTEAD_OF_LOGGED.get(strict, strict)
    try:
        result = io.load(
            items,
            native_objects,
            native_location(checkpoint_dir),
            comm,
            strict=native_strict.value,
            verify=verify_checksums,
            exchange_reads=exchange_reads and comm is not None,
            # Megatron-Core loads a tensor stored in another dtype converted, as `copy_` does.
            cast_dtypes=True,
        )
    except NotCoveredError as e:
        if getattr(sharded_strategy, "backend", None) == "torch_dist":
            raise _torch_dist_load_error(e) from None
        raise
    except KeyMismatchError as e:
        # Megatron's wording ("Unexpected keys ...", "Missing keys ..."), the same exception.
        missing = set(e.missing) if strict == StrictHandling.RAISE_ALL else set()
        err = KeyMismatchError(mismatch_message(missing, set(e.unexpected)))
        err.missing, err.unexpected = e.missing, e.unexpected
        raise err from None
    if strict in _RETURNED_INSTEAD_OF_LOGGED:
        missing = set(result["missing_keys"]) if strict == StrictHandling.LOG_ALL else set()
        maybe_report_missing_and_unexpected_keys(missing, set(result["unexpected_keys"]), raise_error=False)

    # The common state came with the load where the core keeps it; Megatron's common.pt is read
    # by its common strategy (torch.load, exact objects).
    if getattr(common_strategy, "common_from_index", False):
        state = _common_from_native(result["common"])
    else:
        state = common_strategy.load_common(checkpoint_dir)
    for path, leaf in leaves(sharded_state_dict):
        if isinstance(leaf, LocalNonpersistentObject):
            set_path(state, path, leaf.unwrap())
    for (path, _), (buf, device), loaded in zip(tensors, targets, result["loaded"]):
        if loaded:
            set_path(state, path, buf if device is None else buf.to(device))
    for (path, _), data in zip(objects, result["objects"]):
        if data is not None:
            set_path(state, path, decode_object(data))
    apply_factory_merges(state, factories)
    match_request(state, sharded_state_dict)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return state, set(result["missing_keys"]), set(result["unexpected_keys"])
    return state


def load_by_strategy(strategy: Any, sharded_state_dict: Dict[str, Any], checkpoint_dir: Any) -> Any:
    """``strategy.load`` of a strategy the core reads for: ``serialization.load`` with it, a
    collective load (Megatron's strategies load on every rank at once)."""
    location = native_location(checkpoint_dir)
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(location, strategy)
    return load(sharded_state_dict, location, sharded_strategy, common_strategy)


#: The strict modes whose mismatches are logged by this package: the core returns them.
_RETURNED_INSTEAD_OF_LOGGED = {
    StrictHandling.LOG_UNEXPECTED: StrictHandling.RETURN_UNEXPECTED,
    StrictHandling.LOG_ALL: StrictHandling.RETURN_ALL,
}


def _load_target(sh: ShardedTensor, taken: Set[int]) -> Tuple[Any, Any]:
    """(CPU buffer to load into, the device the loaded tensor goes to or None for the buffer
    itself): the request's data in place when it already fits and no other tensor of this load
    took the same memory (tied weights, e.g. T5's position embeddings under two keys, each get
    their own buffer, as Megatron's load returns them); a new buffer otherwise, moved to the
    device of the request's data (a CUDA tensor loads as a new CUDA tensor)."""
    import torch

    numel = (sh.flattened_range.stop - sh.flattened_range.start) if sh.flattened_range is not None else None
    shape = (numel,) if numel is not None else tuple(sh.local_shape)
    data = sh.data
    if (
        isinstance(data, torch.Tensor)
        and data.device.type == "cpu"
        and data.is_contiguous()
        and data.dtype == sh.dtype
        and data.numel() == (numel if numel is not None else _prod(shape))
        and (data.numel() == 0 or data.data_ptr() not in taken)
    ):
        taken.add(data.data_ptr())
        return data, None
    buf = torch.empty(shape, dtype=sh.dtype)
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        return buf, data.device
    return buf, None


def _prod(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


_TORCH_DIST_NOT_COVERED: Any = None


def _torch_dist_load_error(e: Exception) -> Exception:
    """A request the torch_dist checkpoint cannot serve, raised as what megatron-core raises
    there (torch DCP's ``CheckpointException``, which code written for Megatron catches) and as
    tessera's own ``NotCoveredError`` (with its key and region) at once: one class, made on
    first use, named ``TorchDistNotCoveredError``."""
    global _TORCH_DIST_NOT_COVERED
    if _TORCH_DIST_NOT_COVERED is None:
        try:
            from torch.distributed.checkpoint.api import CheckpointException
        except ImportError:  # torch without distributed checkpoint: tessera's error alone
            return e
        _TORCH_DIST_NOT_COVERED = type("TorchDistNotCoveredError", (NotCoveredError, CheckpointException), {})
    err = _TORCH_DIST_NOT_COVERED(str(e))
    err.__dict__.update(getattr(e, "__dict__", {}))
    err._failures = {}
    return err


# ---------------------------------------------------------------------------------------------
# What a checkpoint holds, read by the core


def tensors_metadata(checkpoint_dir: Any) -> Dict[str, ShardedTensor]:
    """Key -> ShardedTensor without data or sharding (dtype and global shape only)."""
    out = {}
    for key, (dtype, shape) in _native.load_tensors_metadata(native_location(checkpoint_dir)).items():
        shape = tuple(shape)
        out[key] = ShardedTensor(
            key=key,
            data=None,
            dtype=tessera_dtype_to_torch(dtype),
            local_shape=shape,
            global_shape=shape,
            global_offset=(0,) * len(shape),
            axis_fragmentations=(1,) * len(shape),
        )
    return out


def sharded_metadata(checkpoint_dir: Any) -> Dict[str, Any]:
    """Tensors (by key) and every stored object shard (by its unique key) of the checkpoint,
    without data, as Megatron's ``load_sharded_metadata`` lists them."""
    metadata: Dict[str, Any] = dict(tensors_metadata(checkpoint_dir))
    for key, (grid, offsets) in _native.load_objects_metadata(native_location(checkpoint_dir)).items():
        for offset in offsets:
            obj = ShardedObject(key, None, tuple(grid), tuple(offset), replica_id=0)
            metadata[obj.unique_key] = obj
    return metadata


def common_state(checkpoint_dir: Any) -> Dict[str, Any]:
    """The common state the core keeps in the checkpoint (its index, or a foreign format's own
    place for it)."""
    return _common_from_native(_native.load_common(native_location(checkpoint_dir)))


def _common_from_native(pairs: Iterable[Tuple[Any, Any]]) -> Dict[str, Any]:
    state: Dict[str, Any] = {}
    for path, value in pairs:
        set_path(state, from_native_path(path), from_plain(value))
    return state


def load_sharded_objects(sharded_state_dict: Dict[str, Any], checkpoint_dir: Any) -> Dict[str, Any]:
    """Replaces every ShardedObject of ``sharded_state_dict`` by its loaded value (in place)."""
    objects = [(path, leaf) for path, leaf in leaves(sharded_state_dict) if isinstance(leaf, ShardedObject)]
    if not objects:
        return sharded_state_dict
    datas = _native.load_objects([sharded_load_object(o) for _, o in objects], native_location(checkpoint_dir))
    for (path, _), data in zip(objects, datas):
        set_path(sharded_state_dict, path, decode_object(data))
    return sharded_state_dict


def remove_sharded_tensors(checkpoint_dir: Any, key_prefix: str) -> List[str]:
    """Drops every tensor whose key starts with ``key_prefix``; returns their keys."""
    return _native.remove_sharded_tensors(native_location(checkpoint_dir), key_prefix)
