"""``tessera.olmo_core.v3``: OLMo-core 3.x's ``olmo_core.distributed.checkpoint``, name for name.

::

    import sys, tessera.olmo_core.v3 as ckpt; sys.modules["olmo_core.distributed.checkpoint"] = ckpt

before ``olmo_core.train`` is imported is all an OLMo-core 3.x user changes: the ``Trainer``
then saves, resumes and unshards through tessera. (OLMo-core 0.1.x's API, the seed's, is
:mod:`tessera.olmo_core`; the two write different formats, as the two releases do.)

Checkpoints are PyTorch DCP directories, as OLMo-core 3.x writes them: tensors under DCP's
flattened keys (``model.<fqn>``, ``optim.state.<fqn>.<name>``), every other value a DCP byte
item, ``.metadata`` last. OLMo-core 3.x (and ``torch.distributed.checkpoint``) load what this
module writes, and it loads what they wrote, resharded to any world size and layout, reading
only the bytes each rank needs, from a directory or an object store. The writes are tessera's
``torch_dist`` writer (as :func:`tessera.torch.save` with ``format="dcp"``), the reads its DCP
reader (as :func:`tessera.torch.load`), through the package's private core.

What differs from ai2-olmo-core 3.0.0, deliberately:

- ``save_overwrite`` replaces the old checkpoint at the commit: it stays whole (and loadable)
  until the new ``.metadata`` lands, where OLMo-core clears the directory first. A save that
  fails leaves the old checkpoint as it was.
- without ``save_overwrite``, a non-empty directory raises ``FileExistsError`` as in OLMo-core
  (tessera's ``AlreadyExistsError`` when it holds a checkpoint).
- ``thread_count``, ``process_count``, ``throttle_uploads``, ``enable_plan_caching``,
  ``pre_download`` and ``work_dir`` are accepted and have no effect: tessera sizes its own
  native thread pool, plans without a cache and reads object stores by range, without a
  download cache.
- ``load_keys`` loads any key, including one optimizer value
  (``optim.param_groups.0.lr``) or one tensor's state (``optim.state.<fqn>.exp_avg``), which
  OLMo-core 3.0's key lookup cannot reach.
- the unsharded files of :func:`unshard_checkpoint` are written to a temporary name and
  renamed, so a failed unshard leaves no partial file.
- :mod:`.filesystem`'s DCP storage classes write and read local directories only (object
  stores go through this module's functions).
- errors are tessera's typed exceptions (``tessera.errors``), naming the file and key.
"""

from __future__ import annotations

import logging
import os
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Generator, Iterable, List, Optional, Set, Tuple

import torch
import torch.nn as nn

from ... import _native
from ..._core import io, statedict
from ..._core.paths import from_native_path
from ..._core.values import TORCH_SAVE_KEY, from_plain
from .._checkpointer import PathOrStr, _is_url, _normalize
from .filesystem import RemoteFileSystemReader, RemoteFileSystemWriter

__all__ = [
    "save_state_dict",
    "async_save_state_dict",
    "load_state_dict",
    "save_model_and_optim_state",
    "async_save_model_and_optim_state",
    "load_model_and_optim_state",
    "unshard_checkpoint",
    "load_keys",
    "get_checkpoint_metadata",
    "UnshardStrategy",
    "UnshardStrategyType",
    "swap_param_keys",
    "prune_state_dict",
    "merge_state_dicts",
    "RemoteFileSystemWriter",
    "RemoteFileSystemReader",
]

log = logging.getLogger(__name__)


def _is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _prepare_env_for_save(dir: PathOrStr, process_group: Any = None, save_overwrite: bool = False) -> str:
    """OLMo-core's preparation of a save's directory, as its DDP train module calls it before
    its own DCP save: a non-empty directory without ``save_overwrite`` raises
    ``FileExistsError``; the directory exists afterwards on every rank. Unlike OLMo-core it
    does not clear the directory with ``save_overwrite``: the files a save replaces are
    replaced by it."""
    d = _normalize(dir)
    if not save_overwrite and not _is_url(d) and os.path.isdir(d) and os.listdir(d):
        raise FileExistsError(d)
    if not _is_url(d):
        os.makedirs(d, exist_ok=True)
    if _is_distributed():
        torch.distributed.barrier(group=process_group)
    return d


