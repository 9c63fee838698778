"""Strategies: which backend writes and reads a checkpoint (megatron-core's ``strategies`` package).

``base`` holds the interfaces and the registry of defaults; ``tessera`` the native backend (the
default); ``torch`` Megatron's ``torch_dist`` (read by the core, written by the core's
torch_dist writer); ``common`` the ``torch`` common-state backend; ``fully_parallel`` the
parallel wrappers; ``zarr`` / ``tensorstore`` / ``two_stage`` the zarr readers; ``async_utils``
async requests. Importing the package registers every default strategy.
"""

from . import base, common, fully_parallel, tensorstore, tessera, torch, two_stage, zarr
from .base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    LoadStrategyBase,
    SaveCommonStrategy,
    SaveShardedStrategy,
    SaveStrategyBase,
    StrategyAction,
    _default_strategies,
    default_strategies,
    get_default_strategy,
    register_default_strategy,
)
from .fully_parallel import FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper
from .tessera import (
    TESSERA_BACKEND,
    TESSERA_BACKEND_VERSION,
    TESSERA_READ_VERSIONS,
    TesseraLoadCommonStrategy,
    TesseraLoadShardedStrategy,
    TesseraSaveShardedStrategy,
)

common.register_default_common_strategies()
torch.register_default_torch_strategies()
zarr.register_default_zarr_strategies()
