"""Megatron's ``zarr`` backend (megatron-core's ``strategies.zarr``, removed from 0.16 and
documented by the seeds): tessera's core reads zarr checkpoints; it does not write them.
torch is an optional extra of the package, so it is imported where it is used, not with this
module.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from .. import _engine
from ..core import CheckpointingException
from ..mapping import ShardedStateDict, ShardedTensor
from ._native_load import NativeLoadShardedStrategy
from .base import SaveShardedStrategy, StrategyAction, register_default_strategy

__all__ = [
    "ZarrLoadShardedStrategy",
    "ZarrSaveShardedStrategy",
    "flatten_range",
    "pad_to_expected_shape",
    "postprocess_numpy_array",
    "load_zarr_based_sharded_metadata",
    "register_default_zarr_strategies",
]


class ZarrLoadShardedStrategy(NativeLoadShardedStrategy):
    """Loads a zarr checkpoint with the native reader (any layout)."""

    def __init__(self) -> None:
        super().__init__("zarr", 1)


class ZarrSaveShardedStrategy(SaveShardedStrategy):
    """Megatron deprecated writing zarr; tessera's core never wrote it. Saving raises
    CheckpointingException: save with tessera's default (or ``torch_dist``) instead."""

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> None:
        raise CheckpointingException(
            "tessera does not write the zarr backend (Megatron deprecated it); save with the default "
            "strategy (tessera) or ('torch_dist', 1)"
        )


def flatten_range(sharded_tensor: ShardedTensor, x: Any) -> Any:
    """``x`` flattened and cut to ``sharded_tensor.flattened_range`` (unchanged without one)."""
    if sharded_tensor.flattened_range is None:
        return x
    return x.flatten()[sharded_tensor.flattened_range]


def pad_to_expected_shape(x: Any, expected_sharded_ten: ShardedTensor) -> Any:
    """Zero-pads ``x`` at the end of each axis up to the shard's local shape (shrinking raises)."""
    import torch

    pad = []
    for have, want in zip(reversed(x.shape), reversed(tuple(expected_sharded_ten.local_shape))):
        if have > want:
            raise CheckpointingException(
                f"{expected_sharded_ten.key}: stored shape {tuple(x.shape)} exceeds {tuple(expected_sharded_ten.local_shape)}"
            )
        pad.extend([0, want - have])
    return torch.nn.functional.pad(x, pad) if any(pad) else x


def postprocess_numpy_array(loaded_array: Any, sharded_tensor: ShardedTensor, apply_flattened_range: bool = True) -> Any:
    """A loaded numpy array as a torch tensor of the shard's dtype (and flattened range)."""
    import torch

    x = torch.from_numpy(loaded_array).to(sharded_tensor.dtype)
    if x.shape != tuple(sharded_tensor.local_shape) and sharded_tensor.allow_shape_mismatch:
        x = pad_to_expected_shape(x, sharded_tensor)
    return flatten_range(sharded_tensor, x) if apply_flattened_range else x


def load_zarr_based_sharded_metadata(
    checkpoint_dir: Any, get_shape_dtype_fn: Callable[[str], Tuple[Tuple[int, ...], Any]]
) -> Dict[str, Any]:
    """Key -> ShardedTensor without data, for every array of a zarr checkpoint. The arrays are
    listed by the core's reader; ``get_shape_dtype_fn`` is not needed and kept for the signature."""
    del get_shape_dtype_fn
    return _engine.tensors_metadata(checkpoint_dir)


def register_default_zarr_strategies() -> None:
    """Registers reading ``("zarr", 1)``."""
    register_default_strategy(StrategyAction.LOAD_SHARDED, "zarr", 1, ZarrLoadShardedStrategy())
