"""Pre-processing of state dicts around save and load (megatron-core's ``state_dict_utils``).

Used by ``serialization`` when a caller's own strategy (not one the native engine runs) saves or
loads: the strategy gets what megatron would give it. Sharding validation is the core's
(``validation.validate_sharding_integrity`` calls ``tessera._native.validate_sharding``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

from .dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from .mapping import ShardedStateDict, ShardedTensor, ShardedTensorFactory, StateDict, apply_factories
from .utils import _clean_metadata_for_serialization, extract_nonpersistent, extract_sharded_base
from .validation import _validate_common_state_dict, validate_sharding_integrity

__all__ = ["save_preprocess", "load_preprocess", "filter_out_empty_flatten_tensor"]

_Nested = TypeVar("_Nested", dict, list)


def save_preprocess(
    sharded_state_dict: ShardedStateDict,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]] = None,
) -> Tuple[ShardedStateDict, StateDict]:
    """Applies factories, drops non-persistent values and splits off the common state;
    with ``validate_access_integrity``, checks the sharding (collective, in the core) and that the
    common state (after ``preprocess_common_before_consistancy_check``) agrees with rank 0's."""
    apply_factories(sharded_state_dict)
    _, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    sharded_part, common_state_dict = extract_sharded_base(sharded_state_dict)
    sharded_part = filter_out_empty_flatten_tensor(sharded_part)
    if validate_access_integrity:
        if "content_metadata" in common_state_dict:
            common_state_dict["content_metadata"] = _clean_metadata_for_serialization(
                common_state_dict["content_metadata"]
            )
        checked = common_state_dict
        if preprocess_common_before_consistancy_check is not None:
            checked = preprocess_common_before_consistancy_check(common_state_dict)
        validate_sharding_integrity(list(nested_values(sharded_part)))
        _validate_common_state_dict(checked)
    return sharded_part, common_state_dict


def load_preprocess(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict, Dict[str, Any]]:
    """(a copy of the sharded state dict with factories applied and non-persistent values
    removed, the unwrapped non-persistent values, the factories for ``apply_factory_merges``)."""
    sharded_state_dict, _ = extract_matching_values(sharded_state_dict, lambda x: True)
    sharded_state_dict = filter_out_empty_flatten_tensor(sharded_state_dict)
    factories, _ = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sharded_state_dict)
    nonpersistent, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    return sharded_state_dict, nonpersistent, factories


def filter_out_empty_flatten_tensor(sharded_state_dict: _Nested) -> _Nested:
    """Drops ShardedTensors whose flattened range is empty (nothing to save or load)."""

    def keep(x: Any) -> bool:
        if isinstance(x, ShardedTensor) and x.flattened_range is not None:
            return x.flattened_range.stop > x.flattened_range.start
        return True

    kept, _ = extract_matching_values(sharded_state_dict, keep)
    return kept
