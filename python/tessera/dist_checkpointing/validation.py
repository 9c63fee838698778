"""Checks around save and load (megatron-core's ``validation``).

The sharding check is the core's (``tessera._native.validate_sharding``: every global tensor
tiled exactly once by main replicas, collectively); the native load reports missing and
unexpected keys itself. What stays here is megatron's API: the strictness flags, the choice and
check of load strategies from a checkpoint's config, and the common-state comparison with rank
0 that Megatron logs before a save.

torch is imported only by :func:`determine_global_metadata`, which needs its collectives: the
rest of the module works without torch.
"""

from __future__ import annotations

import logging
import os
from enum import Enum
from typing import Any, Iterable, List, Set, Tuple, Union

from .. import _native
from .._core import io
from .._core.comm import initialized_dist
from .._core.descriptors import sharded_save_object, sharded_save_tensor
from ..errors import NotFoundError
from .core import CheckpointingException, local_dir, maybe_load_config
from .dict_utils import diff, extract_matching_values, nested_values
from .mapping import ShardedBase, ShardedObject, ShardedStateDict, ShardedTensor
from .strategies.base import StrategyAction, get_default_strategy, get_load_strategy

__all__ = [
    "StrictHandling",
    "parse_strict_flag",
    "verify_checkpoint_and_load_strategy",
    "validate_sharding_integrity",
    "validate_sharded_objects_handling",
    "determine_global_metadata",
    "maybe_report_missing_and_unexpected_keys",
    "check_strict_load",
    "mismatch_message",
]

logger = logging.getLogger(__name__)


class StrictHandling(Enum):
    """What load does about keys that differ between the request and the checkpoint."""

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        return val in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling]) -> StrictHandling:
    """Accepts a StrictHandling or its value (``"raise_all"``)."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except ValueError as e:
        raise ValueError(f"unknown strict handling {strict!r}") from e




def _validate_common_state_dict(common_state_dict: Any) -> None:
    """Logs a warning on each rank whose common state differs from rank 0's (rank 0 alone writes
    it). One ``broadcast_object_list``; nothing without an initialized process group."""
    dist = initialized_dist()
    if dist is None or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    objects = [common_state_dict if rank == 0 else None]
    dist.broadcast_object_list(objects, src=0)
    if rank > 0:
        only_in_rank0, only_here, mismatch = diff(objects[0], common_state_dict)
        if only_in_rank0 or only_here or mismatch:
            logger.warning(
                f"Rank {rank} common state dict differs from rank 0 common state dict. "
                f"Keys only on rank 0: {only_in_rank0}, "
                f"Keys only on {rank}: {only_here}, "
                f"Mismatched keys: {mismatch}"
            )


def verify_checkpoint_and_load_strategy(
    checkpoint_dir: Any, sharded_strategy: Any = None, common_strategy: Any = None
) -> Tuple[Any, Any]:
    """The (sharded, common) load strategies for ``checkpoint_dir``: the ones given (a strategy
    or a ``(backend, version)`` tuple), or the defaults for the checkpoint's backends; each
    checked against the checkpoint's config. Raises CheckpointingException if the directory
    does not exist or is not a distributed checkpoint."""
    # NotFoundError is the core's "nothing there" error and a CheckpointingException, so both
    # tessera's callers (catching NotFoundError) and Megatron's (CheckpointingException) see it.
    try:
        config = maybe_load_config(checkpoint_dir)
    except FileNotFoundError as e:
        raise NotFoundError(f"Checkpoint directory {checkpoint_dir} does not exist") from e
    if config is None:
        path = local_dir(checkpoint_dir)
        if path is not None and not os.path.isdir(path):
            raise NotFoundError(f"Checkpoint directory {checkpoint_dir} does not exist")
        raise NotFoundError(f"{checkpoint_dir} is not a distributed checkpoint")

    # A format the core reads without a registered strategy (torch_dcp, olmo_core, ...) is
    # loaded by the native reader's strategies, registered for any backend.
    if sharded_strategy is None:
        sharded_strategy = get_load_strategy(
            StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version
        )
    elif isinstance(sharded_strategy, tuple):
        sharded_strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, *sharded_strategy)
    if common_strategy is None:
        common_strategy = get_load_strategy(StrategyAction.LOAD_COMMON, config.common_backend, config.common_backend_version)
    elif isinstance(common_strategy, tuple):
        common_strategy = get_default_strategy(StrategyAction.LOAD_COMMON, *common_strategy)
    sharded_strategy.check_backend_compatibility(config.sharded_backend)
    sharded_strategy.check_version_compatibility(config.sharded_backend_version)
    common_strategy.check_backend_compatibility(config.common_backend)
    common_strategy.check_version_compatibility(config.common_backend_version)
    return sharded_strategy, common_strategy


def validate_sharded_objects_handling(sharded_strategy: Any, common_strategy: Any) -> None:
    """Raises CheckpointingException when neither strategy handles ShardedObjects."""
    if not sharded_strategy.can_handle_sharded_objects and not common_strategy.can_handle_sharded_objects:
        raise CheckpointingException(
            f"Either sharded strategy or common strategy must implement ShardedObjects handling."
            f" Both {sharded_strategy} and {common_strategy} specify can_handle_sharded_objects=False"
        )


def check_strict_load(
    sharded_part: ShardedStateDict, stored_keys: Set[str], strict: StrictHandling
) -> Tuple[ShardedStateDict, Set[str], Set[str]]:
    """Megatron's strict-load handling for a request checked in Python (a caller's own strategy,
    a tensor-aware state dict; the core checks its own loads): missing keys (stored, requested
    by no rank: one ``all_gather_object``) and this rank's unexpected keys (requested, not
    stored), raised or logged as ``strict`` says. Returns the request without its unexpected
    keys (unless nothing is checked), the missing and the unexpected keys."""
    if strict in (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.IGNORE_ALL):
        return sharded_part, set(), set()
    requested = {sh.key for sh in nested_values(sharded_part) if hasattr(sh, "key")}
    unexpected = requested - stored_keys
    missing: Set[str] = set()
    if StrictHandling.requires_global_app_metadata(strict):
        everyone = set(requested)
        if initialized_dist() is not None:
            _, gathered = determine_global_metadata(sharded_part)
            everyone = {sh.key for rank in gathered for sh in rank}
        missing = stored_keys - everyone
    if strict == StrictHandling.RAISE_UNEXPECTED:
        maybe_report_missing_and_unexpected_keys(set(), unexpected, raise_error=True)
    elif strict == StrictHandling.RAISE_ALL:
        maybe_report_missing_and_unexpected_keys(missing, unexpected, raise_error=True)
    elif strict == StrictHandling.LOG_UNEXPECTED:
        maybe_report_missing_and_unexpected_keys(set(), unexpected, raise_error=False)
    elif strict == StrictHandling.LOG_ALL:
        maybe_report_missing_and_unexpected_keys(missing, unexpected, raise_error=False)
    if unexpected:
        _, sharded_part = extract_matching_values(sharded_part, lambda x: getattr(x, "key", None) in unexpected)
    return sharded_part, missing, unexpected


def maybe_report_missing_and_unexpected_keys(
    missing_keys: Set[str], unexpected_keys: Set[str], raise_error: bool = True
) -> None:
    """Raises CheckpointingException (``raise_error``) or logs a warning naming the missing
    keys (stored, requested by no rank) and this rank's unexpected keys (requested, not stored);
    nothing when both are empty. The text says "Missing keys" / "Unexpected keys" as Megatron's."""
    if not missing_keys and not unexpected_keys:
        return
    if raise_error:
        raise CheckpointingException(mismatch_message(missing_keys, unexpected_keys))
    logger.warning(mismatch_message(missing_keys, unexpected_keys))


