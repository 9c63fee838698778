"""Fully parallel save and load wrappers (megatron-core's ``strategies.fully_parallel``).

Around tessera's own strategies the wrappers only switch the native engine's behaviour: its saves
are always fully parallel (each chunk replicated over ranks is written by one holder, chosen by
a balanced assignment every rank computes alike), and ``FullyParallelLoadStrategyWrapper`` makes
the load collective over ``parallelization_group``, each byte range needed by several ranks read
once and sent to the others (``exchange_reads``), all in Rust.

Around any other strategy (a caller's own) the wrappers do what megatron's do, so that strategy is
called with a distributed state dict: the save marks the shards this rank writes as main replicas
(``replica_id`` 0, the others 1) and calls the wrapped strategy; the load calls the wrapped
strategy for this rank's share and exchanges the rest by broadcasts (``exchange_utils``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Tuple, Type, TypeVar, cast

try:
    import torch
    import torch.distributed
except ImportError:  # the pure-Python parts of the package work without torch
    torch = None  # type: ignore[assignment]

from .. import _engine
from ..core import CheckpointingException
from ..dict_utils import dict_list_map_inplace, extract_matching_values, merge, nested_values
from ..exchange_utils import (
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
    exchange_loaded_objects_gather_object,
)
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from ..utils import _sharded_object_id, _sharded_tensor_shard_id, _ShardId
from .base import AsyncSaveShardedStrategy, LoadShardedStrategy, SaveShardedStrategy

__all__ = [
    "FullyParallelSaveStrategyWrapper",
    "FullyParallelLoadStrategyWrapper",
    "distribute_main_replicas_with_precomputed_distribution",
    "_sharded_tensor_shard_id",
    "_sharded_object_id",
]

logger = logging.getLogger(__name__)

T = TypeVar("T", ShardedObject, ShardedTensor)


def _is_native(strategy: Any, attr: str) -> bool:
    return bool(getattr(strategy, attr, None))


def _group_size(group: Any) -> int:
    if torch is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Spreads the writing of replicated shards over ``parallelization_group`` (default: all
    ranks). ``do_cache_distribution`` keeps the computed distribution (``cached_distribution``)
    for the next saves of the same structure."""

    def __init__(
        self, strategy: SaveShardedStrategy, parallelization_group: Any = None, do_cache_distribution: bool = False
    ) -> None:
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.cached_distribution: Optional[ShardDistribution] = None

    @property
    def native_writer(self) -> Optional[str]:
        """The wrapped strategy's native writer: the engine already saves fully parallel."""
        return getattr(self.base_strategy, "native_writer", None)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        if self.native_writer:
            return _engine.save_by_strategy(self, sharded_state_dict, checkpoint_dir, async_save=True)
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(f"Cannot apply async_save to non-async base strategy {self.base_strategy}")
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        if self.native_writer:
            return _engine.save_by_strategy(self, sharded_state_dict, checkpoint_dir, async_save=False)
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Marks the shards this rank writes with ``replica_id`` 0 and the others with 1."""
        distribution: Optional[ShardDistribution]
        if self.do_cache_distribution and self.cached_distribution is not None:
            distribution = self.cached_distribution
        else:
            distribution = determine_main_replica_uniform_distribution(sharded_state_dict, self.parallelization_group)
        distribute_main_replicas_with_precomputed_distribution(
            sharded_state_dict, self.parallelization_group, distribution
        )
        if self.do_cache_distribution:
            self.cached_distribution = distribution


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """Spreads the reading over ``parallelization_group`` (default: all ranks): each shard
    needed by several ranks is read by one of them and sent to the others."""

    def __init__(
        self,
        strategy: LoadShardedStrategy,
        parallelization_group: Any = None,
        do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
    ) -> None:
        super().__init__()
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
        self.cached_distribution: Optional[ShardDistribution] = None
        self.backend = getattr(strategy, "backend", None)
        self.version = getattr(strategy, "version", None)

    @property
    def native_reader(self) -> bool:
        return _is_native(self.base_strategy, "native_reader")

    @property
    def exchange_reads(self) -> bool:
        """For the native engine: make the load collective and exchange shared reads."""
        return self.native_reader

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.base_strategy.check_version_compatibility(loaded_version)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def load_tensors_metadata(self, checkpoint_dir: Any) -> Dict[str, ShardedTensor]:
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: Any, key_prefix: str) -> Any:
        return self.base_strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> StateDict:
        if self.native_reader:
            return _engine.load_by_strategy(self, sharded_state_dict, checkpoint_dir)
        if _group_size(self.parallelization_group) <= 1:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        distribution = self.apply_loading_parallelization(sharded_state_dict)
        # a group of several ranks: distribute_main_replicas_with_precomputed_distribution
        # raised on a missing distribution
        assert distribution is not None
        tensors, rest, to_load_tensors, unloaded_tensors = _defer_loading_sharded_items(
            sharded_state_dict, ShardedTensor, _sharded_tensor_shard_id
        )
        objects, rest, to_load_objects, unloaded_objects = _defer_loading_sharded_items(
            rest, ShardedObject, _sharded_object_id
        )
        # As megatron-core does, the base strategy loads flat dicts keyed by shard id (a state
        # dict's keys are only carried through), so what it returns is keyed by shard id too.
        loaded_objects = cast(
            Dict[_ShardId, Any], self.base_strategy.load(cast(ShardedStateDict, to_load_objects), checkpoint_dir)
        )
        loaded_tensors = cast(
            Dict[_ShardId, Any], self.base_strategy.load(cast(ShardedStateDict, to_load_tensors), checkpoint_dir)
        )
        all_tensors = exchange_by_distribution(
            loaded_tensors, unloaded_tensors, distribution, self.parallelization_group, self.exchange_algo
        )
        missing = set(unloaded_tensors) - set(all_tensors)
        if missing:
            raise CheckpointingException(f"Missing shards after fully parallel loading: {missing}")
        all_objects = exchange_loaded_objects_gather_object(loaded_objects)
        missing = set(unloaded_objects) - set(all_objects)
        if missing:
            raise CheckpointingException(f"Missing object shards after fully parallel loading: {missing}")
        _fill_in_deferred_sharded_items(tensors, all_tensors, ShardedTensor, _sharded_tensor_shard_id)
        _fill_in_deferred_sharded_items(objects, all_objects, ShardedObject, _sharded_object_id)
        loaded: StateDict = {}
        merge(loaded, objects)
        merge(loaded, tensors)
        return loaded

    def apply_loading_parallelization(self, sharded_state_dict: ShardedStateDict) -> Optional[ShardDistribution]:
        """Computes (or reuses) the load distribution and marks this rank's shards as main replicas."""
        distribution: Optional[ShardDistribution]
        if self.do_cache_distribution and self.cached_distribution is not None:
            distribution = self.cached_distribution
        else:
            distribution = determine_main_replica_uniform_distribution(
                sharded_state_dict, self.parallelization_group, True
            )
        distribute_main_replicas_with_precomputed_distribution(
            sharded_state_dict, self.parallelization_group, distribution
        )
        if self.do_cache_distribution:
            self.cached_distribution = distribution
        return distribution


