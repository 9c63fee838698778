"""A load strategy that reads through tessera's native reader, for a named foreign backend."""

from __future__ import annotations

from typing import Any, Dict

from ..mapping import ShardedStateDict, ShardedTensor, StateDict
from .base import LoadShardedStrategy


def _serialization() -> Any:
    from .. import serialization

    return serialization


class NativeLoadShardedStrategy(LoadShardedStrategy):
    """Loads the sharded part of any checkpoint the core reads (it detects the format and
    refuses what it cannot read, so the compatibility checks accept everything)."""

    native_reader = True

    def __init__(self, backend: str = "", version: int = 1) -> None:
        super().__init__()
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> StateDict:
        return _serialization().load(sharded_state_dict, checkpoint_dir, sharded_strategy=self)

    def load_tensors_metadata(self, checkpoint_dir: Any) -> Dict[str, ShardedTensor]:
        return _serialization()._native_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        return _serialization()._native_sharded_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: Any, key_prefix: str) -> Any:
        return _serialization()._native_remove_sharded_tensors(checkpoint_dir, key_prefix)

    def check_backend_compatibility(self, loaded_version: Any) -> None:
        pass

    def check_version_compatibility(self, loaded_version: Any) -> None:
        pass