def mismatch_message(missing_keys: Set[str], unexpected_keys: Set[str]) -> str:
    """The report of a key mismatch, in the terms of Megatron's ("Missing keys", "Unexpected keys")."""
    parts = []
    if missing_keys:
        parts.append(f"Missing keys (in the checkpoint, requested by no rank): {sorted(missing_keys)}.")
    if unexpected_keys:
        parts.append(f"Unexpected keys (requested by this rank, not in the checkpoint): {sorted(unexpected_keys)}.")
    return "The sharded state dict does not match the checkpoint.\n" + " ".join(parts)


def determine_global_metadata(sharded_state_dict: ShardedStateDict) -> Tuple[List[ShardedBase], List[List[ShardedBase]]]:
    """(this rank's sharded leaves without data, every rank's): one ``all_gather_object``."""
    import torch.distributed as dist

    local = [sh.without_data() for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedBase)]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return local, gathered


def validate_sharding_integrity(sharded_tensors: Iterable[Any], process_group: Any = None) -> None:
    """Collective check that the ranks' ShardedTensors/ShardedObjects tile every global tensor
    exactly; raises InvalidShardingError (a CheckpointingException) on every rank otherwise."""
    tensors, objects = [], []
    for sh in sharded_tensors:
        # The layout only (no data): nothing is copied to the host for the check.
        if isinstance(sh, ShardedTensor):
            tensors.append(sharded_save_tensor(sh))
        elif isinstance(sh, ShardedObject):
            objects.append(sharded_save_object(sh))
    comm, _ = io.communicator(process_group)
    _native.validate_sharding(tensors, objects, comm)