# ---------------------------------------------------------------------------------------------
# Arbitrary state dicts


@torch.no_grad()
def save_state_dict(
    dir: PathOrStr,
    state_dict: Dict[str, Any],
    *,
    process_group: Any = None,
    save_overwrite: bool = False,
    thread_count: Optional[int] = None,
    process_count: Optional[int] = None,
    throttle_uploads: bool = False,
    enable_plan_caching: bool = False,
    _skip_prepare: bool = False,
) -> None:
    """Saves a (nested) state dict as a DCP checkpoint that loads into any other topology
    (collective over ``process_group``). ``_skip_prepare``: the caller (OLMo-core's
    ``Checkpointer``) has prepared the directory; anything there is replaced at the commit."""
    del thread_count, process_count, throttle_uploads, enable_plan_caching
    d = _normalize(dir) if _skip_prepare else _prepare_env_for_save(dir, process_group, save_overwrite)
    _save(state_dict, d, process_group, save_overwrite or _skip_prepare)


def _save(state_dict: Dict[str, Any], d: str, process_group: Any, overwrite: bool) -> None:
    """A DCP directory of ``state_dict`` at ``d`` (collective), as DCP's save writes it."""
    comm, rank = io.communicator(process_group)
    items, common = statedict.save_request(state_dict, comm, rank, "dcp")
    statedict.write_dcp(items, common, rank, d, comm, overwrite)


def _save_in_background(state_dict: Dict[str, Any], d: str, process_group: Any, overwrite: bool) -> "Future[None]":
    """:func:`_save` once the state is on the host, the rest in the background."""
    comm, rank = io.communicator(process_group)
    items, common = statedict.save_request(state_dict, comm, rank, "dcp")
    return _none_when_done(statedict.write_dcp_in_background(items, common, rank, d, process_group, False, overwrite))


@torch.no_grad()
def async_save_state_dict(
    dir: PathOrStr,
    state_dict: Dict[str, Any],
    *,
    process_group: Any = None,
    save_overwrite: bool = False,
    thread_count: Optional[int] = None,
    process_count: Optional[int] = None,
    throttle_uploads: bool = False,
    enable_plan_caching: bool = False,
    _skip_prepare: bool = False,
) -> "Future[None]":
    """:func:`save_state_dict` in the background: returns once the state is copied to host
    memory, with a future that is done when the checkpoint is committed (or holds the error,
    the same on every rank; nothing was committed then)."""
    del thread_count, process_count, throttle_uploads, enable_plan_caching
    d = _normalize(dir) if _skip_prepare else _prepare_env_for_save(dir, process_group, save_overwrite)
    return _save_in_background(state_dict, d, process_group, save_overwrite or _skip_prepare)


def _none_when_done(report: "Future[Any]") -> "Future[None]":
    """A future of ``None`` that completes as ``report`` does (OLMo-core's futures hold None)."""
    out: "Future[None]" = Future()

    def done(f: "Future[Any]") -> None:
        error = f.exception()
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(None)

    report.add_done_callback(done)
    return out


@torch.no_grad()
def load_state_dict(
    dir: PathOrStr,
    state_dict: Dict[str, Any],
    *,
    process_group: Any = None,
    pre_download: bool = False,
    work_dir: Optional[PathOrStr] = None,
    thread_count: Optional[int] = None,
) -> None:
    """Loads a state dict in place from a checkpoint of :func:`save_state_dict` (tessera's,
    OLMo-core's, or any DCP checkpoint), whatever topology saved it (collective)."""
    del pre_download, work_dir, thread_count
    statedict.load(state_dict, _normalize(dir), process_group, True, None)


# ---------------------------------------------------------------------------------------------
# Model and optimizer


