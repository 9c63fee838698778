"""`tessera.torch`: checkpoints of torch state dicts holding plain tensors and DTensors.

Sharding is derived from each DTensor's mesh and placements (``Shard`` and ``Replicate``, uneven
shards included); replicated copies are written once. Loading is in place, into whatever
layout the given state dict has: another mesh, another world size, or one process.
The model/optimizer helpers follow OLMo-core's `save_model_and_optim_state` /
`load_model_and_optim_state`, and work for FSDP2 (``fully_shard``) and plain modules.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from . import _native
from ._comm import default_comm
from .dist_checkpointing.mapping import tessera_dtype_to_torch, torch_dtype_to_tessera
from .dist_checkpointing.serialization import _cpu_contiguous, _from_native_path, _from_plain, _leaves, _set_path, _to_native_path, _to_plain

__all__ = [
    "save",
    "load",
    "get_metadata",
    "unshard",
    "save_model_and_optim_state",
    "load_model_and_optim_state",
    "unshard_model_state",
    "unshard_optim_state",
]


def _key(path: Tuple[Any, ...]) -> str:
    return ".".join(str(seg) for _, seg in path)


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def _layout(t: torch.Tensor, rank: int) -> Tuple[torch.Tensor, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """(local tensor, global shape, global offset, replica id) of a tensor or DTensor."""
    if not _is_dtensor(t):
        return t, tuple(t.shape), (0,) * t.dim(), (rank,)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if p.is_partial():
            raise ValueError("a DTensor with a Partial placement holds no defined values; redistribute it first")
        if not (p.is_shard() or p.is_replicate()) or type(p).__name__ == "_StridedShard":
            raise ValueError(f"unsupported DTensor placement {p!r} (supported: Shard, Replicate)")
    local = t.to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"DTensor local shape {tuple(local.shape)} differs from its placement's {tuple(shape)}")
    coord = t.device_mesh.get_coordinate() or []
    replica = tuple(int(coord[i]) for i, p in enumerate(t.placements) if p.is_replicate()) or (0,)
    return local, tuple(t.shape), tuple(int(x) for x in offset), replica


def _split(state_dict: Dict[str, Any]) -> Tuple[List[Tuple[Tuple[Any, ...], torch.Tensor]], List[Tuple[Tuple[Any, ...], Any]]]:
    tensors, values = [], []
    for path, leaf in _leaves(state_dict):
        (tensors if isinstance(leaf, torch.Tensor) else values).append((path, leaf))
    return tensors, values


def save(
    state_dict: Dict[str, Any],
    dir: Any,
    *,
    process_group: Any = None,
    overwrite: bool = False,
    content_metadata: Optional[dict] = None,
) -> dict:
    """Saves a (nested) state dict; under torch.distributed every rank calls it. Tensor keys are
    the dotted paths; other values are saved once, from rank 0."""
    comm = default_comm(process_group)
    rank = comm.rank() if comm is not None else 0
    tensors, values = _split(state_dict)
    keep_alive = []
    native = []
    for path, t in tensors:
        local, shape, offset, replica = _layout(t, rank)
        data = _cpu_contiguous(local)
        keep_alive.append(data)
        native.append(
            (_key(path), torch_dtype_to_tessera(t.dtype), tuple(data.shape), shape, offset, 0, replica, None, None,
             data.data_ptr(), data.numel() * data.element_size())
        )
    common = [(_to_native_path(p), _to_plain(v)) for p, v in values] if rank == 0 else []
    meta = _to_plain(content_metadata) if content_metadata is not None else None
    report = _native.save(native, [], common, str(dir), comm, overwrite=overwrite, content_metadata=meta)
    del keep_alive
    return report


def load(state_dict: Dict[str, Any], dir: Any, *, process_group: Any = None, strict: bool = True) -> None:
    """Loads in place: every tensor (or DTensor shard) of ``state_dict`` is filled from the
    checkpoint, whatever layout it was saved in; other values are replaced by the saved ones.
    With ``strict``, a tensor missing from the checkpoint raises KeyMismatchError."""
    tensors, values = _split(state_dict)
    targets = []
    native = []
    for path, t in tensors:
        local, shape, offset, _ = _layout(t, 0)
        buf = local if (local.device.type == "cpu" and local.is_contiguous()) else torch.empty(
            local.shape, dtype=local.dtype
        )
        targets.append((local, buf))
        native.append(
            (_key(path), torch_dtype_to_tessera(t.dtype), tuple(local.shape), shape, offset, 0, None, False,
             buf.data_ptr(), buf.numel() * buf.element_size())
        )
    strict_mode = "raise_unexpected" if strict else "return_unexpected"
    result = _native.load(native, [], str(dir), None, strict=strict_mode)
    with torch.no_grad():
        for (local, buf), loaded in zip(targets, result["loaded"]):
            if loaded and buf is not local:
                local.copy_(buf)
    saved = {_from_native_path(p): _from_plain(v) for p, v in result["common"]}
    for path, _ in values:
        if path in saved:
            _set_path(state_dict, path, saved[path])


def get_metadata(dir: Any) -> Dict[str, Dict[str, Any]]:
    """Key → ``{"dtype": torch.dtype, "shape": tuple}`` of every stored tensor."""
    return {
        k: {"dtype": tessera_dtype_to_torch(d), "shape": tuple(s)}
        for k, (d, s) in _native.load_tensors_metadata(str(dir)).items()
    }


def _not_rank0(rank0_only: bool, no_dist: bool) -> bool:
    """With ``rank0_only``, ranks other than 0 of an initialized process group get nothing."""
    if not rank0_only or no_dist:
        return False
    comm = default_comm()
    return comm is not None and comm.rank() != 0


def unshard(
    dir: Any,
    keys: Optional[Iterable[str]] = None,
    *,
    device: Any = None,
    rank0_only: bool = False,
    no_dist: bool = False,
) -> Dict[str, torch.Tensor]:
    """Full tensors (all, or ``keys``) read straight from the checkpoint; no communication.
    With ``rank0_only`` other ranks of an initialized process group get ``{}``."""
    if _not_rank0(rank0_only, no_dist):
        return {}
    meta = get_metadata(dir)
    wanted = list(meta) if keys is None else list(keys)
    out = {k: torch.empty(meta[k]["shape"], dtype=meta[k]["dtype"]) for k in wanted if k in meta}
    missing = [k for k in wanted if k not in meta]
    if missing:
        raise KeyError(f"not in the checkpoint: {missing}")
    native = [
        (k, torch_dtype_to_tessera(t.dtype), tuple(t.shape), tuple(t.shape), (0,) * t.dim(), 0, None, False,
         t.data_ptr(), t.numel() * t.element_size())
        for k, t in out.items()
    ]
    _native.load(native, [], str(dir), None)
    if device is not None:
        out = {k: t.to(device) for k, t in out.items()}
    return out


# ---------------------------------------------------------------------------------------------
# Model and optimizer (OLMo-core style)

_MODEL, _OPTIM = "model", "optim"


def _state_dict_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def save_model_and_optim_state(
    dir: Any, model: torch.nn.Module, optim: Optional[torch.optim.Optimizer], save_overwrite: bool = False
) -> dict:
    """Saves model and optimizer state (FSDP2 DTensors or plain tensors), optimizer state keyed
    by parameter name so that it reshards with the parameters."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    sd: Dict[str, Any] = {_MODEL: get_model_state_dict(model, options=_state_dict_options())}
    if optim is not None:
        sd[_OPTIM] = get_optimizer_state_dict(model, optim, options=_state_dict_options())
    return save(sd, dir, overwrite=save_overwrite)


