"""Megatron's ``torch_dist`` backend (megatron-core's ``strategies.torch``), run by tessera's core.

Reading a ``torch_dist`` checkpoint is the native reader's job (it parses the DCP ``.metadata``
and reads the ``.distcp`` files in any layout). Writing one goes through a single place,
the package's native engine (``_engine.save``): the core plans the save from the same tensor
and object descriptors as ``tessera._native.save`` plus the ``common.pt`` bytes, megatron's
``FileSystemWriterAsync.write_preloaded_data`` writes each of a rank's ``thread_count`` files
(``strategies.filesystem_async``), and the core commits. ``save`` without a strategy writes
tessera's native format; ``torch_dist`` is written when asked for (by name, or by Megatron's
``get_default_save_sharded_strategy()``, whose default it is).

The DCP planner classes are megatron's names, kept so that code importing them runs; tessera
does not plan through torch.distributed.checkpoint.
"""

from __future__ import annotations

from typing import Any, Optional

from .base import StrategyAction, register_default_strategy
from ._native_load import NativeLoadShardedStrategy, NativeSaveShardedStrategy

__all__ = [
    "TorchDistSaveShardedStrategy",
    "TorchDistLoadShardedStrategy",
    "MCoreLoadPlanner",
    "MCoreSavePlanner",
    "MCoreMetadata",
    "MCoreSavePlan",
    "register_default_torch_strategies",
]

MSC_PREFIX = "msc://"
_metadata_fn = ".metadata"


class MCoreMetadata:
    """Megatron's placeholder class (unpickling of old checkpoints refers to it)."""


class MCoreSavePlan:
    """Megatron's placeholder class (unpickling of old checkpoints refers to it)."""


try:
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
except ImportError:  # pragma: no cover - torch without distributed checkpoint
    DefaultLoadPlanner = DefaultSavePlanner = object  # type: ignore[misc,assignment]


class MCoreSavePlanner(DefaultSavePlanner):  # type: ignore[misc,valid-type]
    """Megatron's DCP save planner, by name. tessera plans saves in its core; this is torch's
    DefaultSavePlanner for code that builds one to pass to torch.distributed.checkpoint itself."""

    def __init__(self, *args: Any, nd_flattened_global_shapes: Any = None, can_run_decentralized_global_plan: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nd_flattened_global_shapes = nd_flattened_global_shapes or {}
        self.can_run_decentralized_global_plan = can_run_decentralized_global_plan


class MCoreLoadPlanner(DefaultLoadPlanner):  # type: ignore[misc,valid-type]
    """Megatron's DCP load planner, by name. tessera plans loads in its core; this is torch's
    DefaultLoadPlanner for code that builds one to pass to torch.distributed.checkpoint itself."""

    def __init__(self, *args: Any, shapes_validation_sharded_tensors: Any = (), allow_shape_mismatch_sharded_tensors: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shapes_validation_sharded_tensors = shapes_validation_sharded_tensors
        self.allow_shape_mismatch_sharded_tensors = allow_shape_mismatch_sharded_tensors


class TorchDistSaveShardedStrategy(NativeSaveShardedStrategy):
    """Writes a ``torch_dist`` checkpoint with the core's writer (the engine's ``torch_dist`` save).

    ``thread_count`` and ``separation_hint`` shape megatron's file layout and are kept as
    attributes; ``cached_metadata`` / ``use_cached_ckpt_structure`` reuse the global plan as
    tessera's strategy does.
    """

    #: serialization writes this strategy's checkpoints with the core's torch_dist writer.
    native_writer = "torch_dist"

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        keep_only_main_replica: bool = True,
        thread_count: int = 2,
        cached_metadata: bool = False,
        separation_hint: Optional[str] = None,
    ) -> None:
        super().__init__(backend, version)
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = thread_count
        self.separation_hint = separation_hint
        self.use_cached_ckpt_structure = cached_metadata
        self.cached_global_metadata: Any = None
        self.validated_cache_reuse = False
        self.validated_loaded_metadata_reuse = False
        self.plan_cache: Any = None



class TorchDistLoadShardedStrategy(NativeLoadShardedStrategy):
    """Reads a ``torch_dist`` checkpoint (or any format the core reads) with the native reader."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1)
        self.cached_global_metadata: Any = None


def register_default_torch_strategies() -> None:
    """Registers the ``("torch_dist", 1)`` strategies."""
    register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, TorchDistLoadShardedStrategy())
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, "torch_dist", 1, TorchDistSaveShardedStrategy("torch_dist", 1)
    )
