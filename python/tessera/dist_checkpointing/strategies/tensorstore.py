"""Megatron's TensorStore reader of zarr checkpoints (``strategies.tensorstore``, documented by
the seeds). tessera reads zarr in its core; the strategy is that reader under megatron's name."""

from __future__ import annotations

from typing import Any, Tuple

from .base import StrategyAction, register_default_strategy
from .zarr import ZarrLoadShardedStrategy

__all__ = ["TensorStoreLoadShardedStrategy", "merge_global_slice_with_shape", "register_default_tensorstore_strategies"]


class TensorStoreLoadShardedStrategy(ZarrLoadShardedStrategy):
    """Loads a zarr checkpoint with the native reader. ``load_directly_on_device`` is kept:
    loaded tensors go to the device of the requested tensor either way."""

    def __init__(self, load_directly_on_device: bool = False) -> None:
        super().__init__()
        self.load_directly_on_device = load_directly_on_device


def merge_global_slice_with_shape(global_slice: Tuple[Any, ...], actual_shape: Tuple[int, ...], key: str) -> Tuple[Any, ...]:
    """``global_slice`` with each slice cut to the array's ``actual_shape`` (no overflow)."""

    def merge(sl: Any, size: int) -> Any:
        if isinstance(sl, slice):
            return slice(sl.start, min(sl.stop, size) if sl.stop is not None else size, sl.step)
        return sl

    del key
    return tuple(merge(sl, size) for sl, size in zip(global_slice, actual_shape))


def register_default_tensorstore_strategies() -> None:
    """Registers the TensorStore strategy as the ``("zarr", 1)`` reader."""
    register_default_strategy(StrategyAction.LOAD_SHARDED, "zarr", 1, TensorStoreLoadShardedStrategy())
