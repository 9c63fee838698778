"""Megatron's two-stage data-parallel load (``strategies.two_stage``, documented by the seeds).

Megatron loads each chunk on one data-parallel rank and broadcasts it. tessera's core does the
same when a load exchanges its reads (``exchange_reads``): each byte range needed by several
ranks is read once and sent to the others. This strategy is that load under megatron's name.
"""

from __future__ import annotations

from typing import Any

from ..mapping import ShardedTensor
from ..utils import debug_time
from ._native_load import NativeLoadShardedStrategy


__all__ = ["TwoStageDataParallelLoadShardedStrategy", "sharded_tensor_chunk_id", "timed"]


def sharded_tensor_chunk_id(sharded_tensor: ShardedTensor) -> tuple:
    """The id of a tensor chunk: key and global offset."""
    return (sharded_tensor.key, tuple(sharded_tensor.global_offset))


def timed(verbose: bool = True) -> Any:
    """Megatron's timing decorator; logs the call's duration at DEBUG."""

    def wrap(fn: Any) -> Any:
        def inner(*args: Any, **kwargs: Any) -> Any:
            with debug_time(fn.__name__):
                return fn(*args, **kwargs)

        return inner

    return wrap


class TwoStageDataParallelLoadShardedStrategy(NativeLoadShardedStrategy):
    """Reads each chunk once within ``data_parallel_group`` and sends it to the ranks that need it
    (its ``load`` is the native load, which ``exchange_reads`` makes exchange over that group)."""

    exchange_reads = True

    def __init__(self, data_parallel_group: Any, cpu_transfer: bool = True) -> None:
        super().__init__("zarr", 1)
        self.parallelization_group = data_parallel_group
        self.data_parallel_group = data_parallel_group
        self.cpu_transfer = cpu_transfer
