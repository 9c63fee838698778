"""Helpers for manipulating sharded state dicts: splitting them by leaf kind and rewriting the
keys of their sharded leaves (Megatron-Core's ``utils`` module)."""

from __future__ import annotations

from typing import Any, Dict, Tuple

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
