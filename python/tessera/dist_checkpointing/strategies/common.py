"""Common (non-sharded) state in megatron's ``torch`` common backend (megatron-core's
``strategies.common``).

tessera's native checkpoints keep the common state in their own index (``strategies.tessera``).
These strategies serve the others: a Megatron checkpoint's ``common.pt`` is read through the
core (``tessera._native.read_file``) and unpickled with ``torch.load(weights_only=True)``, as
Megatron loads it; and when a caller saves with a sharded strategy of their own (not one the
native engine runs), the common state goes to ``common.pt`` as Megatron writes it.

torch is imported by the saves, which ``torch.save``: reading and the package work without it.
"""

from __future__ import annotations

import os
from typing import Any, Union

from ... import _native
from ..._core.comm import initialized_dist
from ..._core.storage import native_location
from ..._core.values import torch_load_bytes
from ..core import COMMON_STATE_FNAME
from ..dict_utils import nested_values
from ..mapping import ShardedStateDict, StateDict, is_main_replica
from ._native_load import NativeLoadCommonStrategy
from .base import SaveCommonStrategy, StrategyAction, register_default_strategy

__all__ = [
    "COMMON_STATE_FNAME",
    "TorchCommonSaveStrategy",
    "TorchCommonLoadStrategy",
    "register_default_common_strategies",
]


def _rank() -> int:
    dist = initialized_dist()
    return 0 if dist is None else dist.get_rank()


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Writes the common state to ``<checkpoint_dir>/common.pt`` (``torch.save``, rank 0), for
    checkpoints whose sharded part a caller's own strategy writes."""

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Union[str, "os.PathLike[str]"]) -> None:
        if _rank() == 0:
            import torch

            os.makedirs(checkpoint_dir, exist_ok=True)
            torch.save(common_state_dict, os.path.join(os.fspath(checkpoint_dir), COMMON_STATE_FNAME))

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Any) -> None:
        """Each main-replica object to ``<checkpoint_dir>/<unique_key>.pt``, as Megatron does."""
        import torch

        for obj in nested_values(sharded_objects_state_dict):
            if is_main_replica(obj.replica_id):
                path = os.path.join(os.fspath(checkpoint_dir), obj.unique_key + ".pt")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save(obj.data, path)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


class TorchCommonLoadStrategy(NativeLoadCommonStrategy):
    """Reads ``common.pt`` (through the core, then ``torch.load(weights_only=True)``, as
    Megatron loads it) and the checkpoint's sharded objects (through the native reader, which
    knows every format tessera reads). Without ``common.pt`` (a save that kept it elsewhere),
    the common state the core reads from the checkpoint."""

    common_from_index = False

    def __init__(self) -> None:
        super().__init__("torch", 1)

    def load_common(self, checkpoint_dir: Any) -> StateDict:
        data = _native.read_file(native_location(checkpoint_dir), COMMON_STATE_FNAME)
        return super().load_common(checkpoint_dir) if data is None else torch_load_bytes(data)


def register_default_common_strategies() -> None:
    """Registers the ``("torch", 1)`` common strategies."""
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, TorchCommonLoadStrategy())
    register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, TorchCommonSaveStrategy("torch", 1))


