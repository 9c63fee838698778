"""Shard distribution and exchange over a process group (megatron-core's ``exchange_utils``).

tessera's own strategies never come here: the native engine plans which replica writes each
chunk (save) and which rank reads each byte range and sends it on (``exchange_reads``) in Rust.
These functions serve ``FullyParallel{Save,Load}StrategyWrapper`` around a strategy that is not
tessera's (a caller's own, e.g. a test's mock): the wrapper must then hand that strategy a
distributed state dict, as megatron does. The assignment is deterministic on every rank, so
only the metadata is exchanged (``all_gather_object``) before it.

torch is an optional extra of the package, so it is imported where it is used, not with this
module.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from functools import reduce
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple, TypeVar

from .core import CheckpointingException
from .dict_utils import nested_values
from .mapping import ShardedStateDict, ShardedTensor, is_main_replica
from .utils import _sharded_tensor_shard_id, _ShardId

__all__ = [
    "ShardDistribution",
    "distribute_shards_to_ranks",
    "determine_main_replica_uniform_distribution",
    "exchange_loaded_tensors_broadcast",
    "exchange_loaded_objects_gather_object",
    "exchange_by_distribution",
]

logger = logging.getLogger(__name__)


class ShardDistribution(NamedTuple):
    """Which rank of a parallelization group holds the main replica of each shard.

    ``main_rank_for_shard``: shard id -> rank (in the group) that saves / loads it;
    ``shards_in_this_group``: shards with a main replica in the group;
    ``shard_to_metadata``: shard id -> a ShardedTensor describing it;
    ``all_ranks_for_shard``: shard id -> ranks of the group that need it.
    """

    main_rank_for_shard: Dict[_ShardId, int]
    shards_in_this_group: Set[_ShardId]
    shard_to_metadata: Dict[_ShardId, ShardedTensor]
    all_ranks_for_shard: Dict[_ShardId, List[int]]


def _torch() -> Any:
    import torch

    return torch


def _shard_size(sh_ten: ShardedTensor) -> int:
    """Bytes of the local shard."""
    numel = 1
    for s in sh_ten.local_shape:
        numel *= int(s)
    return numel * _torch().empty((), dtype=sh_ten.dtype).element_size()


def _get_empty_tensor_for_exchange(
    shard_id: _ShardId,
    needed_shards: Dict[_ShardId, ShardedTensor],
    unneeded_shards: Dict[_ShardId, ShardedTensor],
    loaded_tensors: Dict[_ShardId, Any],
) -> Tuple[Any, Optional[Any]]:
    """A buffer to receive ``shard_id`` into, and the device of the state dict's tensor (None
    when this rank does not need the shard: the buffer is dropped after the exchange)."""
    torch = _torch()
    needed = needed_shards.get(shard_id)
    if needed is None:
        sh_ten = unneeded_shards[shard_id]
        if sh_ten.data is None:
            sh_ten.init_data("cuda")
            tensor = sh_ten.data
            sh_ten.data = None
        else:
            tensor = sh_ten.data
            if tensor.device.type == "cpu":
                tensor = torch.empty_like(tensor, device="cuda")
        return tensor, None
    needed.init_data("cuda")
    assert needed.data is not None  # init_data allocated it
    orig_device = needed.data.device
    tensor = needed.data
    if tensor.device.type == "cpu":
        tensor = torch.empty_like(tensor, device="cuda")
    loaded_tensors[shard_id] = tensor
    return tensor, orig_device


_GET_EMPTY_TENSOR_FOR_EXCHANGE = _get_empty_tensor_for_exchange


def _empty_tensor_for_exchange() -> Any:
    """``_get_empty_tensor_for_exchange`` as the module holds it at call time (callers, e.g.
    Megatron's tests, replace it with ``mock.patch``), or the function defined here when the
    module no longer holds the name: a patcher working through a proxy of this module (a
    ``sys.modules`` alias object that is not the module itself) restores the original onto the
    proxy after deleting it here."""
    return globals().get("_get_empty_tensor_for_exchange", _GET_EMPTY_TENSOR_FOR_EXCHANGE)


T = TypeVar("T")


def distribute_shards_to_ranks(
    shard_to_ranks: Dict[T, List[int]],
    shard_to_size: Dict[T, int],
    num_ranks: int,
    cross_parallelization_group_loads: Set[T],
) -> Dict[T, int]:
    """Assigns each shard to one of the ranks that hold it, balancing bytes per rank.

    Greedy and deterministic: shards whose main replica is in another group come last, then
    lowest coverage (fewest holders) first, then largest first, then by shard id; each goes to
    its least loaded holder (ties: lowest rank).
    """
    holders = {k: tuple(v) for k, v in shard_to_ranks.items()}
    load = [0] * num_ranks
    assignment: Dict[T, int] = {}
    order = sorted(
        holders.items(),
        key=lambda item: (
            int(item[0] in cross_parallelization_group_loads),
            len(item[1]),
            -shard_to_size[item[0]],
            item[0],
        ),
    )
    for shard_id, ranks in order:
        _, rank = min((load[r], r) for r in ranks)
        assignment[shard_id] = rank
        load[rank] += shard_to_size[shard_id]
    logger.debug("distribute_shards_to_ranks: bytes per rank %s", load)
    return assignment


def _group_size_rank(group: Any) -> Tuple[int, int]:
    dist = _torch().distributed
    return dist.get_world_size(group=group), dist.get_rank(group=group)


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict, parallelization_group: Any, ignore_groups: bool = False
) -> Optional[ShardDistribution]:
    """Gathers the group's shard metadata and assigns each shard to a rank
    (:func:`distribute_shards_to_ranks`). None for a group of one rank.

    Without ``ignore_groups`` only shards whose main replica is in the group are assigned (save);
    with it, every shard a rank of the group needs (load), those with a main replica elsewhere last.
    """
    dist = _torch().distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if parallelization_group is None:
        parallelization_group = dist.group.WORLD
    size, _ = _group_size_rank(parallelization_group)
    if size <= 1:
        return None
    local = [sh.without_data() for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)]
    gathered: List[Any] = [None] * size
    dist.all_gather_object(gathered, local, group=parallelization_group)

    shard_to_ranks: Dict[_ShardId, List[int]] = defaultdict(list)
    shard_to_size: Dict[_ShardId, int] = {}
    shard_to_metadata: Dict[_ShardId, ShardedTensor] = {}
    with_main: Set[_ShardId] = set()
    with_other: Set[_ShardId] = set()
    for rank, shards in enumerate(gathered):
        for sh in shards:
            sid = _sharded_tensor_shard_id(sh)
            shard_to_ranks[sid].append(rank)
            if sid not in shard_to_size:
                shard_to_size[sid] = _shard_size(sh)
                shard_to_metadata[sid] = sh
            (with_main if is_main_replica(sh.replica_id) else with_other).add(sid)
    in_group = with_main | with_other if ignore_groups else with_main
    cross = in_group - with_main
    shard_to_ranks = {k: v for k, v in shard_to_ranks.items() if k in in_group}
    assignment = distribute_shards_to_ranks(shard_to_ranks, shard_to_size, size, cross)
    return ShardDistribution(assignment, in_group, shard_to_metadata, shard_to_ranks)


def exchange_loaded_tensors_broadcast(
    loaded_tensors: Dict[_ShardId, Any],
    unloaded_shards: Dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Any = None,
) -> Dict[_ShardId, Any]:
    """One broadcast per shard needed by more than one rank, from the rank that loaded it."""
    torch = _torch()
    dist = torch.distributed
    main_rank_for_shard, _, shard_to_metadata, all_ranks_for_shard = shard_distribution
    local_rank = dist.get_rank(group=parallelization_group)
    out = dict(loaded_tensors)
    with torch.no_grad():
        for shard_id, rank in main_rank_for_shard.items():
            if len(all_ranks_for_shard[shard_id]) == 1:
                continue  # the only rank that needs it loaded it
            if rank == local_rank:
                orig_device = out[shard_id].device
                tensor = out[shard_id].cuda()
            else:
                tensor, orig_device = _empty_tensor_for_exchange()(shard_id, unloaded_shards, shard_to_metadata, out)
            src = rank if parallelization_group is None else dist.get_global_rank(parallelization_group, rank)
            dist.broadcast(tensor, src=src, group=parallelization_group)
            if orig_device is not None:
                out[shard_id] = tensor.to(orig_device)
            del tensor
    return out


def exchange_loaded_objects_gather_object(loaded_objects: Dict[_ShardId, Any]) -> Dict[_ShardId, Any]:
    """Every rank's loaded objects, gathered on all ranks (``all_gather_object``)."""
    dist = _torch().distributed
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, loaded_objects, group=None)
    merged: Dict[_ShardId, Any] = reduce(lambda x, y: {**x, **y}, gathered, {})
    if len(merged) != sum(len(x) for x in gathered):
        raise CheckpointingException("Duplicate shard ids loaded by different ranks")
    return merged


def exchange_by_distribution(
    loaded_tensors: Dict[_ShardId, Any],
    unloaded_shards: Dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Any = None,
    exchange_algo: str = "broadcast",
) -> Dict[_ShardId, Any]:
    """Exchanges the loaded shards so that every rank has the ones it needs.

    Only ``"broadcast"`` is implemented here; megatron's ``"gather_rounds"`` and
    ``"gather_object"`` move the same bytes and are served by it too.
    """
    if exchange_algo not in ("broadcast", "gather_rounds", "gather_object"):
        raise NotImplementedError(f"Unrecognized gather algorithm: {exchange_algo}")
    return exchange_loaded_tensors_broadcast(loaded_tensors, unloaded_shards, shard_distribution, parallelization_group)
