"""Helpers for manipulating sharded state dicts: splitting them by leaf kind and rewriting the
keys of their sharded leaves (Megatron-Core's ``utils`` module)."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .core import CheckpointingValueError
from .dict_utils import dict_list_map_inplace, extract_matching_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)

__all__ = [
    "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories",
    "extract_sharded_tensors_or_nonpersistent",
    "extract_sharded_base",
    "extract_nonpersistent",
    "add_prefix_for_sharding",
    "replace_prefix_for_sharding",
    "apply_prefix_mapping",
    "zip_strict",
    "force_all_tensors_to_non_fp8",
    "logger_stack",
    "debug_time",
    "debug_msg",
]

# Each extractor returns (matching, rest), both keeping the original hierarchy.


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """Splits off the ShardedTensor leaves."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """Splits off the ShardedTensor and ShardedTensorFactory leaves."""
    return extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory))
    )


def extract_sharded_tensors_or_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """Splits off the ShardedTensor, ShardedTensorFactory and LocalNonpersistentObject leaves."""
    return extract_matching_values(
        sharded_state_dict,
        lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory, LocalNonpersistentObject)),
    )


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """Splits off every ShardedBase leaf (tensors, objects and factories)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """Splits off the LocalNonpersistentObject leaves."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject))


# The sharded leaves whose key names a global checkpoint entry.
_KEYED = (ShardedTensor, ShardedTensorFactory, ShardedObject)


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepends ``prefix`` to the key of every ShardedBase leaf, in place."""

    def add_prefix(x: Any) -> Any:
        if isinstance(x, ShardedBase):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(add_prefix, sharded_state_dict)


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str) -> None:
    """Replaces ``old_prefix`` by ``new_prefix`` in every sharded key, in place.

    Raises CheckpointingValueError (a ValueError) if a key does not start with ``old_prefix``;
    keys are only changed once all of them have been checked, so an error leaves the state
    dict untouched.
    """
    leaves = []

    def collect(x: Any) -> Any:
        if isinstance(x, _KEYED):
            if not x.key.startswith(old_prefix):
                raise CheckpointingValueError(f"expected key {x.key!r} to begin with prefix {old_prefix!r}")
            leaves.append(x)
        return x

    dict_list_map_inplace(collect, sharded_state_dict)
    for leaf in leaves:
        leaf.key = f"{new_prefix}{leaf.key[len(old_prefix):]}"


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: Dict[str, str]) -> None:
    """Rewrites sharded keys by the first matching ``old -> new`` prefix of ``prefix_map``, in
    place; keys matching no prefix are left as they are."""

    def replace_prefix(x: Any) -> Any:
        if isinstance(x, _KEYED):
            for old_prefix, new_prefix in prefix_map.items():
                if x.key.startswith(old_prefix):
                    x.key = f"{new_prefix}{x.key[len(old_prefix):]}"
                    break
        return x

    dict_list_map_inplace(replace_prefix, sharded_state_dict)


# ---------------------------------------------------------------------------------------------
# Megatron-Core's shard ids and small helpers (``megatron.core.dist_checkpointing.utils``)

_ShardId = Tuple[str, tuple, Optional[tuple]]


def zip_strict(*args: Any) -> Any:
    """``zip`` that raises ValueError when the iterables' lengths differ."""
    lists = [list(a) for a in args]
    lengths = {len(x) for x in lists}
    if len(lengths) > 1:
        raise ValueError(f"zip_strict: iterables of different lengths {sorted(len(x) for x in lists)}")
    return zip(*lists)


def _sharded_tensor_shard_id(sharded_tensor: Any) -> _ShardId:
    """The id of a tensor shard's data, the same on every rank holding a replica of it."""
    f_range = sharded_tensor.flattened_range
    return (
        sharded_tensor.key,
        tuple(sharded_tensor.global_offset),
        None if f_range is None else (f_range.start, f_range.stop),
    )


def _sharded_object_id(sharded_object: Any) -> _ShardId:
    """The id of an object shard, the same on every rank holding a replica of it."""
    return (sharded_object.key, tuple(sharded_object.global_offset), tuple(sharded_object.global_shape))


def force_all_tensors_to_non_fp8(sharded_state_dict: ShardedStateDict) -> None:
    """Megatron dequantizes FP8 (TransformerEngine) tensors before loading; tensors that know
    how (``dequantize``/``from_float8``) are replaced by their high-precision value."""

    def to_non_fp8(x: Any) -> Any:
        data = getattr(x, "data", None)
        if data is not None and type(data).__name__ == "Float8Tensor":
            x.data = data.dequantize() if hasattr(data, "dequantize") else data.from_float8()
        return x

    dict_list_map_inplace(to_non_fp8, sharded_state_dict)


_LOGGER_NAMES: List[str] = []
_LOGGERS: List[logging.Logger] = []


@contextmanager
def logger_stack(name: Optional[str] = None, current_logger: Optional[logging.Logger] = None) -> Iterator[Any]:
    """Nests ``name`` under the names of the enclosing stacks: yields (``"a.b.name"``, logger)."""
    if name:
        _LOGGER_NAMES.append(name)
    if current_logger:
        _LOGGERS.append(current_logger)
    try:
        yield ".".join(_LOGGER_NAMES), (_LOGGERS[-1] if _LOGGERS else logging.getLogger(__name__))
    finally:
        if name:
            _LOGGER_NAMES.pop()
        if current_logger:
            _LOGGERS.pop()


@contextmanager
def debug_time(
    name: str, logger: Optional[logging.Logger] = None, threshold: float = float("-inf"), level: Optional[int] = None
) -> Iterator[None]:
    """Logs how long the block took (DEBUG; WARNING when a ``threshold`` in seconds is passed)."""
    with logger_stack(name, logger) as (stacked_name, last_logger):
        start = time.time()
        try:
            yield
        finally:
            took = time.time() - start
            if took >= threshold:
                lvl = level if level is not None else (logging.DEBUG if threshold == float("-inf") else logging.WARNING)
                last_logger.log(lvl, f"{stacked_name} took {took:.4f}s")


def debug_msg(msg: str) -> None:
    """Logs ``msg`` at DEBUG under the current logger stack's name."""
    with logger_stack(None, None) as (stacked_name, last_logger):
        last_logger.debug(f"{stacked_name} {msg}")


def _clean_metadata_for_serialization(metadata: Optional[dict]) -> Optional[dict]:
    """A copy of ``metadata`` without what cannot be saved (the ``dp_cp_group`` process group)."""
    if metadata is None:
        return None
    clean = metadata.copy()
    clean.pop("dp_cp_group", None)
    return clean
