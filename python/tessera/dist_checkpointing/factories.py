"""ShardedTensorFactory: transformations applied to a tensor before saving and undone after
loading, and the helpers that apply them to a whole state dict."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Tuple

from .base import ReplicaId, ShardedBase, ShardedStateDict, StateDict
from .core import CheckpointingException, CheckpointingValueError
from .dict_utils import dict_list_map_inplace

__all__ = ["ShardedTensorFactory", "FactoryBuildFn", "FactoryMergeFn", "apply_factories", "apply_factory_merges"]

FactoryBuildFn = Callable[[str, Any, ReplicaId, Optional[slice]], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], Any]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """Transforms a tensor into a sharded sub-state before saving and back after loading.

    ``build_fn(key, data, replica_id, flattened_range)`` returns a sharded state dict (e.g. the
    two halves of a SwiGLU weight as separate ShardedTensors); ``merge_fn(loaded_sub_state)``
    inverts it. Being applied to optimizer states exactly as to the parameters is what makes it
    useful. ``flattened_range`` is Megatron's: the part of the flattened tensor the factory's
    ShardedTensors hold (a distributed optimizer's shard), passed through to ``build_fn``, which
    decides what it means (Megatron-Core 0.16's own build functions ignore it).
    """

    key: str
    data: Any
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def build(self) -> ShardedStateDict:
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        if not isinstance(self.key, str):
            raise CheckpointingException(f"ShardedTensorFactory key must be a str, got {self.key!r}")
        # The replica id is not checked here: it is handed to build_fn, and the core converts
        # (and refuses) the replica ids of the tensors built.
        if not callable(self.build_fn) or not callable(self.merge_fn):
            raise CheckpointingException(f"{self.key!r}: build_fn and merge_fn must be callable")

    def without_data(self) -> "ShardedTensorFactory":
        return replace(self, data=None)

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key={self.key!r})"


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replaces every ShardedTensorFactory by the sub-state it builds, in place."""

    def build(x: Any) -> Any:
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(build, sharded_state_dict)


def apply_factory_merges(x1: StateDict, x2: ShardedStateDict, key: Tuple[Any, ...] = ()) -> StateDict:
    """Runs, in place, the merges of the factories of ``x2`` on the loaded ``x1``.

    ``x2`` is a subset of ``x1`` (by keys) whose leaves are ShardedTensorFactory; the loaded
    sub-state at each factory's position is replaced by ``merge_fn(sub_state)``.
    """
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise CheckpointingValueError(
                    f"factory key {key + (k,)} missing from the loaded state dict (keys {list(x1)})"
                )
            x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise CheckpointingValueError(
                f"cannot merge factories into a list of different length ({len(x1)} vs {len(x2)}, at key {key})"
            )
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key + (i,))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if not isinstance(k, int) or not 0 <= k < len(x1):
                raise CheckpointingValueError(
                    f"factory index {k!r} invalid for a list of length {len(x1)} (at key {key})"
                )
            x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
    else:
        raise CheckpointingValueError(
            f"cannot apply factory merges: {type(x1).__name__} loaded where {type(x2).__name__} "
            f"was expected (at key {key})"
        )
    return x1
