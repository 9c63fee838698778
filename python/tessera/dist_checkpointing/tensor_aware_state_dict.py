"""A state dict split into its tensors and the rest (megatron-core's ``tensor_aware_state_dict``),
for in-memory / local checkpoints (NVIDIA Resiliency Extension's ``LocalCheckpointManager``).

The checkpoint manager takes the tensors out (``pop_tensors``), stores them its own way, and
puts them back (``insert_tensors``); ``to_state_dict`` rebuilds the requested state dict, with
the fully parallel exchange of ``exchange_utils`` when shards were saved by one replica only.

torch is an optional extra of the package, so it is imported where it is used, not with this
module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace, dict_list_map_outplace, merge, nested_values
from .exchange_utils import ShardDistribution, determine_main_replica_uniform_distribution, exchange_by_distribution
from .mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, apply_factory_merges
from .state_dict_utils import load_preprocess, save_preprocess
from .utils import _sharded_object_id, _sharded_tensor_shard_id, extract_sharded_base, zip_strict
from .validation import StrictHandling, check_strict_load, parse_strict_flag

__all__ = ["MCoreTensorAwareStateDict"]

logger = logging.getLogger(__name__)

try:
    from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict

    HAVE_NVRX = True
except ImportError:  # the class works without it; only the checkpoint manager needs the base
    TensorAwareStateDict = object  # type: ignore[misc,assignment]
    HAVE_NVRX = False


@dataclass
class MCoreTensorAwareStateDict(TensorAwareStateDict):  # type: ignore[misc,valid-type]
    """The common state and the sharded part of a state dict; tensors can be taken out and put back."""

    common: StateDict
    sharded_state_dict: ShardedStateDict
    _is_hollow: bool = False

    @staticmethod
    def _validate_params(algo: str) -> None:
        if algo not in ("atomic", "fully_parallel"):
            raise NotImplementedError('Only "atomic" and "fully_parallel" sharding algorithms are supported.')

    @staticmethod
    def _get_distribution(
        fully_parallel: bool, sharded_part: ShardedStateDict, parallelization_group: Any, cached_distribution: Any = None
    ) -> Any:
        if not fully_parallel:
            return (None, None, None, None)
        if cached_distribution is not None:
            return cached_distribution
        return determine_main_replica_uniform_distribution(sharded_part, parallelization_group, True)

    @staticmethod
    def _remove_redundant_data(
        fully_parallel: bool, sharded_part: ShardedStateDict, shard_to_saving_rank: Any, parallelization_group: Any
    ) -> None:
        if not fully_parallel:
            return
        import torch.distributed as dist

        rank = dist.get_rank(group=parallelization_group)
        for sh in nested_values(sharded_part):
            if isinstance(sh, ShardedTensor) and shard_to_saving_rank[_sharded_tensor_shard_id(sh)] != rank:
                sh.data = None

    @classmethod
    def from_state_dict(
        cls,
        sharded_state_dict: ShardedStateDict,
        algo: str = "fully_parallel",
        parallelization_group: Any = None,
        cached_metadata: Optional[ShardDistribution] = None,
    ) -> Tuple["MCoreTensorAwareStateDict", Any]:
        """(the tensor-aware state dict, the distribution to pass as ``cached_metadata`` next time).
        With ``"fully_parallel"`` each replicated shard keeps its data on one rank only."""
        cls._validate_params(algo)
        fully_parallel = algo == "fully_parallel"
        sharded_part, common = save_preprocess(sharded_state_dict, cached_metadata is None)
        distribution = cls._get_distribution(fully_parallel, sharded_part, parallelization_group, cached_metadata)
        if distribution is not None:
            cls._remove_redundant_data(fully_parallel, sharded_part, distribution[0], parallelization_group)
        return cls(common=common, sharded_state_dict=sharded_part), distribution

    @property
    def is_hollow(self) -> bool:
        """True while the tensors are taken out (between ``pop_tensors`` and ``insert_tensors``)."""
        return self._is_hollow

    # ``orig_device`` is a dynamic attribute of the ShardedTensors whose tensor was taken out or
    # moved to CPU (megatron-core's convention: its presence is tested with hasattr), hence the
    # ``type: ignore[attr-defined]`` where it is used without such a test.

    @property
    def _sharded_tensors(self) -> Iterator[ShardedTensor]:
        for sh in nested_values(self.sharded_state_dict):
            if isinstance(sh, ShardedTensor) and (hasattr(sh, "orig_device") if self._is_hollow else sh.data is not None):
                yield sh

    def _check(self, hollow: bool) -> None:
        if self._is_hollow != hollow:
            raise CheckpointingException(
                "the state dict's tensors are taken out" if self._is_hollow else "the state dict holds its tensors"
            )

    @property
    def tensors(self) -> Iterator[Any]:
        """The tensors held (in a fixed order)."""
        self._check(False)
        return (sh.data for sh in self._sharded_tensors)

    @property
    def common_state_dict(self) -> Dict[str, Any]:
        return self.common

    def pop_tensors(self) -> List[Any]:
        """Takes the tensors out (their devices are remembered) and returns them in order."""
        self._check(False)
        out = []
        for sh in list(self._sharded_tensors):
            assert sh.data is not None  # not hollow: _sharded_tensors yields those with data
            out.append(sh.data)
            sh.orig_device = sh.data.device.type  # type: ignore[attr-defined]
            sh.data = None
        self._is_hollow = True
        return out

    def insert_tensors(self, tensor_data: Iterable[Any]) -> None:
        """Puts tensors back, in the order :meth:`pop_tensors` gave them."""
        self._check(True)
        for sh, t in zip_strict(list(self._sharded_tensors), tensor_data):
            if sh.orig_device == t.device.type:
                del sh.orig_device
            sh.data = t
        self._is_hollow = False

    def init_tensors(self) -> None:
        """Allocates empty tensors of the original shapes, dtypes and devices."""
        self._check(True)
        for sh in list(self._sharded_tensors):
            sh.init_data(sh.orig_device)  # type: ignore[attr-defined]
            del sh.orig_device  # type: ignore[attr-defined]
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replaces the tensors by CPU copies (devices remembered for :meth:`restore_tensor_device`)."""
        self._check(False)
        for sh in self._sharded_tensors:
            assert sh.data is not None  # not hollow: _sharded_tensors yields those with data
            if sh.data.device.type == "cpu":
                if not hasattr(sh, "orig_device"):
                    sh.data = sh.data.clone()
            else:
                if not hasattr(sh, "orig_device"):
                    sh.orig_device = sh.data.device.type  # type: ignore[attr-defined]
                sh.data = sh.data.detach().to("cpu", non_blocking=non_blocking)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Moves the tensors back to the devices they had before :meth:`copy_tensors_to_cpu`."""
        self._check(False)
        for sh in self._sharded_tensors:
            assert sh.data is not None  # not hollow: _sharded_tensors yields those with data
            if hasattr(sh, "orig_device"):
                sh.data = sh.data.to(sh.orig_device, non_blocking=non_blocking)
                del sh.orig_device

    def _insert_sharded_data(
        self, fully_parallel: bool, sharded_part: ShardedStateDict, parallelization_group: Any, exchange_algo: str
    ) -> None:
        loaded = {_sharded_tensor_shard_id(sh): sh.data for sh in self._sharded_tensors}
        if fully_parallel:
            distribution = self._get_distribution(True, sharded_part, parallelization_group)
            if distribution is not None:
                unloaded = {
                    _sharded_tensor_shard_id(sh): sh
                    for sh in nested_values(sharded_part)
                    if isinstance(sh, ShardedTensor) and _sharded_tensor_shard_id(sh) not in loaded
                }
                loaded = exchange_by_distribution(loaded, unloaded, distribution, parallelization_group, exchange_algo)
        objects = {
            _sharded_object_id(sh): sh.data for sh in nested_values(self.sharded_state_dict) if isinstance(sh, ShardedObject)
        }

        def fill(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                sid = _sharded_tensor_shard_id(x)
                if sid not in loaded:
                    # An AssertionError, as Megatron's: its strictness tests expect exactly this
                    # failure when an unexpected shard is passed through.
                    raise AssertionError(f"shard {sid} is not in the tensor-aware state dict")
                return loaded[sid]
            if isinstance(x, ShardedObject):
                oid = _sharded_object_id(x)
                if oid not in objects:
                    raise AssertionError(f"object {oid} is not in the tensor-aware state dict")
                return objects[oid]
            return x

        dict_list_map_inplace(fill, sharded_part)

    def to_state_dict(
        self,
        sharded_state_dict: ShardedStateDict,
        algo: str = "atomic",
        exchange_algo: str = "broadcast",
        validate_access_integrity: bool = True,
        parallelization_group: Any = None,
        strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
        return_mismatch_keys: bool = False,
    ) -> Any:
        """Rebuilds the state dict that ``sharded_state_dict`` asks for from this one."""
        self._check(False)
        self._validate_params(algo)
        state = dict_list_map_outplace(lambda x: x, self.common)
        if not sharded_state_dict:
            return state
        sharded_state_dict, nonpersistent, factories = load_preprocess(sharded_state_dict)
        merge(state, nonpersistent)
        sharded_part, _ = extract_sharded_base(sharded_state_dict)
        strict = parse_strict_flag(strict)
        missing, unexpected = self._apply_strictness(sharded_part, strict)
        self._insert_sharded_data(algo == "fully_parallel", sharded_part, parallelization_group, exchange_algo)
        merge(state, apply_factory_merges(sharded_part, factories))
        if return_mismatch_keys:
            return state, missing, unexpected
        return state

    def _apply_strictness(self, sharded_part: ShardedStateDict, strict: StrictHandling) -> Tuple[Set[str], Set[str]]:
        """Missing and unexpected keys against what this state dict holds, reported as
        ``strict`` says. The request is not changed: an unexpected shard then fails the
        insertion, as in Megatron (its strictness modes pass such errors through)."""
        held = {sh.key for sh in nested_values(self.sharded_state_dict) if hasattr(sh, "key")}
        _, missing, unexpected = check_strict_load(sharded_part, held, strict)
        return missing, unexpected