def _prepare_state_dict(model: nn.Module, optim: Optional[torch.optim.Optimizer], flatten_optimizer_state: bool) -> Dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as torch's ``get_model_state_dict`` /
    ``get_optimizer_state_dict`` give them (sharded, on CPU), as OLMo-core checkpoints them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=False, cpu_offload=True, flatten_optimizer_state_dict=flatten_optimizer_state)
    state: Dict[str, Any] = {"model": get_model_state_dict(model, options=options)}
    if optim is not None:
        state["optim"] = get_optimizer_state_dict(model, optim, options=options)
    return state


@torch.no_grad()
def save_model_and_optim_state(
    dir: PathOrStr,
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    *,
    process_group: Any = None,
    save_overwrite: bool = False,
    flatten_optimizer_state: bool = False,
    thread_count: Optional[int] = None,
    process_count: Optional[int] = None,
    throttle_uploads: bool = False,
    enable_plan_caching: bool = False,
) -> None:
    """Saves the model's and (if given) the optimizer's state (collective): sharded, so that
    :func:`load_model_and_optim_state` loads it into another topology.
    ``flatten_optimizer_state`` must match the load's. Raises ``FileExistsError`` if ``dir`` is
    not empty, unless ``save_overwrite``."""
    del thread_count, process_count, throttle_uploads, enable_plan_caching
    d = _prepare_env_for_save(dir, process_group, save_overwrite)
    state = _prepare_state_dict(model, optim, flatten_optimizer_state)
    _save(state, d, process_group, save_overwrite)


@torch.no_grad()
def async_save_model_and_optim_state(
    dir: PathOrStr,
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    *,
    process_group: Any = None,
    save_overwrite: bool = False,
    flatten_optimizer_state: bool = False,
    thread_count: Optional[int] = None,
    process_count: Optional[int] = None,
    throttle_uploads: bool = False,
    enable_plan_caching: bool = False,
) -> "Future[None]":
    """:func:`save_model_and_optim_state` in the background (see :func:`async_save_state_dict`)."""
    del thread_count, process_count, throttle_uploads, enable_plan_caching
    d = _prepare_env_for_save(dir, process_group, save_overwrite)
    state = _prepare_state_dict(model, optim, flatten_optimizer_state)
    return _save_in_background(state, d, process_group, save_overwrite)


@torch.no_grad()
def load_model_and_optim_state(
    dir: PathOrStr,
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    *,
    process_group: Any = None,
    key_mapping: Optional[Dict[str, str]] = None,
    pre_download: bool = False,
    work_dir: Optional[PathOrStr] = None,
    strict: bool = True,
    flatten_optimizer_state: bool = False,
    thread_count: Optional[int] = None,
) -> None:
    """Loads the model's and (if given) the optimizer's state in place from a checkpoint of
    :func:`save_model_and_optim_state` (tessera's or OLMo-core's), whatever topology saved it
    (collective). ``key_mapping`` maps a current parameter name to its name in the
    checkpoint. With ``strict``, a key the checkpoint lacks raises, naming it."""
    del pre_download, work_dir, thread_count
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    d = _normalize(dir)
    state = _prepare_state_dict(model, optim, flatten_optimizer_state)
    if key_mapping is not None:
        swap_param_keys(state, key_mapping, metadata=get_checkpoint_metadata(d))
    statedict.load(state, d, process_group, strict, None)
    if key_mapping is not None:
        swap_param_keys(state, key_mapping, reverse=True, quiet=True)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
    if optim is not None:
        set_optimizer_state_dict(
            model, optim, state["optim"],
            options=StateDictOptions(strict=strict, flatten_optimizer_state_dict=flatten_optimizer_state),
        )


# ---------------------------------------------------------------------------------------------
# Reading whole keys, unsharding, metadata


