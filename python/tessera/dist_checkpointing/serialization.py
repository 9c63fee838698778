"""Save and load entry points of ``tessera.dist_checkpointing`` (Megatron-Core names and semantics).

This module is glue: it walks sharded state dicts, turns their leaves into the flat tuples of
``tessera._native`` (data pointers of CPU tensors, kept alive for the call), and puts the
results back. Planning, validation and IO happen in Rust.

Values that are not plain (None/bool/int/float/str/bytes and lists/str-keyed dicts of them)
go through ``torch.save`` and come back through ``torch.load(weights_only=True)``, with
``argparse.Namespace`` allowed: loading never runs arbitrary code.

Foreign checkpoints (Megatron ``torch_dist`` / ``zarr``, PyTorch DCP, OLMo-core) are read by
the same native calls. Only the common state of a Megatron checkpoint that has ``common.pt``
comes from Python: ``torch.load`` of that file, as Megatron's ``TorchCommonLoadStrategy``
does. Megatron calls ``torch.load(path, map_location="cpu")``, i.e. ``weights_only=True``
since torch 2.6; tessera does the same, with ``argparse.Namespace`` allowed as above.
"""

from __future__ import annotations

import argparse
import io
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union, cast

from .. import _native
from .._core.comm import default_comm
from .._core.storage import StorageOptions, native_location
from .._core.layout import cpu_contiguous
from .._core.paths import Seg, from_native_path, leaves, set_path, to_native_path
from .._core.values import (
    TORCH_SAVE_KEY,
    decode_object,
    encode_object,
    from_plain,
    is_plain,
    is_stateful,
    like_request,
    match_request,
    to_plain,
    torch_load_bytes,
    torch_save_bytes,
)
from .._core.descriptors import sharded_load_object, sharded_load_tensor, sharded_save_object, sharded_save_tensor
from ..errors import KeyMismatchError, NotCoveredError, TesseraError
from .core import CheckpointingConfig, CheckpointingException, save_config
from .dict_utils import extract_matching_values
from .strategies.base import AsyncSaveShardedStrategy, StrategyAction, get_default_strategy
from .strategies.common import COMMON_STATE_FNAME
from .strategies.tessera import TESSERA_BACKEND, TESSERA_BACKEND_VERSION
from .validation import (
    StrictHandling,
    check_strict_load,
    maybe_report_missing_and_unexpected_keys,
    mismatch_message,
    parse_strict_flag,
    validate_sharding_integrity,
    verify_checkpoint_and_load_strategy,
)
from .mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)

__all__ = [
    "StrictHandling",
    "save",
    "load",
    "load_tensors_metadata",
    "load_plain_tensors",
    "load_common_state_dict",
    "load_sharded_objects",
    "load_content_metadata",
    "load_sharded_metadata",
    "remove_sharded_tensors",
    "validate_sharding_integrity",
    "get_default_save_sharded_strategy",
    "get_default_save_common_strategy",
    "get_default_load_sharded_strategy",
    "CkptShardedMetadata",
]

CkptShardedMetadata = Dict[str, Union[ShardedTensor, ShardedObject]]
_CONTENT_METADATA_KEY = "content_metadata"


def _save_tensor(sh: ShardedTensor, keep_alive: List[Any], pinned: Any = None, copy: bool = False) -> Any:
    """The core's description of ``sh`` to save, over a host copy of its data when the data is
    not CPU C-contiguous memory already (or when ``copy``), kept in ``keep_alive``."""
    if sh.data is None:
        return sharded_save_tensor(sh)
    if pinned is not None and sh.data.device.type == "cuda":
        # Async save: copy into a reused page-locked buffer, without waiting (the caller
        # synchronizes once for all tensors before the bytes are read).
        data = pinned.take(sh.data.numel(), sh.data.dtype).view(sh.data.shape)
        data.copy_(sh.data.detach(), non_blocking=True)
    else:
        data = cpu_contiguous(sh.data, copy)
    keep_alive.append(data)
    return sharded_save_tensor(sh, data)


def _split(sharded_state_dict: Dict[str, Any]) -> Tuple[list, list, list]:
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