def distribute_main_replicas_with_precomputed_distribution(
    sharded_state_dict: ShardedStateDict, parallelization_group: Any, precomputed_distribution: Optional[ShardDistribution]
) -> None:
    """Sets ``replica_id`` 0 on the shards this rank was assigned, 1 on the others."""
    if _group_size(parallelization_group) <= 1:
        return
    if precomputed_distribution is None:
        raise ValueError("precomputed_distribution must be not None for non-trivial parallelization group")
    rank = torch.distributed.get_rank(group=parallelization_group)
    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, ShardedTensor):
            continue
        sid = _sharded_tensor_shard_id(sh)
        mine = sid in precomputed_distribution.shards_in_this_group and (
            precomputed_distribution.main_rank_for_shard[sid] == rank
        )
        sh.replica_id = 0 if mine else 1


def _defer_loading_sharded_items(
    sharded_state_dict: ShardedStateDict, item_type: Type[T], shard_id_func: Callable[[T], _ShardId]
) -> Tuple[ShardedStateDict, ShardedStateDict, Dict[_ShardId, Any], Dict[_ShardId, Any]]:
    """(items of ``item_type``, the rest, id -> items this rank loads, id -> items others load)."""
    to_load: Dict[_ShardId, Any] = {}
    unloaded: Dict[_ShardId, Any] = {}
    items, rest = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, item_type))

    def split(x: Any) -> Any:
        if isinstance(x, item_type):
            sid = shard_id_func(x)
            (to_load if is_main_replica(x.replica_id) else unloaded)[sid] = x
        return x

    dict_list_map_inplace(split, items)
    return items, rest, to_load, unloaded


def _fill_in_deferred_sharded_items(
    sharded_state_dict: ShardedStateDict, loaded: Dict[_ShardId, Any], item_type: type, shard_id_func: Callable[[Any], _ShardId]
) -> None:
    def fill(x: Any) -> Any:
        if isinstance(x, item_type):
            return loaded[shard_id_func(x)]
        return x

    dict_list_map_inplace(fill, sharded_state_dict)
