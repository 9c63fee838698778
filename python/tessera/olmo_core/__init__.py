"""``tessera.olmo_core``: OLMo-core 0.1.x's ``olmo_core.distributed.checkpoint``, name for name.

::

    import sys, tessera.olmo_core
    sys.modules["olmo_core.distributed.checkpoint"] = tessera.olmo_core

is all an OLMo-core user changes. Checkpoints are OLMo-core's own format (each rank's
``rank_{r}.safetensors``, rank 0's ``metadata.json``; ``model/`` and ``optim/`` for
:func:`save_model_and_optim_state`), which ai2-olmo-core itself loads, written and read by
tessera's Rust core: written atomically (``metadata.json`` last, after every rank's file, with
block checksums in each file's header), loaded in place into any layout (FSDP1 with
``use_orig_params=True``, FSDP2, DDP, a plain module; any world size), reading only the bytes
each rank needs, from a directory or ``s3://``. The pickled optimizer fields are decoded by the
core's restricted unpickler, never by ``pickle.loads``.

Differences from ai2-olmo-core 0.1.0, all deliberate:

- loading into a freshly built optimizer leaves the parameters exactly as saved (OLMo-core
  first takes an optimizer step with zero gradients, which applies weight decay to them);
  :func:`init_optimizer_state`, which a save runs on an optimizer without state as OLMo-core's
  does, likewise leaves them unchanged;
- ``model/`` and ``optim/`` are saved as one: both validated before either is written, so a
  failed or interrupted save never leaves a new model beside an old optimizer state;
- ``validate`` needs no NaN prefill: the core proves that every element of every target is
  covered by the checkpoint before reading, and fails naming the key otherwise;
- errors are tessera's typed exceptions (``tessera.errors``), naming the key or file;
- a load into a DDP model finds keys saved without the ``module.`` prefix, and the reverse;
- pickled tuples in parameter groups come back from :func:`unshard_optim_state` as lists, and
  a hyperparameter saved as something other than plain data (a tensor ``lr``) is not unpickled:
  the optimizer keeps its own value, with a warning.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Dict, List, Optional, Tuple, TypedDict

import torch
import torch.nn as nn

from .. import _native
from ..errors import NotFoundError, TesseraError
from .._core.paths import from_native_path
from .._core import io
from .._core.storage import StorageOptions, native_location, split_location
from .._core.layout import is_dtensor
from ._checkpointer import Checkpointer, FlatShard, PathOrStr, _normalize, _olmo_flat, files_created, save_tensors
from ._metadata import OverlapType, StorageMetadata, TensorShardSpec, TensorStorageMetadata

__all__ = [
    "save_model_and_optim_state",
    "load_model_and_optim_state",
    "unshard_model_state",
    "unshard_optim_state",
    "init_optimizer_state",
    "Checkpointer",
    "TensorShardSpec",
    "TensorStorageMetadata",
    "StorageMetadata",
    "OverlapType",
    "OptimStateDict",
    "ParamGroup",
    "PathOrStr",
]


class ParamGroup(TypedDict):
    """A parameter group of an optimizer state dict."""

    params: List[int]
    """Parameter ids."""


class OptimStateDict(TypedDict):
    """An optimizer state dict: per-parameter state by id, and the parameter groups."""

    state: Dict[int, Dict[str, torch.Tensor]]
    param_groups: List[ParamGroup]


# Keys of the flattened optimizer state that are not per-parameter tensors.
_PICKLED = ("state_keys",)
_COUNT = "num_param_groups"


def _state_key(param: str, key: str) -> str:
    return f"state.{param}.__{key}"


def _torch_fsdp() -> Any:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _patch_key(model: nn.Module, key: str) -> str:
    return key.replace("_fsdp_wrapped_module.", "") if isinstance(model, _torch_fsdp()) else key


def _model_state(model: nn.Module) -> Dict[str, Any]:
    """The model's tensors as OLMo-core checkpoints them: a torch FSDP1 model's parameters as
    flat shards of the original parameters (no buffers, as OLMo-core 0.1.0), anything else's
    ``state_dict()`` (DTensors for FSDP2)."""
    if not isinstance(model, _torch_fsdp()):
        state = dict(model.state_dict())
        # OLMo-core's own FSDP: the parameter knows its flat ranges, the state-dict entry does not.
        for name, p in model.named_parameters():
            shard = _olmo_flat(p) if name in state else None
            if shard is not None:
                state[name] = shard
        return state
    from torch.distributed.fsdp._runtime_utils import _lazy_init

    _lazy_init(model, model)  # FSDP's handles exist from here on
    flat: Dict[int, Tuple[Tuple[int, ...], Tuple[Tuple[int, int], ...]]] = {}
    for handle in model._all_handles:
        if not handle.uses_sharded_strategy:
            continue
        if not handle._use_orig_params:
            raise ValueError("checkpointing a torch FSDP model needs use_orig_params=True")
        fp = handle.flat_param
        for p, shape, info in zip(fp._params, fp._shapes, fp._shard_param_infos):
            r = (info.intra_param_start_idx, info.intra_param_end_idx + 1) if info.in_shard else (0, 0)
            flat[id(p)] = (tuple(shape), (r,))
    out: Dict[str, Any] = {}
    for name, p in model.named_parameters():
        data = p.data.detach()
        out[_patch_key(model, name)] = FlatShard(data, *flat[id(p)]) if id(p) in flat else data
    return out


def _local(t: Any) -> torch.Tensor:
    """The rank's own elements of a state-dict entry."""
    if isinstance(t, FlatShard):
        return t.data
    return t.to_local() if is_dtensor(t) else t


