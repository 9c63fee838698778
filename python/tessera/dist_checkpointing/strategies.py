"""Strategies: which backend writes and reads a checkpoint, with a registry of defaults.

The interfaces mirror Megatron-Core's ``strategies.base``. tessera has one native backend,
``"tessera"``, written in format version 2 (``("tessera", 2)``) and read in versions 1 and 2,
which saves the sharded tensors, sharded objects and common state in a single commit; its strategy classes carry no algorithm of their own: ``serialization``
recognises them and runs the native engine, and calling their methods directly goes through the
same entry points.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from enum import Enum
from types import ModuleType
from typing import Any, Dict, Optional, Tuple, Union

from .core import CheckpointingException
from .mapping import ShardedStateDict, ShardedTensor, StateDict

__all__ = [
    "StrategyAction",
    "SaveStrategyBase",
    "LoadStrategyBase",
    "SaveShardedStrategy",
    "AsyncSaveShardedStrategy",
    "FullyParallelSaveStrategyWrapper",
    "FullyParallelLoadStrategyWrapper",
    "SaveCommonStrategy",
    "LoadShardedStrategy",
    "LoadCommonStrategy",
    "TesseraSaveShardedStrategy",
    "TesseraLoadShardedStrategy",
    "TesseraLoadCommonStrategy",
    "TESSERA_BACKEND",
    "TESSERA_BACKEND_VERSION",
    "TESSERA_READ_VERSIONS",
    "get_default_strategy",
    "register_default_strategy",
]

TESSERA_BACKEND = "tessera"
#: The format version tessera writes (``tessera._native.FORMAT_VERSION``).
TESSERA_BACKEND_VERSION = 2
#: The format versions tessera reads.
TESSERA_READ_VERSIONS = (1, 2)


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


def _serialization() -> ModuleType:
    """The entry points, imported late: they need the native extension, this module does not."""
    try:
        from . import serialization
    except ImportError as e:
        raise ImportError(
            "running a tessera strategy needs tessera's native extension (tessera._native); build and "
            "install the package (`pip install .` or `maturin develop`)"
        ) from e
    return serialization


def _check_tessera(backend: Any, version: Any, versions: Tuple[int, ...] = (TESSERA_BACKEND_VERSION,)) -> None:
    if backend != TESSERA_BACKEND:
        raise CheckpointingException(f"tessera strategies read and write backend {TESSERA_BACKEND!r}, not {backend!r}")
    if version not in versions:
        handled = ", ".join(str(v) for v in versions)
        raise CheckpointingException(
            f"tessera {TESSERA_BACKEND!r} format version {version} is not supported (this version handles {handled})"
        )


class TesseraSaveShardedStrategy(AsyncSaveShardedStrategy):
    """tessera's native save: tensors, objects and common state in one commit.

    ``cached_metadata=True`` (Megatron's name for it; ``--ckpt-assume-constant-structure``)
    keeps this rank's global plan across saves made with this strategy object: a save whose
    structure is unchanged on every rank then skips the plan exchange and validation. Every rank
    of the group must use such a strategy, or none.
    """

    def __init__(
        self, backend: str = TESSERA_BACKEND, version: int = TESSERA_BACKEND_VERSION, cached_metadata: bool = False
    ) -> None:
        _check_tessera(backend, version)
        super().__init__(backend, version)
        self.plan_cache = None
        if cached_metadata:
            from tessera import _native

            self.plan_cache = _native.PlanCache()

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        """Same as ``dist_checkpointing.save(sharded_state_dict, checkpoint_dir, self)``."""
        return _serialization().save(sharded_state_dict, checkpoint_dir, sharded_strategy=self)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        """Same as ``dist_checkpointing.save(..., self, async_sharded_save=True)``."""
        return _serialization().save(sharded_state_dict, checkpoint_dir, sharded_strategy=self, async_sharded_save=True)


class _TesseraReader:
    """What both tessera load strategies share: the backend they read and its checks."""

    backend = TESSERA_BACKEND
    version = TESSERA_BACKEND_VERSION

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        _check_tessera(loaded_backend, self.version)

    def check_version_compatibility(self, loaded_version: int) -> None:
        _check_tessera(self.backend, loaded_version, TESSERA_READ_VERSIONS)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


class TesseraLoadShardedStrategy(_TesseraReader, LoadShardedStrategy):
    """tessera's native load, into any layout."""

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> StateDict:
        """Same as ``dist_checkpointing.load(sharded_state_dict, checkpoint_dir, self)``."""
        return _serialization().load(sharded_state_dict, checkpoint_dir, sharded_strategy=self)

    def load_tensors_metadata(self, checkpoint_dir: Any) -> Dict[str, ShardedTensor]:
        return _serialization().load_tensors_metadata(checkpoint_dir, self)

    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        """Tensor metadata; the index does not describe object shards beyond their keys, so
        objects are loaded through a sharded state dict that names them."""
        return self.load_tensors_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: Any, key_prefix: str) -> Any:
        return _serialization().remove_sharded_tensors(checkpoint_dir, key_prefix)


