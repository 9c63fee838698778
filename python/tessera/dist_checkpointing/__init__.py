"""Distributed checkpointing with Megatron-Core's API: ``from tessera import dist_checkpointing``.

Wrap the tensors of a state dict in ``ShardedTensor`` (``mapping``), derive optimizer sharding
from the model's (``optimizer``), and save / load with ``save`` and ``load``: a checkpoint
saved in one parallel layout loads in any other.

The modules import each other without a circle, lowest first: ``core``, ``dict_utils``,
``base`` / ``factories`` / ``mapping``, ``utils``, ``exchange_utils``, ``optimizer`` /
``dist_optimizer``; ``strategies.base``, ``validation``, ``state_dict_utils``,
``strategies.async_utils`` / ``strategies.filesystem_async``; ``_engine`` (the native save and
load of a sharded state dict, through ``tessera._core.io``); the strategies the core runs
(``strategies._native_load`` and those built on it); ``serialization`` (the entry points, which
choose the strategies); ``tensor_aware_state_dict``. torch is optional: the package imports
without it, and what needs it imports it where it is used.
"""

import importlib
import sys

from . import (
    async_utils,
    core,
    dict_utils,
    exchange_utils,
    mapping,
    optimizer,
    serialization,
    state_dict_utils,
    strategies,
    tensor_aware_state_dict,
    utils,
    validation,
)
from .core import (
    CheckpointingConfig,
    CheckpointingException,
    CheckpointingValueError,
    check_is_distributed_checkpoint,
    maybe_load_config,
)
from .dict_utils import (
    dict_list_map_inplace,
    dict_list_map_outplace,
    dict_map,
    dict_map_with_key,
    diff,
    extract_matching_values,
    inspect_types,
    map_reduce,
    merge,
    nested_items_iter,
    nested_values,
)
from .dist_optimizer import BufferLayout, ParamRange, dist_optimizer_sharded_tensors, dist_optimizer_state_dict, dp_shard_range, param_buffer_layout  # noqa: E501
from .._core.dtypes import (
    numpy_dtype_to_tessera,
    tessera_dtype_to_numpy,
    tessera_dtype_to_torch,
    to_tessera_dtype,
    torch_dtype_to_tessera,
)
from .mapping import (
    LocalNonpersistentObject,
    LocalNonpersitentObject,
    ReplicaId,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from .optimizer import (
    get_optim_param_to_id_map,
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)
from .validation import StrictHandling, parse_strict_flag
from .strategies import (
    AsyncSaveShardedStrategy,
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    TesseraLoadCommonStrategy,
    TesseraLoadShardedStrategy,
    TesseraSaveShardedStrategy,
    get_default_strategy,
    register_default_strategy,
)
from .utils import (
    add_prefix_for_sharding,
    apply_prefix_mapping,
    extract_nonpersistent,
    extract_sharded_base,
    extract_sharded_tensors,
    extract_sharded_tensors_and_factories,
    extract_sharded_tensors_or_nonpersistent,
    replace_prefix_for_sharding,
)

from .strategies.async_utils import AsyncCallsQueue, AsyncRequest, AsyncSaver
from .serialization import *  # noqa: F401,F403

#: Megatron-Core 0.16.1's ``dist_checkpointing`` modules, each mirrored here under the same path.
MEGATRON_MODULES = (
    "core", "dict_utils", "exchange_utils", "mapping", "optimizer", "serialization", "state_dict_utils",
    "tensor_aware_state_dict", "utils", "validation", "strategies", "strategies.async_utils", "strategies.base",
    "strategies.cached_metadata_filesystem_reader", "strategies.checkpointable", "strategies.common",
    "strategies.filesystem_async", "strategies.fully_parallel", "strategies.state_dict_saver",
    "strategies.torch", "strategies.tensorstore", "strategies.two_stage", "strategies.zarr",
)


def install_as_megatron(prefix: str = "megatron.core.dist_checkpointing") -> None:
    """Makes ``megatron.core.dist_checkpointing`` and each of its modules *be* tessera's, by a
    plain ``sys.modules`` alias: call it before importing ``megatron.core``, and Megatron-LM
    (``megatron.core``, ``megatron.core.optimizer``, ``megatron.training.checkpointing``) then
    saves and loads through tessera unchanged. ``strategies.checkpointable`` needs torch >= 2.6
    and is aliased only where it imports."""
    sys.modules[prefix] = sys.modules[__name__]
    for name in MEGATRON_MODULES:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ImportError:
            if name == "strategies.checkpointable":
                continue
            raise
        sys.modules[f"{prefix}.{name}"] = module
