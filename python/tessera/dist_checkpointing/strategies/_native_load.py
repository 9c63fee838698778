"""Strategies the core runs: a load strategy reading through tessera's native reader (for any
backend it detects) and the base of the save strategies it writes."""

from __future__ import annotations

from typing import Any, Dict

from ..._core.storage import native_location
from ..mapping import ShardedStateDict, ShardedTensor, StateDict
from .base import AsyncSaveShardedStrategy, LoadCommonStrategy, LoadShardedStrategy


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

    def load_tensors_metadata(self, checkpoint_dir: Any, metadata: Any = None) -> Dict[str, ShardedTensor]:
        return _serialization()._native_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        return _serialization()._native_sharded_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: Any, key_prefix: str) -> Any:
        return _serialization()._native_remove_sharded_tensors(checkpoint_dir, key_prefix)

    def check_backend_compatibility(self, loaded_version: Any) -> None:
        pass  # the core detects the format and refuses what it cannot read

    def check_version_compatibility(self, loaded_version: Any) -> None:
        pass


class NativeSaveShardedStrategy(AsyncSaveShardedStrategy):
    """A save strategy the core writes (``native_writer`` names its writer): its methods are
    ``serialization.save`` with itself as the strategy, which writes the whole state in one
    commit (sharded objects included)."""

    native_writer: str = ""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        """``dist_checkpointing.save(sharded_state_dict, checkpoint_dir, self)`` of the sharded
        part, as Megatron's ``serialization.save`` calls a strategy after its common strategy
        wrote ``common.pt``: a torch_dist save keeps that ``common.pt``."""
        return _serialization().save(sharded_state_dict, checkpoint_dir, sharded_strategy=self, _sharded_part_only=True)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        """As :meth:`save`, returning the request (``async_sharded_save=True``)."""
        return _serialization().save(
            sharded_state_dict, checkpoint_dir, sharded_strategy=self, async_sharded_save=True, _sharded_part_only=True
        )


class NativeLoadCommonStrategy(LoadCommonStrategy):
    """Reads the common state the core keeps in a checkpoint's index, and its sharded objects
    (for any format the core reads; the compatibility checks accept everything)."""

    #: serialization.load takes the common state from the core's load result instead.
    common_from_index = True

    def __init__(self, backend: str = "", version: int = 1) -> None:
        super().__init__()
        self.backend = backend
        self.version = version

    def load_common(self, checkpoint_dir: Any) -> StateDict:
        ser = _serialization()
        return ser._common_from_native(ser._native.load_common(native_location(checkpoint_dir)))

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        return _serialization().load_sharded_objects(sharded_objects_state_dict, checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        """Objects are listed with the tensors by the sharded strategy: nothing extra here."""
        return {}

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: Any) -> None:
        pass  # the core detects the format and refuses what it cannot read

    def check_version_compatibility(self, loaded_version: Any) -> None:
        pass