# ---------------------------------------------------------------------------------------------
# Entry points


def save(
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: Any,
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
    content_metadata: Optional[dict] = None,
    *,
    overwrite: bool = False,
    process_group: Any = None,
    async_saver: Any = None,
    storage_options: StorageOptions = None,
    _sharded_part_only: bool = False,
) -> Any:
    """Saves a sharded state dict; every rank of the process group calls it.

    ``sharded_strategy`` may be None (tessera's native format), a ``(backend, version)`` tuple
    (the registered default, e.g. ``("torch_dist", 1)``) or a strategy object, which is the one
    used. tessera's own strategies (and ``torch_dist``) are run by the native engine: tensors,
    objects and common state in one commit. Any other strategy is called as Megatron calls it:
    the common state goes to ``common.pt`` (``common_strategy``, default ``("torch", 1)``), then
    ``strategy.save`` / ``strategy.async_save`` gets the sharded part, then ``metadata.json``.

    ``preprocess_common_before_consistancy_check`` maps the common state before it is compared
    with rank 0's (only with ``validate_access_integrity``); differences are logged, as Megatron
    does. ``content_metadata`` is saved with the common state (key ``"content_metadata"``).

    ``async_sharded_save=True`` returns an :class:`~.strategies.async_utils.AsyncRequest` as soon
    as this rank's bytes are staged (the tensors may then change); schedule it on an
    :class:`~.strategies.async_utils.AsyncCallsQueue` or call its ``finalize()``. Staging goes
    through ``async_saver`` (default: one saver per live process group, created collectively on
    first use); a save still in flight is waited for first.

    ``checkpoint_dir`` may be an object-store URL, configured from the environment, by
    ``storage_options`` (``object_store`` keys), or given as a :class:`tessera.Location` that
    carries them (which this package's functions taking a ``checkpoint_dir`` accept, with
    tessera's own strategies; a foreign strategy gets what Megatron gives it, a local path).
    """
    strategy = _resolve_save_strategy(sharded_strategy)
    writer = getattr(strategy, "native_writer", None)
    if not writer:
        return _save_with_strategy(
            strategy,
            sharded_state_dict,
            checkpoint_dir,
            common_strategy,
            validate_access_integrity,
            async_sharded_save,
            preprocess_common_before_consistancy_check,
            content_metadata,
        )
    _check_common_strategy(common_strategy)
    if content_metadata is not None:
        sharded_state_dict[_CONTENT_METADATA_KEY] = content_metadata
    apply_factories(sharded_state_dict)
    tensors, objects, common = _split(sharded_state_dict)
    if validate_access_integrity:
        from .validation import _validate_common_state_dict

        common_state: Dict[str, Any] = {}
        for path, value in common:
            set_path(common_state, path, value)
        if preprocess_common_before_consistancy_check is not None:
            common_state = preprocess_common_before_consistancy_check(common_state)
        _validate_common_state_dict(common_state)
    comm = default_comm(process_group)
    rank = comm.rank() if comm is not None else 0
    if writer == "torch_dist":
        return _save_torch_dist_request(
            tensors, objects, common, native_location(checkpoint_dir, storage_options), comm, rank, async_sharded_save,
            keep_common_pt=_sharded_part_only,
            overwrite=overwrite, validate=validate_access_integrity,
            # Megatron's thread_count: the data files each rank writes.
            files_per_rank=max(1, int(getattr(getattr(strategy, "base_strategy", strategy), "thread_count", 1) or 1)),
        )
    saver = None
    if async_sharded_save:
        from .strategies.async_utils import default_saver

        if async_saver is not None:
            saver = async_saver
        else:
            held = sum(sh.data.numel() * sh.data.element_size() for _, sh in tensors if sh.data is not None)
            saver = default_saver(process_group, held)
    keep_alive: List[Any] = []
    pinned = saver.pinned if saver is not None else None
    native_tensors = [_save_tensor(sh, keep_alive, pinned) for _, sh in tensors]
    if pinned is not None and any(sh.data is not None and sh.data.device.type == "cuda" for _, sh in tensors):
        _torch().cuda.synchronize()
    native_objects = [sharded_save_object(o, encode_object(o.data)) for _, o in objects]
    native_common = [(to_native_path(p), to_plain(v)) for p, v in common] if rank == 0 else []
    args = (native_tensors, native_objects, native_common, native_location(checkpoint_dir, storage_options), comm)
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
    if saver is None:
        _native.save(*args, **kwargs)
        return None
    from .strategies.async_utils import AsyncRequest

    try:
        handle = saver.start(*args, **kwargs)
    finally:
        # Staged: the pinned buffers and host copies are free for the next save.
        del keep_alive
        saver.pinned.give_back_all()
    return AsyncRequest(handle)