def load_model_and_optim_state(dir: Any, model: torch.nn.Module, optim: Optional[torch.optim.Optimizer] = None) -> None:
    """Loads, in place, what `save_model_and_optim_state` saved, into any layout of the same
    model. The optimizer's state is created for every parameter the checkpoint has state for."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    msd = get_model_state_dict(model, options=_state_dict_options())
    sd: Dict[str, Any] = {_MODEL: msd}
    if optim is not None:
        osd = get_optimizer_state_dict(model, optim, options=_state_dict_options())
        _add_missing_optim_state(osd, msd, get_metadata(dir))
        sd[_OPTIM] = osd
    load(sd, dir)
    set_model_state_dict(model, sd[_MODEL], options=_state_dict_options())
    if optim is not None:
        set_optimizer_state_dict(model, optim, sd[_OPTIM], options=_state_dict_options())


def _add_missing_optim_state(osd: Dict[str, Any], msd: Dict[str, Any], meta: Dict[str, Dict[str, Any]]) -> None:
    """A fresh optimizer has no state yet: create targets shaped (and sharded) like their
    parameter for every ``optim.state.<param>.<name>`` the checkpoint holds."""
    prefix = f"{_OPTIM}.state."
    for key, m in meta.items():
        if not key.startswith(prefix):
            continue
        flat = key[len(_OPTIM) + 1 :]
        if flat in osd:
            continue
        param_name, _, _state_name = flat[len("state.") :].rpartition(".")
        param = msd.get(param_name)
        if param is not None and tuple(param.shape) == tuple(m["shape"]):
            osd[flat] = torch.empty_like(param, dtype=m["dtype"])
        else:
            osd[flat] = torch.empty(m["shape"], dtype=m["dtype"])


def _unshard_prefixed(dir: Any, prefix: str, device: Any, rank0_only: bool, no_dist: bool) -> Dict[str, Any]:
    keys = [k for k in get_metadata(dir) if k.startswith(prefix + ".")]
    full = unshard(dir, keys, device=device, rank0_only=rank0_only, no_dist=no_dist)
    return {k[len(prefix) + 1 :]: v for k, v in full.items()}


def unshard_model_state(
    dir: Any, device: Any = None, rank0_only: bool = False, no_dist: bool = False
) -> Dict[str, torch.Tensor]:
    """The full model state dict saved by `save_model_and_optim_state`."""
    return _unshard_prefixed(dir, _MODEL, device, rank0_only, no_dist)


def unshard_optim_state(
    dir: Any, device: Any = None, rank0_only: bool = False, no_dist: bool = False
) -> Dict[str, Any]:
    """The full optimizer state: ``{"state": {param: {name: tensor}}, "param_groups": [...]}``."""
    if _not_rank0(rank0_only, no_dist):
        return {}
    flat = _unshard_prefixed(dir, _OPTIM, device, rank0_only, no_dist)
    state: Dict[str, Dict[str, Any]] = {}
    for k, v in flat.items():
        param, _, name = k[len("state.") :].rpartition(".")
        state.setdefault(param, {})[name] = v
    groups: Dict[str, Dict[str, Any]] = {}
    group_prefix = "param_groups."
    for path, v in _native.load_common(str(dir)):
        if len(path) == 2 and path[0] == _OPTIM and str(path[1]).startswith(group_prefix):
            param, _, name = str(path[1])[len(group_prefix) :].rpartition(".")
            groups.setdefault(param, {})[name] = _from_plain(v)
    return {"state": state, "param_groups": groups}
