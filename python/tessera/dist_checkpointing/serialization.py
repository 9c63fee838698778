"""Save and load entry points of ``tessera.dist_checkpointing`` (Megatron-Core names and semantics).

This module picks the strategies, as Megatron's does: a strategy tessera's core runs (its own,
``torch_dist``, and every format the native reader reads) hands the whole save or load to the
package's native engine (``_engine``: one commit, any layout); any other strategy is called
through Megatron's protocol (common state by the common strategy, then the strategy's
``save`` / ``load`` of the sharded part).

Foreign checkpoints (Megatron ``torch_dist`` / ``zarr``, PyTorch DCP, OLMo-core) are read by
the same native calls. Only the common state of a Megatron checkpoint that has ``common.pt``
comes from Python: ``torch.load`` of that file, as Megatron's ``TorchCommonLoadStrategy``
does. Megatron calls ``torch.load(path, map_location="cpu")``, i.e. ``weights_only=True``
since torch 2.6; tessera does the same, with ``argparse.Namespace`` allowed.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Set, Union

from .. import _native
from .._core import io
from .._core.comm import initialized_dist
from .._core.storage import StorageOptions, native_location
from .._core.values import from_plain
from . import _engine
from ._engine import CONTENT_METADATA_KEY, load_sharded_objects
from .core import CheckpointingConfig, CheckpointingException, save_config
from .dict_utils import extract_matching_values, merge
from .mapping import ShardedObject, ShardedTensor, apply_factory_merges
from .state_dict_utils import load_preprocess, save_preprocess
from .strategies.base import AsyncSaveShardedStrategy, StrategyAction, get_default_strategy
from .strategies.tessera import TESSERA_BACKEND, TESSERA_BACKEND_VERSION
from .utils import extract_sharded_base
from .validation import (
    StrictHandling,
    check_strict_load,
    parse_strict_flag,
    validate_sharded_objects_handling,
    validate_sharding_integrity,
    verify_checkpoint_and_load_strategy,
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


# ---------------------------------------------------------------------------------------------
# Save


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
    if not getattr(strategy, "native_writer", None):
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
    return _engine.save(
        strategy,
        sharded_state_dict,
        checkpoint_dir,
        validate_access_integrity=validate_access_integrity,
        async_sharded_save=async_sharded_save,
        preprocess_common_before_consistancy_check=preprocess_common_before_consistancy_check,
        content_metadata=content_metadata,
        overwrite=overwrite,
        process_group=process_group,
        async_saver=async_saver,
        storage_options=storage_options,
    )


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
    if common_strategy is None:
        common_strategy = get_default_save_common_strategy()
    elif isinstance(common_strategy, tuple):
        common_strategy = get_default_strategy(StrategyAction.SAVE_COMMON, *common_strategy)
    if content_metadata is not None:
        sharded_state_dict[CONTENT_METADATA_KEY] = content_metadata
    sharded_part, common_state = save_preprocess(
        sharded_state_dict, validate_access_integrity, preprocess_common_before_consistancy_check
    )
    common_strategy.save_common(common_state, checkpoint_dir)
    if not strategy.can_handle_sharded_objects:
        validate_sharded_objects_handling(strategy, common_strategy)
        objects, sharded_part = extract_matching_values(sharded_part, lambda v: isinstance(v, ShardedObject))
        common_strategy.save_sharded_objects(objects, checkpoint_dir)

    def metadata_finalize_fn() -> None:
        if io.communicator(None)[1] == 0:
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
    dist = initialized_dist()
    if dist is not None:
        dist.barrier()


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


# ---------------------------------------------------------------------------------------------
# Load


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
    """Loads the state described by ``sharded_state_dict`` (any layout) from ``checkpoint_dir``;
    every rank of the process group calls it, as Megatron's.

    The ranks share the checks of what they read: each checksum block is verified by one rank
    that reads it and the verdict sent to the others, so that each rank downloads only the bytes
    it needs. ``exchange_reads=True`` (or a ``FullyParallelLoadStrategyWrapper`` strategy)
    shares the reads too: each byte range needed by several ranks is read from storage by one
    of them and sent to the others (for slow shared storage).

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
    return _engine.load(
        sharded_state_dict,
        checkpoint_dir,
        sharded_strategy,
        common_strategy,
        strict,
        process_group=process_group,
        verify_checksums=verify_checksums,
        exchange_reads=exchange_reads,
    )