def _resolve_save_strategy(sharded_strategy: Any) -> Any:
    if sharded_strategy is None:
        # tessera's format is the default. Megatron's save asks the module's
        # get_default_save_sharded_strategy(), and code that picks its default by replacing
        # that function (Megatron's own test suite does) is honoured the same way.
        chosen = globals()["get_default_save_sharded_strategy"]
        if chosen is not _GET_DEFAULT_SAVE_SHARDED_STRATEGY:
            return chosen()
        return get_default_save_sharded_strategy(TESSERA_BACKEND)
    if isinstance(sharded_strategy, tuple):
        return get_default_strategy(StrategyAction.SAVE_SHARDED, *sharded_strategy)
    return sharded_strategy


def _check_common_strategy(common_strategy: Any) -> None:
    """The native engine commits the common state itself; a common strategy other than
    tessera's or Megatron's ``torch`` one cannot be honoured there."""
    if common_strategy is None:
        return
    backend = common_strategy[0] if isinstance(common_strategy, tuple) else getattr(common_strategy, "backend", None)
    if backend not in (TESSERA_BACKEND, "torch"):
        raise CheckpointingException(
            f"common strategy {common_strategy} cannot be used with a native save; tessera commits the "
            "common state with the shards"
        )


def _save_with_strategy(
    strategy: Any,
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: Any,
    common_strategy: Any,
    validate_access_integrity: bool,
    async_sharded_save: bool,
    preprocess_common_before_consistancy_check: Any,
    content_metadata: Optional[dict],
) -> Any:
    """Megatron's save protocol around a caller's own strategy (one the core does not run)."""
    from .state_dict_utils import save_preprocess
    from .validation import validate_sharded_objects_handling

    if common_strategy is None:
        common_strategy = get_default_save_common_strategy()
    elif isinstance(common_strategy, tuple):
        common_strategy = get_default_strategy(StrategyAction.SAVE_COMMON, *common_strategy)
    if content_metadata is not None:
        sharded_state_dict[_CONTENT_METADATA_KEY] = content_metadata
    sharded_part, common_state = save_preprocess(
        sharded_state_dict, validate_access_integrity, preprocess_common_before_consistancy_check
    )
    common_strategy.save_common(common_state, checkpoint_dir)
    if not strategy.can_handle_sharded_objects:
        validate_sharded_objects_handling(strategy, common_strategy)
        objects, sharded_part = extract_matching_values(sharded_part, lambda v: isinstance(v, ShardedObject))
        common_strategy.save_sharded_objects(objects, checkpoint_dir)

    def metadata_finalize_fn() -> None:
        comm = default_comm(None)
        if comm is None or comm.rank() == 0:
            save_config(CheckpointingConfig(strategy.backend, strategy.version, "torch", 1), checkpoint_dir)
        _barrier()

    if not async_sharded_save:
        strategy.save(sharded_part, checkpoint_dir)
        metadata_finalize_fn()
        return None
    if not isinstance(strategy, AsyncSaveShardedStrategy):
        raise CheckpointingException(f"Cannot apply async_save to non-async strategy {strategy}")
    request = strategy.async_save(sharded_part, checkpoint_dir)
    request.finalize_fns.append(metadata_finalize_fn)
    return request