def get_checkpoint_metadata(dir: PathOrStr) -> Any:
    """The checkpoint's DCP ``Metadata`` (``state_dict_metadata``: every tensor's dtype, size
    and chunks, every other value as a byte item). The checkpoint is opened and validated by
    tessera first; a local DCP directory's own ``.metadata`` is returned, anything else
    (tessera's format, an object store) is described from tessera's index, each tensor as one
    chunk."""
    d = _normalize(dir)
    if not _is_url(d) and os.path.isfile(os.path.join(d, ".metadata")):
        return RemoteFileSystemReader(d).read_metadata()  # validated by tessera first
    tensors, values = _stored(d)  # opens and validates, or raises naming the file
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    items: Dict[str, Any] = {}
    for key, m in tensors.items():
        size = torch.Size(m["shape"])
        chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)
        items[key] = TensorStorageMetadata(properties=TensorProperties(dtype=m["dtype"]), size=size, chunks=[chunk])
    for path, _ in values:
        items[_key(path)] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=items)


_Stored = Tuple[Dict[str, Dict[str, Any]], List[Tuple[Tuple[Any, ...], Any]]]


def _stored(d: str) -> _Stored:
    """The checkpoint's tensors (key → dtype, shape) and values (path, value), read once per
    call of this module's readers."""
    tensors = statedict.tensors_metadata(d)
    values: List[Tuple[Tuple[Any, ...], Any]] = []
    for p, v in _native.load_common(d):
        values.extend(_value_leaves(tuple(seg for _, seg in from_native_path(p)), v))
    return tensors, values


def _value_leaves(path: Tuple[Any, ...], value: Any) -> Generator[Tuple[Tuple[Any, ...], Any], None, None]:
    """A stored value as the leaves DCP's flattening makes of it (Megatron's ``common.pt``
    holds a subtree as one value; a DCP checkpoint holds each leaf), objects rebuilt."""
    if isinstance(value, dict) and set(value) == {TORCH_SAVE_KEY}:
        yield path, from_plain(value)
    elif isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _value_leaves(path + (k,), v)
    elif isinstance(value, list) and _descended(value):
        for i, v in enumerate(value):
            yield from _value_leaves(path + (i,), v)
    else:
        yield path, value


def _tensor_path(key: str, unflattened_optim: bool) -> Tuple[Any, ...]:
    """Where a stored tensor sits in the nested state dict, as DCP's planner data records it
    for OLMo-core's checkpoints: ``model.<fqn>`` is ``("model", fqn)``; with an unflattened
    optimizer state ``optim.state.<fqn>.<name>`` is ``("optim", "state", fqn, name)``, with a
    flattened one ``("optim", "state.<fqn>.<name>")``; any other key is itself, whole."""
    head, _, rest = key.partition(".")
    if head == "model" and rest:
        return ("model", rest)
    if head == "optim" and rest:
        if unflattened_optim and rest.startswith("state."):
            fqn, _, name = rest[len("state."):].rpartition(".")
            if fqn and name:
                return ("optim", "state", fqn, name)
        return ("optim", rest)
    return (key,)


def _set(root: Dict[Any, Any], path: Tuple[Any, ...], value: Any) -> None:
    node: Any = root
    for i, seg in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, list):
            while len(node) <= seg:
                node.append(None)
            if node[seg] is None:
                node[seg] = [] if isinstance(nxt, int) else {}
            node = node[seg]
        else:
            node = node.setdefault(seg, [] if isinstance(nxt, int) else {})
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def _matches(key: str, wanted: str) -> bool:
    return key == wanted or key.startswith(wanted + ".")


def _load_unsharded(d: str, stored: _Stored, keys: List[str]) -> Dict[str, Any]:
    """The nested state dict of every stored tensor and value (``stored``: :func:`_stored`)
    whose DCP key is one of ``keys`` or under one of them, full tensors on CPU, read by this
    process alone."""
    tensors, values = stored
    unflattened = any(_key(p).startswith("optim.param_groups.0.params") for p, _ in values)
    wanted_tensors = [k for k in tensors if any(_matches(k, w) for w in keys)]
    full = statedict.unshard(d, wanted_tensors, tensors) if wanted_tensors else {}
    out: Dict[Any, Any] = {}
    for k in wanted_tensors:
        _set(out, _tensor_path(k, unflattened), full[k])
    for path, v in values:
        if any(_matches(_key(path), w) for w in keys):
            _set(out, path, v)
    return out


