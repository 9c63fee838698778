"""tessera's native backend, ``("tessera", 2)``: the default of this package.

Its strategies carry no algorithm of their own: ``serialization`` recognises them
(``native_writer``) and runs the native engine, which saves the sharded tensors, sharded objects
and common state in one commit and loads any layout. Calling their methods directly runs the
same engine (``_engine``). Format version 2 is written; versions 1 and 2 are read.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ... import _native
from .. import _engine
from ..core import CheckpointingException
from ..mapping import ShardedStateDict, ShardedTensor, StateDict
from ..validation import verify_checkpoint_and_load_strategy
from .base import LoadShardedStrategy, StrategyAction, register_default_strategy
from ._native_load import NativeLoadCommonStrategy, NativeSaveShardedStrategy

__all__ = [
    "TESSERA_BACKEND",
    "TESSERA_BACKEND_VERSION",
    "TESSERA_READ_VERSIONS",
    "TesseraSaveShardedStrategy",
    "TesseraLoadShardedStrategy",
    "TesseraLoadCommonStrategy",
    "register_default_tessera_strategies",
]

TESSERA_BACKEND = "tessera"
#: The format version tessera writes (``tessera._native.FORMAT_VERSION``).
TESSERA_BACKEND_VERSION = 2
#: The format versions tessera reads.
TESSERA_READ_VERSIONS = (1, 2)


def _check_tessera(backend: Any, version: Any, versions: Tuple[int, ...] = (TESSERA_BACKEND_VERSION,)) -> None:
    if backend != TESSERA_BACKEND:
        raise CheckpointingException(f"tessera strategies read and write backend {TESSERA_BACKEND!r}, not {backend!r}")
    if version not in versions:
        handled = ", ".join(str(v) for v in versions)
        raise CheckpointingException(
            f"tessera {TESSERA_BACKEND!r} format version {version} is not supported (this version handles {handled})"
        )


class TesseraSaveShardedStrategy(NativeSaveShardedStrategy):
    """tessera's native save: tensors, objects and common state in one commit.

    ``cached_metadata=True`` (Megatron's name for it; ``--ckpt-assume-constant-structure``)
    keeps this rank's global plan across saves made with this strategy object: a save whose
    structure is unchanged on every rank then skips the plan exchange and validation. Every rank
    of the group must use such a strategy, or none.
    """

    #: serialization runs the native writer for this strategy (see ``serialization.native_writer``).
    native_writer = "tessera"

    def __init__(
        self, backend: str = TESSERA_BACKEND, version: int = TESSERA_BACKEND_VERSION, cached_metadata: bool = False
    ) -> None:
        _check_tessera(backend, version)
        super().__init__(backend, version)
        self.plan_cache = None
        if cached_metadata:
            self.plan_cache = _native.PlanCache()

    @property
    def use_cached_ckpt_structure(self) -> bool:
        """Megatron's switch for reusing the global plan (``--ckpt-assume-constant-structure``)."""
        return self.plan_cache is not None

    @use_cached_ckpt_structure.setter
    def use_cached_ckpt_structure(self, value: bool) -> None:
        if value and self.plan_cache is None:
            self.plan_cache = _native.PlanCache()
        elif not value:
            self.plan_cache = None



class _TesseraReader:
    """What both tessera load strategies share: the backend they read and its checks."""

    # typed as LoadStrategyBase declares them (the strategies below derive from both)
    backend: Optional[str] = TESSERA_BACKEND
    version: Optional[int] = TESSERA_BACKEND_VERSION
    #: serialization runs the native reader for this strategy.
    native_reader = True

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
        return _engine.load_by_strategy(self, sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: Any) -> Dict[str, ShardedTensor]:
        """Same as ``dist_checkpointing.load_tensors_metadata(checkpoint_dir, self)``: the
        checkpoint is checked to be tessera's first."""
        verify_checkpoint_and_load_strategy(checkpoint_dir, self)
        return _engine.tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        """Tensors and objects of the checkpoint, without data (see ``serialization.load_sharded_metadata``)."""
        return _engine.sharded_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: Any, key_prefix: str) -> Any:
        return _engine.remove_sharded_tensors(checkpoint_dir, key_prefix)


class TesseraLoadCommonStrategy(_TesseraReader, NativeLoadCommonStrategy):
    """Reads the common state and sharded objects of a tessera checkpoint."""

    def __init__(self) -> None:
        super().__init__(TESSERA_BACKEND, TESSERA_BACKEND_VERSION)


def register_default_tessera_strategies() -> None:
    """Registers tessera's native strategies: save ``("tessera", 2)``, load versions 1 and 2."""
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, TESSERA_BACKEND, TESSERA_BACKEND_VERSION, TesseraSaveShardedStrategy()
    )
    for version in TESSERA_READ_VERSIONS:
        register_default_strategy(StrategyAction.LOAD_SHARDED, TESSERA_BACKEND, version, TesseraLoadShardedStrategy())
        register_default_strategy(StrategyAction.LOAD_COMMON, TESSERA_BACKEND, version, TesseraLoadCommonStrategy())


register_default_tessera_strategies()