def _barrier() -> None:
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _save_torch_dist_request(
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
    keep_alive: List[Any] = []
    # An async save writes after the caller has moved on: it writes copies.
    native_tensors = [_save_tensor(sh, keep_alive, copy=async_save) for _, sh in tensors]
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
    save = _native.plan_torch_dist(
        native_tensors, native_objects, common_pt, location, keep_alive, comm, files_per_rank=files_per_rank, **kwargs
    )
    from .strategies.filesystem_async import TorchDistWrites

    writes = TorchDistWrites(save, location, comm, rank, background=async_save)
    if not async_save:
        writes.finalize()
        return None
    from .strategies.async_utils import AsyncRequest

    return AsyncRequest(writes)


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: Optional[int] = None) -> Any:
    """Megatron's: the registered save strategy of ``(backend, version)``, ``torch_dist`` unless
    another backend is named (Megatron-LM names it: ``get_default_save_sharded_strategy(
    args.ckpt_format)``). Without ``version``, the version that backend is written in: 2 for
    tessera, 1 for Megatron's backends. :func:`save` without a strategy does not use this
    default: it writes tessera's format (``get_default_save_sharded_strategy("tessera")``)."""
    if version is None:
        version = TESSERA_BACKEND_VERSION if backend == TESSERA_BACKEND else 1
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


# Our own, to tell it from a replacement (see _resolve_save_strategy).
_GET_DEFAULT_SAVE_SHARDED_STRATEGY = get_default_save_sharded_strategy


def get_default_save_common_strategy(backend: str = "torch", version: int = 1) -> Any:
    """The registered common save strategy (used only around a caller's own sharded strategy)."""
    return get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)


def get_default_load_sharded_strategy(checkpoint_dir: Any) -> Any:
    """The default load strategy for the checkpoint at ``checkpoint_dir`` (by its backend)."""
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]


def _load_target(sh: ShardedTensor, taken: Set[int]) -> Tuple[Any, Any]:
    """(CPU buffer to load into, final tensor): in place when the data already fits and no
    other tensor of this load took the same memory (tied weights, e.g. T5's position
    embeddings under two keys, each get their own buffer, as Megatron's load returns them)."""
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
        return data, data
    buf = torch.empty(shape, dtype=sh.dtype)
    return buf, buf