def _get_key(state: Any, key: str) -> Any:
    """The value at dotted ``key``: a dict key (which may itself hold dots, as fqns do) or a
    list index, the longest match first."""
    if isinstance(state, dict) and key in state:
        return state[key]
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        head, rest = ".".join(parts[:n]), ".".join(parts[n:])
        if isinstance(state, dict) and head in state:
            try:
                return _get_key(state[head], rest)
            except KeyError:
                continue
        if isinstance(state, list) and n == 1 and head.isdigit() and int(head) < len(state):
            return _get_key(state[int(head)], rest)
    if isinstance(state, list) and key.isdigit() and int(key) < len(state):
        return state[int(key)]
    raise KeyError(key)


def load_keys(
    dir: PathOrStr,
    keys: Iterable[str],
    *,
    pre_download: bool = False,
    work_dir: Optional[PathOrStr] = None,
) -> Generator[Any, None, None]:
    """The unsharded objects of ``keys`` (``"model"``, ``"model.<fqn>"``, ``"optim.state"``,
    ``"optim.param_groups.0.lr"``, ...), in order. Not in a distributed context."""
    del pre_download, work_dir
    if _is_distributed():
        raise RuntimeError("'load_keys' cannot be called in a distributed context")
    d = _normalize(dir)
    keys = list(keys)
    state = _load_unsharded(d, _stored(d), keys)
    for key in keys:
        try:
            yield _get_key(state, key)
        except KeyError:
            raise KeyError(f"{d}: no key {key!r} in the checkpoint") from None


class UnshardStrategyType(str, Enum):
    """How :func:`unshard_checkpoint` lays out the unsharded state."""

    one_file = "one_file"
    """The model's state in one file, the optimizer's in another."""

    one_file_per_tensor = "one_file_per_tensor"
    """A file per tensor (model only)."""

    chunks = "chunks"
    """Tensors (and values) grouped into files of about ``chunk_size_bytes`` (model only)."""

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return f"'{self.value}'"


@dataclass
class UnshardStrategy:
    """The unsharding strategy of :func:`unshard_checkpoint`."""

    name: UnshardStrategyType = UnshardStrategyType.one_file
    chunk_size_bytes: Optional[int] = None
    """The approximate largest file, for :data:`UnshardStrategyType.chunks`."""

    def __post_init__(self) -> None:
        if self.name == UnshardStrategyType.chunks and self.chunk_size_bytes is None:
            raise ValueError("'chunk_size_bytes' is required for the 'chunks' strategy")
        if self.chunk_size_bytes is not None and self.name != UnshardStrategyType.chunks:
            raise ValueError("'chunk_size_bytes' is only valid for the 'chunks' strategy")

    @classmethod
    def one_file(cls) -> "UnshardStrategy":
        """:data:`UnshardStrategyType.one_file`."""
        return cls(name=UnshardStrategyType.one_file)

    @classmethod
    def one_file_per_tensor(cls) -> "UnshardStrategy":
        """:data:`UnshardStrategyType.one_file_per_tensor`."""
        return cls(name=UnshardStrategyType.one_file_per_tensor)

    @classmethod
    def chunks(cls, chunk_size_in_bytes: int) -> "UnshardStrategy":
        """:data:`UnshardStrategyType.chunks` of about ``chunk_size_in_bytes``."""
        return cls(name=UnshardStrategyType.chunks, chunk_size_bytes=chunk_size_in_bytes)