def _load_with_strategy(
    sharded_state_dict: Dict[str, Any], checkpoint_dir: Any, sharded_strategy: Any, common_strategy: Any, strict: StrictHandling
) -> Any:
    """Megatron's load protocol around a caller's own strategy (one the core does not run):
    common state first, then ``strategy.load`` of the sharded part, factories merged. Unless
    ``strict`` is ``ASSUME_OK_UNEXPECTED`` or ``IGNORE_ALL``, the request's keys are compared
    with what ``load_sharded_metadata`` lists (through the strategies), as Megatron does."""
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
        return _engine.tensors_metadata(checkpoint_dir)
    return sharded_strategy.load_tensors_metadata(checkpoint_dir)


def load_sharded_metadata(
    checkpoint_dir: Any, sharded_strategy: Any = None, common_strategy: Any = None
) -> CkptShardedMetadata:
    """Like :func:`load_tensors_metadata`, with ShardedObjects where the strategy lists them."""
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy
    )
    metadata = sharded_strategy.load_sharded_metadata(checkpoint_dir)
    if not sharded_strategy.can_handle_sharded_objects:
        validate_sharded_objects_handling(sharded_strategy, common_strategy)
        metadata = merge(metadata, common_strategy.load_sharded_metadata(checkpoint_dir))
    return metadata


def load_plain_tensors(checkpoint_dir: Any) -> Dict[str, Any]:
    """Every tensor, whole (not the common state).

    Not collective, unlike :func:`load`: a rank may call it alone (to look into a checkpoint),
    and when every rank calls it, each needs every byte, so sharing the checks would save no
    download."""
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(checkpoint_dir)
    if getattr(sharded_strategy, "native_reader", False):
        metadata = _engine.tensors_metadata(checkpoint_dir)
        state = _engine.load(dict(metadata), checkpoint_dir, sharded_strategy, common_strategy, collective=False)
    else:
        metadata = sharded_strategy.load_tensors_metadata(checkpoint_dir)
        state = load(dict(metadata), checkpoint_dir, validate_access_integrity=False)
    return {key: state[key] for key in metadata}


def load_common_state_dict(checkpoint_dir: Any) -> Dict[str, Any]:
    """The common (non-sharded) state. For a Megatron ``torch_dist`` / ``zarr`` checkpoint with
    ``common.pt``, what ``torch.load`` of that file gives (as Megatron loads it)."""
    _, common_strategy = verify_checkpoint_and_load_strategy(checkpoint_dir)
    return common_strategy.load_common(checkpoint_dir)


def load_content_metadata(checkpoint_dir: Optional[Any] = None, *, preloaded_state_dict: Any = None) -> Optional[dict]:
    """The ``content_metadata`` given at save (None if none): from ``preloaded_state_dict`` (a
    state dict ``load`` returned) when given, else read from ``checkpoint_dir``."""
    if preloaded_state_dict is not None:
        return preloaded_state_dict.get(CONTENT_METADATA_KEY)
    if checkpoint_dir is None:
        raise ValueError("Both checkpoint_dir and loaded_state_dict cannot be None")
    try:
        value = from_plain(_native.load_content_metadata(native_location(checkpoint_dir)))
    except CheckpointingException:
        value = None
    if value is None:
        # Megatron's torch_dist keeps it in common.pt, under the common state's key.
        value = load_common_state_dict(checkpoint_dir).get(CONTENT_METADATA_KEY)
    return value


def remove_sharded_tensors(checkpoint_dir: Any, key_prefix: str) -> Any:
    """Drops every tensor whose key starts with ``key_prefix`` (through the checkpoint's strategy)."""
    sharded_strategy, _ = verify_checkpoint_and_load_strategy(checkpoint_dir)
    return sharded_strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)