def _prod(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def load(
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: Any,
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    process_group: Any = None,
    verify_checksums: bool = True,
    exchange_reads: bool = False,
    storage_options: StorageOptions = None,
) -> Any:
    """Loads the state described by ``sharded_state_dict`` (any layout) from ``checkpoint_dir``.

    ``exchange_reads=True`` (or a ``FullyParallelLoadStrategyWrapper`` strategy) makes the load
    collective over the process group: each byte range needed by several ranks is read from
    storage by one of them and sent to the others (for slow shared storage).

    Returns the loaded state dict: common state as base, sharded tensors loaded (in place into
    their ``data`` when it is a matching CPU contiguous tensor), objects decoded, factories
    merged, non-persistent objects unwrapped. With ``StrictHandling.RETURN_*`` returns
    ``(state_dict, missing_keys, unexpected_keys)``. ``storage_options``: as for :func:`save`.
    """
    strict = parse_strict_flag(strict)
    checkpoint_dir = native_location(checkpoint_dir, storage_options)
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy
    )
    if not getattr(sharded_strategy, "native_reader", False):
        return _load_with_strategy(sharded_state_dict, checkpoint_dir, sharded_strategy, common_strategy, strict)
    if getattr(sharded_strategy, "exchange_reads", False):
        exchange_reads = True
        process_group = getattr(sharded_strategy, "parallelization_group", None) or process_group
    factories, _ = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sharded_state_dict)
    tensors, objects, _ = _split(sharded_state_dict)
    collective = exchange_reads or StrictHandling.requires_global_app_metadata(strict)
    comm = default_comm(process_group) if collective else None
    taken: Set[int] = set()
    targets = [_load_target(sh, taken) for _, sh in tensors]
    native_tensors = [sharded_load_tensor(sh, buf) for (_, sh), (buf, _) in zip(tensors, targets)]
    native_objects = [sharded_load_object(o) for _, o in objects]
    # The core finds the mismatched keys; the LOG_* modes are reported here, through `logging`
    # as Megatron does, so the core is asked to return them instead of printing them.
    native_strict = _RETURNED_INSTEAD_OF_LOGGED.get(strict, strict)
    try:
        # entries of different types (listed in _native.load's docstring)
        result = cast(
            Dict[str, Any],
            _native.load(
                native_tensors,
                native_objects,
                native_location(checkpoint_dir, storage_options),
                comm,
                strict=native_strict.value,
                verify=verify_checksums,
                exchange_reads=exchange_reads and comm is not None,
                # Megatron-Core loads a tensor stored in another dtype converted, as `copy_` does.
                cast_dtypes=True,
            ),
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
    for (path, sh), (_, final), loaded in zip(tensors, targets, result["loaded"]):
        if loaded:
            if isinstance(sh.data, _torch().Tensor) and sh.data.device.type != "cpu":
                final = final.to(sh.data.device)
            set_path(state, path, final)
    for (path, _), data in zip(objects, result["objects"]):
        if data is not None:
            set_path(state, path, decode_object(data))
    apply_factory_merges(state, factories)
    match_request(state, sharded_state_dict)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return state, set(result["missing_keys"]), set(result["unexpected_keys"])
    return state


_TORCH_DIST_NOT_COVERED: Any = None


def _torch_dist_load_error(e: Exception) -> Exception:
    """A request the torch_dist checkpoint cannot serve, raised as what megatron-core raises
    there (torch DCP's ``CheckpointException``, which code written for Megatron catches) and as
    tessera's own ``NotCoveredError`` (with its key and region) at once: one class, made on
    first use (torch is imported only then), named ``TorchDistNotCoveredError``."""
    global _TORCH_DIST_NOT_COVERED
    if _TORCH_DIST_NOT_COVERED is None:
        try:
            from torch.distributed.checkpoint.api import CheckpointException
        except ImportError:
            return e
        _TORCH_DIST_NOT_COVERED = type("TorchDistNotCoveredError", (NotCoveredError, CheckpointException), {})
    err = _TORCH_DIST_NOT_COVERED(str(e))
    err.__dict__.update(getattr(e, "__dict__", {}))
    err._failures = {}
    return err


#: The strict modes whose mismatches are logged by this module: the core returns them.
_RETURNED_INSTEAD_OF_LOGGED = {
    StrictHandling.LOG_UNEXPECTED: StrictHandling.RETURN_UNEXPECTED,
    StrictHandling.LOG_ALL: StrictHandling.RETURN_ALL,
}


def _torch() -> Any:
    import torch

    return torch


def _load_with_strategy(
    sharded_state_dict: Dict[str, Any], checkpoint_dir: Any, sharded_strategy: Any, common_strategy: Any, strict: StrictHandling
) -> Any:
    """Megatron's load protocol around a caller's own strategy (one the core does not run):
    common state first, then ``strategy.load`` of the sharded part, factories merged. Unless
    ``strict`` is ``ASSUME_OK_UNEXPECTED`` or ``IGNORE_ALL``, the request's keys are compared
    with what ``load_sharded_metadata`` lists (through the strategies), as Megatron does."""
    from .dict_utils import merge
    from .state_dict_utils import load_preprocess
    from .utils import extract_sharded_base
    from .validation import validate_sharded_objects_handling

    state = common_strategy.load_common(checkpoint_dir)
    sharded_state_dict, nonpersistent, factories = load_preprocess(sharded_state_dict)
    merge(state, nonpersistent)
    sharded_state_dict, _ = extract_sharded_base(sharded_state_dict)
    missing: Set[str] = set()
    unexpected: Set[str] = set()
    if strict not in (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.IGNORE_ALL):
        stored = load_sharded_metadata(checkpoint_dir, sharded_strategy, common_strategy)
        stored_keys = {sh.key for sh in stored.values() if hasattr(sh, "key")}
        sharded_state_dict, missing, unexpected = check_strict_load(sharded_state_dict, stored_keys, strict)
    if not sharded_strategy.can_handle_sharded_objects:
        validate_sharded_objects_handling(sharded_strategy, common_strategy)
        objects, sharded_state_dict = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedObject))
        merge(state, common_strategy.load_sharded_objects(objects, checkpoint_dir))
    merge(state, sharded_strategy.load(sharded_state_dict, checkpoint_dir))
    state = apply_factory_merges(state, factories)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return state, missing, unexpected
    return state


