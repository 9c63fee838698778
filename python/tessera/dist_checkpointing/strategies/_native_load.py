"""Strategies the core runs: a load strategy reading through tessera's native reader (for any
backend it detects: registered as the load strategy of every backend without one of its own)
and the base of the save strategies it writes. Their methods are the package's native engine
(``_engine``), which ``serialization`` runs for them too."""

from __future__ import annotations

from typing import Any, Dict

from .. import _engine
from ..mapping import ShardedStateDict, ShardedTensor, StateDict
from .base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_any_backend_load_strategy,
)


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
        """Same as ``dist_checkpointing.load(sharded_state_dict, checkpoint_dir, self)``."""
        return _engine.load_by_strategy(self, sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: Any, metadata: Any = None) -> Dict[str, ShardedTensor]:
        return _engine.tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        return _engine.sharded_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: Any, key_prefix: str) -> Any:
        return _engine.remove_sharded_tensors(checkpoint_dir, key_prefix)

    def check_backend_compatibility(self, loaded_version: Any) -> None:
        pass  # the core detects the format and refuses what it cannot read

    def check_version_compatibility(self, loaded_version: Any) -> None:
        pass


class NativeSaveShardedStrategy(AsyncSaveShardedStrategy):
    """A save strategy the core writes (``native_writer`` names its writer): its methods are
    ``serialization.save`` with itself as the strategy (the engine's save), which writes the
    whole state in one commit (sharded objects included)."""

    native_writer: str = ""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        """``dist_checkpointing.save(sharded_state_dict, checkpoint_dir, self)`` of the sharded
        part, as Megatron's ``serialization.save`` calls a strategy after its common strategy
        wrote ``common.pt``: a torch_dist save keeps that ``common.pt``."""
        return _engine.save_by_strategy(self, sharded_state_dict, checkpoint_dir, async_save=False)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        """As :meth:`save`, returning the request (``async_sharded_save=True``)."""
        return _engine.save_by_strategy(self, sharded_state_dict, checkpoint_dir, async_save=True)


class NativeLoadCommonStrategy(LoadCommonStrategy):
    """Reads the common state the core keeps in a checkpoint's index, and its sharded objects
    (for any format the core reads; the compatibility checks accept everything)."""

    #: The engine's load takes the common state from the core's load result instead.
    common_from_index = True

    def __init__(self, backend: str = "", version: int = 1) -> None:
        super().__init__()
        self.backend = backend
        self.version = version

    def load_common(self, checkpoint_dir: Any) -> StateDict:
        return _engine.common_state(checkpoint_dir)

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        return _engine.load_sharded_objects(sharded_objects_state_dict, checkpoint_dir)

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


# A format the core reads without a strategy registered for it (torch_dcp, olmo_core, ...).
register_any_backend_load_strategy(StrategyAction.LOAD_SHARDED, NativeLoadShardedStrategy)
register_any_backend_load_strategy(StrategyAction.LOAD_COMMON, NativeLoadCommonStrategy)
