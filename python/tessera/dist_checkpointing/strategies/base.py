"""Strategies base interfaces (megatron-core's ``strategies.base``) and the registry of defaults.

A strategy says which backend (on-disk format) a checkpoint is written in and how. The one a
caller passes to ``save`` / ``load`` is the one called; ``serialization`` runs tessera's native
engine in one commit when the strategy is tessera's own (``strategies.tessera``) and otherwise
follows megatron's protocol (common state, then ``strategy.save`` / ``strategy.load``).
The registry maps ``(action, backend, version)`` to a strategy; every strategy module of this
package registers its defaults when the package is imported. A backend with no registered load
strategy is loaded by the one registered for any backend (:func:`get_load_strategy`): the
native reader's, for the formats the core reads that Megatron has no strategy for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from enum import Enum
from typing import Any, Callable, Dict, Optional, Tuple, Union

from ..core import CheckpointingException
from ..mapping import ShardedStateDict, ShardedTensor, StateDict

__all__ = [
    "StrategyAction",
    "SaveStrategyBase",
    "LoadStrategyBase",
    "SaveShardedStrategy",
    "AsyncSaveShardedStrategy",
    "SaveCommonStrategy",
    "LoadShardedStrategy",
    "LoadCommonStrategy",
    "default_strategies",
    "get_default_strategy",
    "register_default_strategy",
    "get_load_strategy",
    "register_any_backend_load_strategy",
]


class StrategyAction(Enum):
    """Save vs load, sharded vs common."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


class SaveStrategyBase(ABC):
    """A save strategy writes one format (backend) in one version."""

    def __init__(self, backend: str, version: int) -> None:
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy also saves ShardedObjects."""
        return False

    def __str__(self) -> str:
        return f"{self.__class__.__name__}({self.backend}, {self.version})"


class LoadStrategyBase(ABC):
    """A load strategy checks that it can read a checkpoint's backend and version."""

    # Known for tessera's own strategies; Megatron-style subclasses may leave them unset.
    backend: Optional[str] = None
    version: Optional[int] = None

    @abstractmethod
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raises CheckpointingException if this strategy cannot read ``loaded_backend``."""

    @abstractmethod
    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raises CheckpointingException if this strategy cannot read ``loaded_version``."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy also loads ShardedObjects."""
        return False

    def __str__(self) -> str:
        return f"{self.__class__.__name__}({self.backend}, {self.version})"


class SaveShardedStrategy(SaveStrategyBase):
    """Saves the sharded part of a state dict."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        """Saves the sharded part of the state dict."""


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A save strategy that can also save asynchronously."""

    @abstractmethod
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        """Stages the save and returns an ``AsyncRequest`` for the caller to schedule."""

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        """Each async strategy is trivially a sync one: the request, finalized at once."""
        return self.async_save(sharded_state_dict, checkpoint_dir).finalize()


class SaveCommonStrategy(SaveStrategyBase):
    """Saves the common (non-sharded) part of a state dict."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Any) -> None:
        """Saves the common part of the state dict."""

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Any) -> None:
        """Saves ShardedObjects; only strategies that can_handle_sharded_objects implement it."""
        raise NotImplementedError(f"{self} does not save sharded objects")


class LoadShardedStrategy(LoadStrategyBase):
    """Loads the sharded part of a checkpoint."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> StateDict:
        """Loads the sharded part of the checkpoint."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: Any) -> Dict[str, ShardedTensor]:
        """Key -> ShardedTensor without data or sharding (global shape and dtype only)."""

    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        """Key -> metadata of every sharded entry (tensors, and objects where supported)."""
        if not self.can_handle_sharded_objects:
            return self.load_tensors_metadata(checkpoint_dir)
        raise NotImplementedError(f"{self} does not list sharded object metadata")

    def remove_sharded_tensors(self, checkpoint_dir: Any, key_prefix: str) -> Any:
        """Removes every tensor whose key starts with ``key_prefix``."""
        raise NotImplementedError(f"{self} cannot remove tensors from a checkpoint")


class LoadCommonStrategy(LoadStrategyBase):
    """Loads the common (non-sharded) part of a checkpoint."""

    @abstractmethod
    def load_common(self, checkpoint_dir: Any) -> StateDict:
        """Loads the common part of the checkpoint."""

    @abstractmethod
    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        """Loads the ShardedObjects of ``sharded_objects_state_dict``."""

    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        """Metadata of the sharded objects (none unless can_handle_sharded_objects)."""
        if not self.can_handle_sharded_objects:
            return {}
        raise NotImplementedError(f"{self} does not list sharded object metadata")


AnyStrategy = Union[SaveStrategyBase, LoadStrategyBase]

# action value -> (backend, version) -> strategy (megatron's name; ``_default_strategies`` is
# tessera's earlier one, the same dict).
default_strategies: Dict[str, Dict[Tuple[str, int], AnyStrategy]] = defaultdict(dict)
_default_strategies = default_strategies


def register_default_strategy(action: StrategyAction, backend: str, version: int, strategy: AnyStrategy) -> None:
    """Makes ``strategy`` the default for ``action`` on ``(backend, version)``."""
    default_strategies[StrategyAction(action).value][(backend, version)] = strategy


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> AnyStrategy:
    """The default strategy for ``action`` on ``(backend, version)``."""
    action = StrategyAction(action)
    try:
        return default_strategies[action.value][(backend, version)]
    except KeyError:
        known = sorted(default_strategies[action.value])
        raise CheckpointingException(
            f"no default {action.value} strategy for backend {backend!r} version {version}; registered: {known}"
        ) from None


#: action value -> the maker of a load strategy for a ``(backend, version)`` that has no registered
#: default. The native reader's strategies register theirs (``strategies._native_load``): the core
#: reads formats that Megatron has no strategy for (``torch_dcp``, ``olmo_core``, ...), in any
#: version. They are registered, not imported here, because they are built on this module.
_any_backend_load_strategies: Dict[str, Callable[[str, int], LoadStrategyBase]] = {}


def register_any_backend_load_strategy(action: StrategyAction, make: Callable[[str, int], LoadStrategyBase]) -> None:
    """Makes ``make(backend, version)`` the load strategy of ``action`` for backends without a
    registered default (see :func:`get_load_strategy`)."""
    action = StrategyAction(action)
    if action not in (StrategyAction.LOAD_SHARDED, StrategyAction.LOAD_COMMON):
        raise ValueError(f"only load strategies are made for any backend, not {action.value}")
    _any_backend_load_strategies[action.value] = make


def get_load_strategy(action: StrategyAction, backend: str, version: int) -> AnyStrategy:
    """The strategy that loads ``(backend, version)`` for ``action``: the registered default
    (:func:`get_default_strategy`), else the one made for any backend; raises
    CheckpointingException as :func:`get_default_strategy` does when there is neither."""
    try:
        return get_default_strategy(action, backend, version)
    except CheckpointingException:
        make = _any_backend_load_strategies.get(StrategyAction(action).value)
        if make is None:
            raise
        return make(backend, version)
