"""Megatron-style distributed-optimizer buffers as model-space, fully reshardable ShardedTensors.

A distributed optimizer (Megatron-Core's ``DistributedOptimizer``, ZeRO-1) packs the
parameters of one model-parallel (TP/PP) rank back to back in a flat buffer, pads it so that
its size divides by the data-parallel size ``dp_size``, and gives DP rank ``d`` the ``d``-th of
``dp_size`` equal contiguous shards. Every optimizer state (``exp_avg``, ``exp_avg_sq``, fp32
master weights) is a 1-D tensor of that shard's size.

``dist_optimizer_sharded_tensors`` maps such a local shard to ShardedTensors in *model space*:
for each parameter that intersects the shard, a ShardedTensor with the parameter's global
geometry whose ``data`` is a zero-copy slice of the shard and whose ``flattened_range`` is the
intersection in the flattening of the parameter's local box. Saving them writes each rank's
slices straight from the buffer (no gather, no copy) and any later layout -- other TP, PP, DP
or world size, or plain full tensors -- can load them. Loading through the same helper on a
preallocated CPU shard fills the shard in place.

``param_buffer_layout`` computes the ``[start, end)`` offsets of the parameters in such a
buffer the way Megatron-Core's param-and-grad buffer does (aligned parameter starts, end padded
to a multiple of ``dp_size * bucket_alignment``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from .base import ReplicaId
from .core import CheckpointingException
from .mapping import ShardedTensor

__all__ = [
    "BufferLayout",
    "ParamRange",
    "dist_optimizer_sharded_tensors",
    "dist_optimizer_state_dict",
    "dp_shard_range",
    "param_buffer_layout",
]


class ParamRange(NamedTuple):
    """One parameter's place in a flat buffer: its model-space description and ``[start, end)``.

    ``param`` is the ShardedTensor of the model parameter (its ``data`` and ``dtype`` are
    ignored; its key, local and global shape, global offset, prepend_axis_num,
    axis_fragmentations and replica_id are used). ``end - start`` must equal the number of
    elements of its local box, which the buffer holds in row-major order.
    """

    param: ShardedTensor
    start: int
    end: int


@dataclass(frozen=True)
class BufferLayout:
    """Offsets of the parameters in a flat buffer and the buffer's padded size.

    ``ranges[i]`` is the ``[start, end)`` of the ``i``-th parameter given to
    ``param_buffer_layout``; ``total`` (a multiple of ``dp_size``) includes every alignment gap
    and the end padding, and ``shard_size = total // dp_size`` is each DP rank's share.
    """

    ranges: Tuple[Tuple[int, int], ...]
    total: int
    dp_size: int

    @property
    def shard_size(self) -> int:
        return self.total // self.dp_size

    def shard_range(self, dp_rank: int) -> Tuple[int, int]:
        """``[start, end)`` of DP rank ``dp_rank``'s shard in the full buffer."""
        return dp_shard_range(self.total, self.dp_size, dp_rank)

    def param_ranges(self, params: Sequence[ShardedTensor]) -> List[ParamRange]:
        """Pairs ``params`` (in the order the layout was built) with their offsets."""
        if len(params) != len(self.ranges):
            raise CheckpointingException(f"layout has {len(self.ranges)} parameters, got {len(params)}")
        return [ParamRange(p, start, end) for p, (start, end) in zip(params, self.ranges)]


ParamLike = Union[int, Sequence[int], ShardedTensor, Any]


def _numel_of(item: ParamLike) -> int:
    """Element count of an int, a shape, a ShardedTensor (its local box) or a tensor."""
    if isinstance(item, ShardedTensor):
        return math.prod(item.local_shape)
    if isinstance(item, int):
        return item
    if hasattr(item, "numel") and callable(item.numel):
        return int(item.numel())
    if hasattr(item, "size") and hasattr(item, "shape"):  # numpy arrays
        return int(item.size)
    return math.prod(int(s) for s in item)