def _write_file(state: Dict[str, Any], path: Path, use_safetensors: bool, save_overwrite: bool) -> None:
    """``state`` to ``path`` through a temporary file renamed into place."""
    if path.is_file() and not save_overwrite:
        raise FileExistsError(f"'{path}' already exists, use `save_overwrite=True` to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        if use_safetensors:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, tmp)
        else:
            torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def unshard_checkpoint(
    dir: PathOrStr,
    target_dir: PathOrStr,
    *,
    optim: Optional[bool] = None,
    save_overwrite: bool = False,
    use_safetensors: bool = False,
    unshard_strategy: Optional[UnshardStrategy] = None,
    pre_download: bool = False,
    work_dir: Optional[PathOrStr] = None,
    quiet: bool = False,
) -> Tuple[Path, Optional[Path]]:
    """Writes the checkpoint's full model state (and, by default unless ``use_safetensors``,
    its optimizer state) to ``target_dir`` (local), as files ``torch.load`` (or safetensors)
    reads: ``model.pt`` / ``optim.pt`` with :meth:`UnshardStrategy.one_file`, else a folder
    ``model/`` of files per tensor or per chunk. Returns the model's and the optimizer's path
    (None without ``optim``). Not in a distributed context; an existing file is kept unless
    ``save_overwrite`` (``FileExistsError``)."""
    del pre_download, work_dir, quiet
    strategy = unshard_strategy or UnshardStrategy.one_file()
    if optim is None:
        optim = not use_safetensors and strategy.name == UnshardStrategyType.one_file
    elif optim and use_safetensors:
        raise NotImplementedError("`optim=True` is incompatible with `use_safetensors=True`")
    elif optim and strategy.name != UnshardStrategyType.one_file:
        raise NotImplementedError(f"`optim=True` is incompatible with `unshard_strategy={strategy}`")
    if _is_distributed():
        raise RuntimeError("'unshard_checkpoint' cannot be called in a distributed context")
    d = _normalize(dir)
    if _is_url(_normalize(target_dir)):
        raise ValueError("'target_dir' must be a local directory")
    target = Path(_normalize(target_dir))
    target.mkdir(parents=True, exist_ok=True)
    ext = "safetensors" if use_safetensors else "pt"
    stored = _stored(d)
    tensors, values = stored

    def files(prefix: str) -> Tuple[Path, List[Tuple[Path, List[str]]]]:
        if strategy.name == UnshardStrategyType.one_file:
            return target / f"{prefix}.{ext}", [(target / f"{prefix}.{ext}", [prefix])]
        folder = target / prefix
        keys = [k for k in tensors if k.startswith(prefix + ".")]
        keys += [k for k in (_key(p) for p, _ in values) if k.startswith(prefix + ".")]
        if strategy.name == UnshardStrategyType.one_file_per_tensor:
            return folder, [(folder / f"{k.replace('.', '-')}.{ext}", [k]) for k in keys]
        limit = strategy.chunk_size_bytes or 0
        out: List[Tuple[Path, List[str]]] = []
        current: List[str] = []
        size = 0
        for k in keys:
            n = 0
            if k in tensors:
                n = int(torch.Size(tensors[k]["shape"]).numel()) * torch.empty((), dtype=tensors[k]["dtype"]).element_size()
                if current and size + n > limit:
                    out.append((folder / f"chunk-{len(out):05d}.{ext}", current))
                    current, size = [], 0
            size += n
            current.append(k)
        if current:
            out.append((folder / f"chunk-{len(out):05d}.{ext}", current))
        return folder, out

    def write(prefix: str) -> Path:
        where, parts = files(prefix)
        for path, keys in parts:
            state = _load_unsharded(d, stored, keys)
            if prefix not in state:
                raise KeyError(f"{d}: no key under {prefix!r} in the checkpoint (wanted {keys})")
            _write_file(state[prefix], path, use_safetensors, save_overwrite)
        return where

    model_path = write("model")
    optim_path = write("optim") if optim else None
    return model_path, optim_path


# ---------------------------------------------------------------------------------------------
# State dict helpers of OLMo-core's train modules


def swap_param_keys(
    state_dict: Dict[str, Any],
    key_mapping: Dict[str, str],
    metadata: Any = None,
    reverse: bool = False,
    quiet: bool = False,
) -> None:
    """Renames parameters of ``state_dict`` (``{"model": ..., "optim": ...}``) from their
    current names to their names in a checkpoint (``key_mapping``: current → stored; the
    reverse with ``reverse``), in the model state and the optimizer state (flattened or not).
    With ``metadata``, only names the checkpoint holds as ``model.<name>`` are renamed."""
    for current, stored in key_mapping.items():
        if metadata is not None and f"model.{stored}" not in metadata.state_dict_metadata:
            continue
        src, dst = (stored, current) if reverse else (current, stored)
        if src not in state_dict["model"]:
            continue
        if not quiet:
            log.info(f"Mapping current param '{src}' to '{dst}' in checkpoint")
        state_dict["model"][dst] = state_dict["model"].pop(src)
        osd = state_dict.get("optim")
        if osd is None:
            continue
        if "state" in osd:  # unflattened: state by name, groups list the names
            if src in osd["state"]:
                osd["state"][dst] = osd["state"].pop(src)
            for group in osd["param_groups"]:
                if src in group["params"]:
                    group["params"][group["params"].index(src)] = dst
                    break
        else:  # flattened: "state.<name>.<x>" and "param_groups.<name>.<x>"
            for key in list(osd):
                for kind in ("state", "param_groups"):
                    if key.startswith(f"{kind}.{src}."):
                        osd[f"{kind}.{dst}.{key[len(kind) + len(src) + 2:]}"] = osd.pop(key)


def _descended(node: Any) -> bool:
    """Whether DCP's flattening goes into ``node``: a dict always, a list when it holds a dict
    or a list that is itself gone into (``param_groups``); anything else is one value."""
    if isinstance(node, dict):
        return True
    return isinstance(node, list) and any(isinstance(x, dict) or _descended(x) for x in node)


def _leaves(node: Any, path: Tuple[Any, ...] = ()) -> Generator[Tuple[Tuple[Any, ...], Any], None, None]:
    """``(path, leaf)`` of every leaf as DCP flattens a state dict (its keys are the paths
    joined with dots)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, path + (k,))
    elif _descended(node):
        for i, v in enumerate(node):
            yield from _leaves(v, path + (i,))
    else:
        yield path, node


def _key(path: Tuple[Any, ...]) -> str:
    return ".".join(str(seg) for seg in path)


def prune_state_dict(state_dict: Dict[str, Any], allowed_keys: Set[str]) -> Set[str]:
    """Removes every leaf whose DCP key is not in ``allowed_keys`` (a checkpoint's
    ``metadata.state_dict_metadata`` keys); returns the removed keys. A leaf inside a list
    (a parameter group's value) is removed from its dict; list positions stay."""
    pruned: Set[str] = set()
    for path, _ in list(_leaves(state_dict)):
        key = _key(path)
        if key in allowed_keys:
            continue
        node: Any = state_dict
        for seg in path[:-1]:
            node = node[seg]
        if isinstance(node, dict):
            del node[path[-1]]
            pruned.add(key)
    return pruned


def merge_state_dicts(lhs: Dict[str, Any], rhs: Dict[str, Any]) -> None:
    """Adds to ``lhs`` every leaf of ``rhs`` whose DCP key ``lhs`` lacks, at the same path
    (containers ``lhs`` lacks are made as ``rhs`` has them)."""
    have = {_key(p) for p, _ in _leaves(lhs)}
    for path, value in _leaves(rhs):
        if _key(path) in have:
            continue
        node_l: Any = lhs
        node_r: Any = rhs
        for seg in path[:-1]:
            node_r = node_r[seg]
            if isinstance(node_l, dict):
                if seg not in node_l:
                    node_l[seg] = {} if isinstance(node_r, dict) else [None] * len(node_r)
            elif len(node_l) <= seg:
                node_l.extend([None] * (seg + 1 - len(node_l)))
            if node_l[seg] is None:
                node_l[seg] = {} if isinstance(node_r, dict) else [None] * len(node_r)
            node_l = node_l[seg]
        node_l[path[-1]] = value