def load_tensors_metadata(checkpoint_dir: Any, sharded_strategy: Any = None) -> Dict[str, ShardedTensor]:
    """Key -> ShardedTensor without data or sharding (dtype and global shape only)."""
    sharded_strategy, _ = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy)
    if getattr(sharded_strategy, "native_reader", False):
        return _native_tensors_metadata(checkpoint_dir)
    return sharded_strategy.load_tensors_metadata(checkpoint_dir)


def _native_tensors_metadata(checkpoint_dir: Any) -> Dict[str, ShardedTensor]:
    from .mapping import tessera_dtype_to_torch

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


def _native_sharded_metadata(checkpoint_dir: Any) -> CkptShardedMetadata:
    """Tensors (by key) and every stored object shard (by its unique key) of the checkpoint,
    without data, as Megatron's ``load_sharded_metadata`` lists them."""
    metadata: CkptShardedMetadata = dict(_native_tensors_metadata(checkpoint_dir))
    for key, (grid, offsets) in _native.load_objects_metadata(native_location(checkpoint_dir)).items():
        for offset in offsets:
            obj = ShardedObject(key, None, tuple(grid), tuple(offset), replica_id=0)
            metadata[obj.unique_key] = obj
    return metadata


def load_sharded_metadata(
    checkpoint_dir: Any, sharded_strategy: Any = None, common_strategy: Any = None
) -> CkptShardedMetadata:
    """Like :func:`load_tensors_metadata`, with ShardedObjects where the strategy lists them."""
    from .dict_utils import merge
    from .validation import validate_sharded_objects_handling

    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy
    )
    metadata = sharded_strategy.load_sharded_metadata(checkpoint_dir)
    if not sharded_strategy.can_handle_sharded_objects:
        validate_sharded_objects_handling(sharded_strategy, common_strategy)
        metadata = merge(metadata, common_strategy.load_sharded_metadata(checkpoint_dir))
    return metadata


def load_plain_tensors(checkpoint_dir: Any) -> Dict[str, Any]:
    """Every tensor, whole (not the common state)."""
    metadata = load_tensors_metadata(checkpoint_dir)
    state = load(dict(metadata), checkpoint_dir, validate_access_integrity=False)
    return {key: state[key] for key in metadata}


def load_common_state_dict(checkpoint_dir: Any) -> Dict[str, Any]:
    """The common (non-sharded) state. For a Megatron ``torch_dist`` / ``zarr`` checkpoint with
    ``common.pt``, what ``torch.load`` of that file gives (as Megatron loads it)."""
    _, common_strategy = verify_checkpoint_and_load_strategy(checkpoint_dir)
    return common_strategy.load_common(checkpoint_dir)


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


def load_content_metadata(checkpoint_dir: Optional[Any] = None, *, preloaded_state_dict: Any = None) -> Optional[dict]:
    """The ``content_metadata`` given at save (None if none): from ``preloaded_state_dict`` (a
    state dict ``load`` returned) when given, else read from ``checkpoint_dir``."""
    if preloaded_state_dict is not None:
        return preloaded_state_dict.get(_CONTENT_METADATA_KEY)
    if checkpoint_dir is None:
        raise ValueError("Both checkpoint_dir and loaded_state_dict cannot be None")
    try:
        value = from_plain(_native.load_content_metadata(native_location(checkpoint_dir)))
    except CheckpointingException:
        value = None
    if value is None:
        # Megatron's torch_dist keeps it in common.pt, under the common state's key.
        value = load_common_state_dict(checkpoint_dir).get(_CONTENT_METADATA_KEY)
    return value


def remove_sharded_tensors(checkpoint_dir: Any, key_prefix: str) -> Any:
    """Drops every tensor whose key starts with ``key_prefix`` (through the checkpoint's strategy)."""
    sharded_strategy, _ = verify_checkpoint_and_load_strategy(checkpoint_dir)
    return sharded_strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)


def _native_remove_sharded_tensors(checkpoint_dir: Any, key_prefix: str) -> List[str]:
    return _native.remove_sharded_tensors(native_location(checkpoint_dir), key_prefix)