def _full_shape(t: Any) -> Tuple[int, ...]:
    return t.full_shape if isinstance(t, FlatShard) else tuple(t.shape)


def _like(param: Any, local: torch.Tensor) -> Any:
    """``local`` (optimizer state of ``param``) laid out as ``param`` is."""
    if isinstance(param, FlatShard):
        return param.like(local)
    if is_dtensor(param):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return local


def _params_by_name(model: nn.Module) -> Dict[nn.Parameter, str]:
    return {p: _patch_key(model, n) for n, p in model.named_parameters()}


def _uint8(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def _flatten_optimizer_state(model: nn.Module, optim: torch.optim.Optimizer, model_state: Dict[str, Any]) -> Dict[str, Any]:
    """OLMo-core's flat optimizer state: ``num_param_groups``, each ``param_group{i}`` (with
    ``_param_names``) and ``state_keys`` pickled into uint8 tensors, and
    ``state.{param}.__{key}`` laid out as the parameter when shaped like it."""
    import pickle

    osd = optim.state_dict()
    names = _params_by_name(model)
    id_to_name: Dict[int, str] = {}
    for group, saved in zip(optim.param_groups, osd["param_groups"]):
        for p, pid in zip(group["params"], saved["params"]):
            id_to_name[pid] = names[p]
    flat: Dict[str, Any] = {_COUNT: torch.tensor(len(osd["param_groups"]))}
    for i, g in enumerate(osd["param_groups"]):
        g = dict(g)
        g["_param_names"] = [id_to_name[pid] for pid in g["params"]]
        # Written for OLMo-core, which unpickles it; tessera reads it without executing anything.
        flat[f"param_group{i}"] = _uint8(pickle.dumps(g))
    keys = set()
    for pid, state in osd["state"].items():
        name = id_to_name[pid]
        param = model_state[name]
        for k, t in state.items():
            if t is None:
                continue
            keys.add(k)
            t = t if isinstance(t, torch.Tensor) else torch.tensor(t)
            key = _state_key(name, k)
            if is_dtensor(t):
                flat[key] = t  # a DTensor (FSDP2) carries its own layout
            elif k != "step" and tuple(t.shape) == tuple(_local(param).shape):
                flat[key] = _like(param, t)  # the rank's part, laid out as its parameter's
            else:
                flat[key] = t.clone()  # whole (step): written once, by the lowest rank holding it
    # Every rank writes the same list (the union): a rank whose shards are all empty has no
    # state of its own. One small all-gather, before anything that can fail on one rank only.
    comm, _ = io.communicator()
    if comm is not None:
        keys = set().union(*(json.loads(m.decode()) for m in comm.all_gather(json.dumps(sorted(keys)).encode())))
    flat["state_keys"] = _uint8(pickle.dumps(sorted(keys)))
    return flat


def _resolve(keys: set, key: str) -> str:
    """The stored key for ``key``: itself, or with DDP's ``module.`` prefix added or removed."""
    if key in keys:
        return key
    alt = key[len("module."):] if key.startswith("module.") else f"module.{key}"
    return alt if alt in keys else key


def init_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """Makes sure the optimizer has state (one step with zero gradients, as OLMo-core does),
    leaving the parameters exactly as they were (their values are kept in host memory across
    the step and put back)."""
    if optim.state:
        return
    with torch.no_grad():
        saved = []
        for group in optim.param_groups:
            for p in group["params"]:
                if p.numel() > 0:
                    p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
                    saved.append((p, p.detach().to("cpu", copy=True)))
        optim.step()
        optim.zero_grad(set_to_none=True)
        for p, before in saved:
            p.copy_(before)


@torch.no_grad()
def save_model_and_optim_state(
    dir: PathOrStr,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    save_overwrite: bool = False,
    *,
    storage_options: StorageOptions = None,
) -> List[PathOrStr]:
    """Saves the model's state to ``dir/model`` and the optimizer's, flattened and keyed by
    parameter name so that it reshards with the parameters, to ``dir/optim``. Every rank calls
    it; returns the files this rank created. Both directories are validated before either is
    written; with ``save_overwrite`` the old ones stay whole until the new ``metadata.json``
    files replace them (a save that fails puts back any it already replaced). An optimizer
    without state gets some first (:func:`init_optimizer_state`: the parameters stay as they
    are), as OLMo-core does, since loading needs every parameter's state."""
    dir, storage_options = split_location(dir, storage_options)
    d = _normalize(dir)
    init_optimizer_state(optim)  # OLMo-core loads every parameter's state: there must be some
    model_state = _model_state(model)
    flat_optim = _flatten_optimizer_state(model, optim, model_state)
    comm, rank = io.communicator()
    model_native, keep_model = save_tensors(model_state, rank)
    optim_native, keep_optim = save_tensors(flat_optim, rank)
    # One save of both directories: both validated before either is touched.
    dirs = [(model_native, native_location(f"{d}/model", storage_options)),
            (optim_native, native_location(f"{d}/optim", storage_options))]
    reports = _native.save_olmo(dirs, comm, overwrite=save_overwrite)
    del keep_model, keep_optim
    return files_created(f"{d}/model", reports[0]) + files_created(f"{d}/optim", reports[1])


def _model_metadata(ck: Checkpointer, d: str, storage_options: StorageOptions) -> StorageMetadata:
    """The metadata of ``d/model``; when ``d`` holds no 0.1.x checkpoint but an OLMo-core 3.x
    one (a DCP directory, or its ``model_and_optim/``), an error that says which module reads it."""
    try:
        return ck.get_metadata(f"{d}/model")
    except NotFoundError as e:
        for where in (d, f"{d}/model_and_optim"):
            try:
                _native.load_tensors_metadata(native_location(where, storage_options))
            except TesseraError:
                continue
            raise NotFoundError(
                f"{e}: {where} is a torch DCP checkpoint, as OLMo-core 3.x writes them; "
                "tessera.olmo_core is OLMo-core 0.1.x's API: load it with tessera.olmo_core.v3 (OLMo-core 3.x's API) "
                "or tessera.torch"
            ) from None
        raise


def _optim_values(dir: str, storage_options: StorageOptions = None) -> Dict[str, Any]:
    """The decoded pickled fields of an ``optim/`` checkpoint (``param_groups``, ``state_keys``)."""
    return {from_native_path(p)[-1][1]: v for p, v in _native.load_common(native_location(dir, storage_options))}


@torch.no_grad()
def load_model_and_optim_state(
    dir: PathOrStr,
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    validate: bool = True,
    *,
    storage_options: StorageOptions = None,
) -> None:
    """Loads the model's and (if given) the optimizer's state in place from a checkpoint of
    :func:`save_model_and_optim_state` (tessera's or OLMo-core's), whatever topology saved it.
    Every element of every target is proven covered before any byte is read (``validate`` is
    always on); a parameter or state missing from the checkpoint raises naming it."""
    del validate
    dir, storage_options = split_location(dir, storage_options)
    d = _normalize(dir)
    ck = Checkpointer(storage_options=storage_options)
    model_state = _model_state(model)
    stored = set(_model_metadata(ck, d, storage_options).tensors)
    ck.load(f"{d}/model", {_resolve(stored, k): v for k, v in model_state.items()})
    if not isinstance(model, _torch_fsdp()):
        # Filled in place; still handed to the module, as OLMo-core does, for entries that are
        # copies of its tensors and for its load hooks.
        model.load_state_dict({k: v.data if isinstance(v, FlatShard) else v for k, v in model_state.items()})
    if optim is None:
        return

    meta = ck.get_metadata(f"{d}/optim").tensors
    values = _optim_values(f"{d}/optim", storage_options)
    groups, state_keys = values["param_groups"], values["state_keys"]
    if len(groups) != len(optim.param_groups):
        raise ValueError(
            f"{d}/optim holds {len(groups)} parameter groups, the optimizer has {len(optim.param_groups)}"
        )
    names = _params_by_name(model)
    saved_names = {n for g in groups for n in g.get("_param_names", [])}
    osd = optim.state_dict()
    targets: Dict[str, Any] = {}
    state: Dict[int, Dict[str, Any]] = {}
    for group, ids in zip(optim.param_groups, osd["param_groups"]):
        for p, pid in zip(group["params"], ids["params"]):
            name = names[p]
            stored_name = _resolve(saved_names, name) if saved_names else name
            if saved_names and stored_name not in saved_names:
                raise KeyError(f"{d}/optim: parameter {name!r} is in no saved parameter group")
            param = model_state[_resolve(set(model_state), name)]
            current = optim.state.get(p, {})
            for k in state_keys:
                key = _state_key(stored_name, k)
                if key not in meta:
                    continue
                m = meta[key]
                cur = current.get(k)
                if k != "step" and tuple(m.shape) == _full_shape(param):
                    local = _local(cur) if isinstance(cur, torch.Tensor) else None
                    want = tuple(_local(param).shape)
                    if local is None or tuple(local.shape) != want or local.dtype != m.torch_dtype:
                        local = torch.empty(want, dtype=m.torch_dtype, device=_local(param).device)
                    target = _like(param, local)
                    value = target.data if isinstance(target, FlatShard) else target
                else:
                    ok = isinstance(cur, torch.Tensor) and tuple(cur.shape) == tuple(m.shape) and cur.dtype == m.torch_dtype
                    target = value = cur if ok else torch.empty(m.shape, dtype=m.torch_dtype)
                targets[key] = target
                state.setdefault(pid, {})[k] = value
    ck.load(f"{d}/optim", targets)
    param_groups = []
    for saved, current in zip(groups, osd["param_groups"]):
        g = {k: v for k, v in saved.items() if k != "_param_names"}
        for k, v in list(g.items()):
            if isinstance(v, dict) and "__class__" in v and k in current:
                # Not plain data (a tensor-valued lr, say): never unpickled, so the optimizer keeps its own.
                warnings.warn(f"{d}/optim: param group {k!r} was saved as {v['__class__']}; keeping the optimizer's value")
                g[k] = current[k]
        for k, v in current.items():
            if isinstance(v, tuple) and isinstance(g.get(k), list):
                g[k] = tuple(g[k])  # pickled tuples (betas) come back as lists
        g["params"] = current["params"]
        param_groups.append(g)
    optim.load_state_dict({"state": state, "param_groups": param_groups})


@torch.no_grad()
def unshard_model_state(
    dir: PathOrStr,
    device: Optional[torch.device] = None,
    rank0_only: bool = False,
    no_dist: bool = False,
    *,
    storage_options: StorageOptions = None,
) -> Dict[str, torch.Tensor]:
    """The full model state of a checkpoint of :func:`save_model_and_optim_state`."""
    dir, storage_options = split_location(dir, storage_options)
    return Checkpointer(storage_options=storage_options).unshard(
        f"{_normalize(dir)}/model", device=device, rank0_only=rank0_only, no_dist=no_dist
    )


@torch.no_grad()
def unshard_optim_state(
    dir: PathOrStr,
    device: Optional[torch.device] = None,
    rank0_only: bool = False,
    no_dist: bool = False,
    *,
    storage_options: StorageOptions = None,
) -> OptimStateDict:
    """The full optimizer state of a checkpoint of :func:`save_model_and_optim_state`, as an
    optimizer state dict (state by parameter id, parameter groups)."""
    dir, storage_options = split_location(dir, storage_options)
    d = f"{_normalize(dir)}/optim"
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank0_only and no_dist and rank != 0:
        raise ValueError(f"calling `unshard()` with `rank0_only=True` and `no_dist=True` is undefined for rank {rank}")
    if rank0_only and rank != 0:
        return {}  # type: ignore[typeddict-item]
    ck = Checkpointer(storage_options=storage_options)
    values = _optim_values(d, storage_options)
    meta = ck.get_metadata(d).tensors
    wanted = {}
    out: OptimStateDict = {"state": {}, "param_groups": []}
    for g in values["param_groups"]:
        g = dict(g)
        for name, pid in zip(g.pop("_param_names", []), g["params"]):
            for k in values["state_keys"]:
                if _state_key(name, k) in meta:
                    wanted[_state_key(name, k)] = (pid, k)
        out["param_groups"].append(g)  # type: ignore[arg-type]
    full = {k: torch.empty(meta[k].shape, dtype=meta[k].torch_dtype) for k in wanted}
    ck.load(d, full, no_dist=True)  # the unshard reads alone, as rank0_only allows
    for key, (pid, k) in wanted.items():
        t = full[key] if device is None else full[key].to(device)
        out["state"].setdefault(pid, {})[k] = t
    return out