def _round_up(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def param_buffer_layout(
    params: Sequence[ParamLike], dp_size: int, *, param_alignment: int = 64, bucket_alignment: int = 128
) -> BufferLayout:
    """Packs ``params`` back to back, in the given order, like Megatron-Core's param-and-grad buffer.

    Each parameter starts at a multiple of ``param_alignment`` elements (Megatron uses 64), so
    gaps may separate parameters, and the end is padded to a multiple of
    ``dp_size * bucket_alignment`` elements so that every DP shard has the same size and starts
    aligned. ``params`` items may be element counts, shapes, tensors or ShardedTensors (their
    local box). Megatron packs a bucket's parameters in reverse order of definition; pass them in
    whatever order the optimizer uses. One layout describes one bucket: a buffer of several
    buckets shards each bucket separately, so build a layout per bucket.
    """
    if dp_size < 1 or param_alignment < 1 or bucket_alignment < 1:
        raise CheckpointingException(
            f"dp_size ({dp_size}), param_alignment ({param_alignment}) and bucket_alignment "
            f"({bucket_alignment}) must be >= 1"
        )
    ranges = []
    cursor = 0
    for item in params:
        numel = _numel_of(item)
        if numel < 0:
            raise CheckpointingException(f"parameter {item!r} has a negative element count {numel}")
        start = _round_up(cursor, param_alignment)
        ranges.append((start, start + numel))
        cursor = start + numel
    return BufferLayout(tuple(ranges), _round_up(cursor, dp_size * bucket_alignment), dp_size)


def dp_shard_range(total: int, dp_size: int, dp_rank: int) -> Tuple[int, int]:
    """``[start, end)`` of DP rank ``dp_rank``'s equal share of a ``total``-element buffer."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise CheckpointingException(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
    if total % dp_size != 0:
        raise CheckpointingException(f"buffer of {total} elements does not split into {dp_size} equal shards")
    size = total // dp_size
    return dp_rank * size, (dp_rank + 1) * size


def _optimizer_replica_id(replica_id: ReplicaId, dp_replica_axis: Optional[int]) -> ReplicaId:
    """The model param's replica id with its DP coordinate set to 0 (see the caller)."""
    if isinstance(replica_id, int) or dp_replica_axis is None:
        return replica_id
    parts = list(replica_id)
    try:
        parts[dp_replica_axis] = 0
    except IndexError:
        raise CheckpointingException(
            f"replica_id {replica_id!r} has no coordinate {dp_replica_axis} (dp_replica_axis)"
        ) from None
    return tuple(parts)


def _as_param_range(entry: Union[ParamRange, Tuple[ShardedTensor, int, int]]) -> ParamRange:
    try:
        param, start, end = entry
    except (TypeError, ValueError):
        raise CheckpointingException(f"expected (ShardedTensor, start, end), got {entry!r}") from None
    if not isinstance(param, ShardedTensor):
        raise CheckpointingException(
            f"parameter description must be a ShardedTensor, got {type(param).__name__} (apply factories first)"
        )
    return ParamRange(param, int(start), int(end))


def _checked_ranges(params: Sequence[Union[ParamRange, Tuple[ShardedTensor, int, int]]], total: int) -> List[ParamRange]:
    """The entries as ParamRanges, after checking sizes, bounds and overlaps."""
    entries = [_as_param_range(e) for e in params]
    for p in entries:
        key = p.param.key
        if p.param.flattened_range is not None:
            raise CheckpointingException(f"{key!r}: the model parameter description must not have a flattened_range")
        numel = math.prod(p.param.local_shape)
        if not 0 <= p.start <= p.end <= total:
            raise CheckpointingException(f"{key!r}: range [{p.start}, {p.end}) is outside the {total}-element buffer")
        if p.end - p.start != numel:
            raise CheckpointingException(
                f"{key!r}: range [{p.start}, {p.end}) holds {p.end - p.start} elements, its local box "
                f"{p.param.local_shape} has {numel}"
            )
    ordered = sorted((p for p in entries if p.end > p.start), key=lambda p: p.start)
    for a, b in zip(ordered, ordered[1:]):
        if b.start < a.end:
            raise CheckpointingException(
                f"{a.param.key!r} [{a.start}, {a.end}) and {b.param.key!r} [{b.start}, {b.end}) overlap in the buffer"
            )
    return entries


def dist_optimizer_sharded_tensors(
    shard: Any,
    dp_rank: int,
    dp_size: int,
    params: Sequence[Union[ParamRange, Tuple[ShardedTensor, int, int]]],
    prefix: str,
    *,
    dp_replica_axis: Optional[int] = -1,
) -> List[ShardedTensor]:
    """Model-space ShardedTensors of DP rank ``dp_rank``'s shard of a flat optimizer buffer.

    ``shard`` is the 1-D local shard (one optimizer state, e.g. ``exp_avg``): elements
    ``[dp_rank * n, (dp_rank + 1) * n)`` of the full buffer, ``n = shard.numel()``, whose size is
    ``dp_size * n``. ``params`` gives every parameter of this model-parallel rank's buffer as
    ``(model ShardedTensor, start, end)`` (see ``ParamRange``, ``param_buffer_layout``); elements
    of the buffer outside every range are padding and are neither saved nor loaded.

    Returns, in buffer order, one ShardedTensor per parameter intersecting the shard, keyed
    ``prefix + param.key`` (e.g. ``prefix="optimizer.state.exp_avg."``), with the parameter's
    global geometry, ``dtype`` of the shard, ``data`` a zero-copy 1-D slice (view) of ``shard`` and
    ``flattened_range`` the intersection in the row-major flattening of the parameter's local
    box. Parameters with the same key (stacked layers) give separate entries, hence a list.

    Replica ids: the DP ranks of one model-parallel rank hold disjoint flat ranges, so with
    respect to DP each range is its own main replica; replication across TP (a layernorm on
    every TP rank) must still be saved once. So a tuple ``replica_id`` of the model parameter
    keeps every coordinate except the DP one, at index ``dp_replica_axis`` (default -1: the last
    coordinate of Megatron's ``(PP, TP, DP)``), which is set to 0; ``dp_replica_axis=None`` keeps
    tuples unchanged. An int ``replica_id`` is kept unchanged: it must not count DP replicas.

    For loading, pass a preallocated CPU shard: ``dc.load`` fills the views, hence the shard, in
    place (tensors on other devices come back as new tensors to copy into the slices).
    """
    if len(getattr(shard, "shape", ())) != 1:
        raise CheckpointingException(f"the local shard must be a 1-D tensor, got shape {getattr(shard, 'shape', None)}")
    shard_size = int(shard.shape[0])
    total = shard_size * dp_size
    shard_start, shard_end = dp_shard_range(total, dp_size, dp_rank)
    out: List[ShardedTensor] = []
    for p in sorted(_checked_ranges(params, total), key=lambda p: p.start):
        lo, hi = max(p.start, shard_start), min(p.end, shard_end)
        if lo >= hi:
            continue
        model = p.param
        out.append(
            ShardedTensor(
                key=f"{prefix}{model.key}",
                data=shard[lo - shard_start : hi - shard_start],
                dtype=shard.dtype,
                local_shape=model.local_shape,
                global_shape=model.global_shape,
                global_offset=model.global_offset,
                axis_fragmentations=model.axis_fragmentations,
                replica_id=_optimizer_replica_id(model.replica_id, dp_replica_axis),
                prepend_axis_num=model.prepend_axis_num,
                allow_shape_mismatch=model.allow_shape_mismatch,
                flattened_range=slice(lo - p.start, hi - p.start),
            )
        )
    return out


def dist_optimizer_state_dict(
    shards: Mapping[str, Any],
    dp_rank: int,
    dp_size: int,
    params: Sequence[Union[ParamRange, Tuple[ShardedTensor, int, int]]],
    prefix: str = "optimizer.state",
    *,
    dp_replica_axis: Optional[int] = -1,
) -> Dict[str, List[ShardedTensor]]:
    """``dist_optimizer_sharded_tensors`` for several states sharing one buffer layout.

    ``shards`` maps a state name (``"exp_avg"``, ``"exp_avg_sq"``, ``"fp32_param"``) to its
    local 1-D shard; the result maps it to its ShardedTensors keyed
    ``f"{prefix}.{state}.{param.key}"`` -- the keys ``optim_state_to_sharding_state`` gives
    non-distributed optimizers, so either form loads the other.
    """
    return {
        state: dist_optimizer_sharded_tensors(
            shard, dp_rank, dp_size, params, f"{prefix}.{state}.", dp_replica_axis=dp_replica_axis
        )
        for state, shard in shards.items()
    }