class TesseraLoadCommonStrategy(_TesseraReader, LoadCommonStrategy):
    """Reads the common state and sharded objects of a tessera checkpoint."""

    def load_common(self, checkpoint_dir: Any) -> StateDict:
        return _serialization().load_common_state_dict(checkpoint_dir)

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        return _serialization().load_sharded_objects(sharded_objects_state_dict, checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        """Objects are listed with the tensors by the sharded strategy: nothing extra here."""
        return {}


AnyStrategy = Union[SaveStrategyBase, LoadStrategyBase]

# action value -> (backend, version) -> strategy
_default_strategies: Dict[str, Dict[Tuple[str, int], AnyStrategy]] = defaultdict(dict)


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Megatron's fully-parallel save wrapper. tessera's saves are always fully parallel: each
    chunk replicated over data-parallel ranks is written by one of the replicas holding it,
    chosen by a balanced assignment every rank computes alike (no extra exchange). The wrapper
    lets Megatron code run unchanged; ``parallelization_group`` and
    ``do_cache_distribution`` are accepted and not needed."""

    def __init__(
        self, strategy: SaveShardedStrategy, parallelization_group: Any = None, do_cache_distribution: bool = False
    ) -> None:
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        return _serialization().save(
            sharded_state_dict, checkpoint_dir, sharded_strategy=self.base_strategy, async_sharded_save=True
        )

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> Any:
        return _serialization().save(sharded_state_dict, checkpoint_dir, sharded_strategy=self.base_strategy)


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """Megatron's fully-parallel load wrapper: the load becomes collective over
    ``parallelization_group`` (default: the default group), and each byte range needed by
    several of its ranks is read from storage once and sent to the others."""

    exchange_reads = True

    def __init__(
        self,
        strategy: LoadShardedStrategy,
        parallelization_group: Any = None,
        do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
    ) -> None:
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
        self.backend = getattr(strategy, "backend", None)
        self.version = getattr(strategy, "version", None)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.base_strategy.check_version_compatibility(loaded_version)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> StateDict:
        return _serialization().load(sharded_state_dict, checkpoint_dir, sharded_strategy=self)

    def load_tensors_metadata(self, checkpoint_dir: Any) -> Dict[str, ShardedTensor]:
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)


def register_default_strategy(action: StrategyAction, backend: str, version: int, strategy: AnyStrategy) -> None:
    """Makes ``strategy`` the default for ``action`` on ``(backend, version)``."""
    _default_strategies[StrategyAction(action).value][(backend, version)] = strategy


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> AnyStrategy:
    """The default strategy for ``action`` on ``(backend, version)``."""
    action = StrategyAction(action)
    try:
        return _default_strategies[action.value][(backend, version)]
    except KeyError:
        known = sorted(_default_strategies[action.value])
        raise CheckpointingException(
            f"no default {action.value} strategy for backend {backend!r} version {version}; registered: {known}"
        ) from None


register_default_strategy(
    StrategyAction.SAVE_SHARDED, TESSERA_BACKEND, TESSERA_BACKEND_VERSION, TesseraSaveShardedStrategy()
)
for _version in TESSERA_READ_VERSIONS:
    register_default_strategy(StrategyAction.LOAD_SHARDED, TESSERA_BACKEND, _version, TesseraLoadShardedStrategy())
    register_default_strategy(StrategyAction.LOAD_COMMON, TESSERA_BACKEND, _version, TesseraLoadCommonStrategy())
