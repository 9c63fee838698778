"""Sharding of optimizer states derived from the sharding of the model parameters.

Optimizer state is keyed by parameter ids that only mean something inside one process; these
helpers re-key each state tensor by its parameter's global key (``optimizer.state.<state
key>.<param key>``), with the parameter's sharding, so it can be loaded in any layout.
"""

from __future__ import annotations

import logging
from copy import deepcopy
from dataclasses import replace
from typing import Any, Dict, Iterable, Tuple, Union

from .core import CheckpointingException, CheckpointingValueError
from .dict_utils import nested_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    is_main_replica,
)
from .utils import extract_sharded_tensors_and_factories

__all__ = [
    "KEEP_VARS_HINT",
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
]

logger = logging.getLogger(__name__)

#: Appended by Megatron-Core (``megatron.core.optimizer``) to errors about parameters it cannot map.
KEEP_VARS_HINT = (
    " Make sure state dict contains original torch.nn.Parameters (not pure torch.Tensors)"
    " by passing `keep_vars=True` to `.state_dict()`. If any transformation of the original"
    " parameter is needed, use a ShardedTensorFactory."
)

ShardedParam = Union[ShardedTensor, ShardedTensorFactory]


def get_optim_param_to_id_map(optim_params_iter: Iterable[Any]) -> Dict[int, int]:
    """``id(param)`` -> position of the parameter in the optimizer's iteration order, which is
    the id torch.optim uses in its state dict."""
    param_to_id: Dict[int, int] = {}
    for index, param in enumerate(optim_params_iter):
        param_to_id.setdefault(id(param), index)
    return param_to_id


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[Any]
) -> Dict[int, ShardedParam]:
    """Optimizer param id -> the model's ShardedTensor/ShardedTensorFactory of that param.

    The model sharded state dict must hold the parameters themselves as data (build it from
    ``model.state_dict(keep_vars=True)``), since params are matched by identity.
    """
    sharded_params, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    param_to_id = get_optim_param_to_id_map(optim_params_iter)
    id_to_sharded_param: Dict[int, ShardedParam] = {}
    for sharded_param in nested_values(sharded_params):
        param_id = param_to_id.get(id(sharded_param.data))
        if param_id is None:
            logger.debug("%s is not tracked by the optimizer", sharded_param)
        else:
            id_to_sharded_param[param_id] = sharded_param
    if not id_to_sharded_param:
        logger.warning(
            "no model sharded tensor matches an optimizer parameter; build the model state dict "
            "with state_dict(keep_vars=True) so that the tensors are the parameters themselves"
        )
    return id_to_sharded_param


def make_sharded_optimizer_tensor(model_param: ShardedParam, optim_param: Any, prefix: str) -> ShardedParam:
    """The optimizer state ``optim_param`` sharded like ``model_param``, keyed
    ``f"{prefix}.{model_param.key}"``."""
    key = f"{prefix}.{model_param.key}"
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=key, data=optim_param)
    shape = tuple(optim_param.shape)
    if model_param.flattened_range is None:
        if shape != model_param.local_shape:
            raise CheckpointingException(
                f"{key!r}: optimizer state shape {shape} does not match the model param's local shape "
                f"{model_param.local_shape}"
            )
    else:
        expected = model_param.flattened_range.stop - model_param.flattened_range.start
        if shape != (expected,):
            raise CheckpointingException(
                f"{key!r}: optimizer state shape {shape} does not match the model param's flattened range "
                f"{model_param.flattened_range} ({expected} elements)"
            )
    return replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype)


def _make_sharded_optimizer_scalar(model_param: ShardedTensor, value: Any, prefix: str) -> ShardedTensor:
    """A per-parameter scalar state (AdamW's ``step``) as one replicated 0-dim tensor.

    Every shard of a parameter holds the same scalar, so it is saved once (by the main replica
    of the parameter's first chunk) and every layout loads it back whole.
    """
    first_chunk = all(off == 0 for off in model_param.global_offset) and (
        model_param.flattened_range is None or model_param.flattened_range.start == 0
    )
    saved_here = is_main_replica(model_param.replica_id) and first_chunk
    return ShardedTensor(
        key=f"{prefix}.{model_param.key}",
        data=value,
        dtype=value.dtype,
        local_shape=(),
        global_shape=(),
        global_offset=(),
        axis_fragmentations=(),
        replica_id=0 if saved_here else 1,
    )


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def optim_state_to_sharding_state(
    optim_state_dict: StateDict,
    id_to_sharded_param_map: Dict[int, ShardedParam],
    exclude_keys: Tuple[str, ...] = (),
) -> None:
    """Turns a torch.optim state dict into a sharded state dict, in place.

    Each tensor in ``optim_state_dict["state"][param_id]`` becomes a ShardedTensor keyed
    ``optimizer.state.<state key>.<param key>`` with the param's sharding (a separate global
    tensor per state key, e.g. ``exp_avg`` and ``exp_avg_sq`` for Adam). 0-dim states of
    non-scalar params (``step``) become one replicated scalar per param; other non-tensor
    values stay plain. ``param_groups`` stay common state, with their ``params`` id lists kept
    local (LocalNonpersistentObject), since ids are process-specific. States named in
    ``exclude_keys`` are dropped.
    """
    sharded_state: Dict[Any, Dict[str, Any]] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        sharded_state[param_id] = {}
        for state_key, value in param_state.items():
            if state_key in exclude_keys:
                continue
            model_param = id_to_sharded_param_map.get(param_id)
            if model_param is None:
                raise CheckpointingValueError(
                    f"optimizer param id {param_id} (state {state_key!r}) does not match any model sharded param"
                )
            prefix = f"optimizer.state.{state_key}"
            if not _is_array(value):
                sharded_state[param_id][state_key] = value
            elif (
                isinstance(model_param, ShardedTensor)
                and tuple(value.shape) == ()
                and (model_param.local_shape != () or model_param.flattened_range is not None)
            ):
                sharded_state[param_id][state_key] = _make_sharded_optimizer_scalar(model_param, value, prefix)
            elif isinstance(model_param, ShardedTensorFactory) and _is_array(model_param.data) and (
                tuple(value.shape) != tuple(model_param.data.shape)
            ):
                # The factory would build from a tensor of the wrong shape and fail obscurely.
                raise CheckpointingException(
                    f"optimizer state {state_key!r} of param {model_param.key!r} has shape {tuple(value.shape)}, "
                    f"the factory's tensor {tuple(model_param.data.shape)}; pass exclude_keys=({state_key!r},) "
                    "or shard it yourself"
                )
            else:
                sharded_state[param_id][state_key] = make_sharded_optimizer_tensor(model_param, value, prefix)
    optim_state_dict["param_groups"] = deepcopy(optim_state_dict["param_groups"])
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])
    optim_state_dict["state"] = sharded_state
