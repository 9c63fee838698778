"""OLMo-core's ``Checkpointer``: flat state dicts of tensors, DTensors and flat shards saved as
one OLMo-core 0.1.x checkpoint directory and loaded in place into any layout. The files are
written by tessera's Rust core (``_native.save_olmo``), read through its load planner; this
module only says which piece of which tensor each rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, cast

import torch

from .. import _native
from .._core import io
from .._core.storage import StorageOptions, local_dir, native_location, split_location
from .._core.descriptors import load_tensor, save_tensor
from .._core.layout import cpu_contiguous, is_dtensor, layout
from ._metadata import StorageMetadata

PathOrStr = Union[Path, str]

__all__ = ["Checkpointer", "FlatShard", "PathOrStr", "save_tensors", "files_created"]


@dataclass
class FlatShard:
    """A rank's piece of a tensor held as ranges of its row-major flattening (FSDP1's
    ``use_orig_params`` parameters and their optimizer state): ``data`` (1-D) holds
    ``ranges`` back to back, of a tensor of ``full_shape``."""

    data: torch.Tensor
    full_shape: Tuple[int, ...]
    ranges: Tuple[Tuple[int, int], ...]

    def like(self, data: torch.Tensor) -> "FlatShard":
        """Another tensor laid out as this one (optimizer state of the parameter)."""
        return FlatShard(data, self.full_shape, self.ranges)


@dataclass
class _Piece:
    """One piece of one key on this rank, as the core describes it."""

    key: str
    data: torch.Tensor  # the rank's elements (box-shaped, or 1-D for a flat range)
    full_shape: Tuple[int, ...]
    offset: Tuple[int, ...]
    box: Tuple[int, ...]
    flat: Optional[Tuple[int, int]]


# The flat range of a piece that holds none of its tensor.
_NOTHING = (0, 0)


def _olmo_flat(t: Any) -> Optional[FlatShard]:
    """OLMo-core's own ``ShardedFlatTensor`` (its FSDP), recognised by its attributes."""
    spec = getattr(t, "sharding_spec", None)
    offsets = getattr(spec, "unsharded_flattened_offsets", None)
    if offsets is None or not getattr(t, "metadata_set", True):
        return None
    assert spec is not None  # the offsets came from it
    group = getattr(t, "process_group", None)
    rank = torch.distributed.get_rank(group) if torch.distributed.is_initialized() else 0
    return FlatShard(t.sharded_data, tuple(spec.unsharded_shape), tuple(tuple(r) for r in offsets[rank]))


def _pieces(key: str, t: Any, rank: int) -> List[_Piece]:
    """The pieces of ``t`` (a tensor, DTensor, FlatShard or OLMo ShardedFlatTensor) this rank holds."""
    flat = t if isinstance(t, FlatShard) else _olmo_flat(t)
    if flat is not None:
        out, at = [], 0
        data = flat.data.detach().reshape(-1)
        for s, e in flat.ranges:
            if e > s:
                out.append(_Piece(key, data[at : at + e - s], flat.full_shape, (0,) * len(flat.full_shape),
                                  flat.full_shape, (s, e)))
            at += e - s
        if not out:
            zeros = (0,) * len(flat.full_shape)
            if 0 in flat.full_shape:  # an empty tensor: its (no) elements, whole
                return [_Piece(key, data.reshape(flat.full_shape), flat.full_shape, zeros, flat.full_shape, None)]
            # This rank holds none of it: nothing to save, but a load still checks the key exists.
            out.append(_Piece(key, data[:0], flat.full_shape, zeros, flat.full_shape, _NOTHING))
        return out
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{key!r}: a state dict to checkpoint holds tensors, not {type(t).__name__}")
    if is_dtensor(t):
        local, shape, offset, _ = layout(t, rank)
        return [_Piece(key, local.detach(), shape, offset, tuple(local.shape), None)]
    t = t.detach()
    return [_Piece(key, t, tuple(t.shape), (0,) * t.dim(), tuple(t.shape), None)]


def save_tensors(state_dict: Dict[str, Any], rank: int) -> Tuple[List[_native.SaveTensor], List[torch.Tensor]]:
    """The core's description of this rank's pieces of ``state_dict`` (pieces holding nothing
    left out), and the CPU memory it reads, to keep alive until the save returns. Which copy of
    a piece several ranks hold is written is the core's choice (OLMo-core's rule: identical
    pieces are replicas)."""
    keep_alive, native = [], []
    for key, t in state_dict.items():
        for p in _pieces(key, t, rank):
            if p.flat == _NOTHING:
                continue
            data = cpu_contiguous(p.data)
            keep_alive.append(data)
            native.append(
                save_tensor(p.key, p.data.dtype, p.box, p.full_shape, p.offset, flattened_range=p.flat, data=data)
            )
    return native, keep_alive


def files_created(d: str, report: Dict[str, Any]) -> List["PathOrStr"]:
    """The files a save of directory ``d`` created on this rank, as OLMo-core names them."""
    return [f"{d}/{f}" if _is_url(d) else Path(d) / f for f in report["files"]]


def _normalize(dir: PathOrStr) -> str:
    """A local directory as a plain path (``file://`` dropped), any other location as given;
    without a trailing ``/``."""
    d = str(dir).rstrip("/")
    local = local_dir(d)
    return d if local is None else local


def _is_url(d: str) -> bool:
    return local_dir(d) is None


def _load_pieces(
    dir: str,
    pieces: Sequence[_Piece],
    comm: Any = None,
    threads: Optional[int] = None,
    storage_options: StorageOptions = None,
) -> None:
    """Fills every piece from the checkpoint at ``dir`` (every key must be stored there); with
    ``comm``, the ranks check the checksum blocks they share together."""
    items: List[io.LoadItem] = []
    for p in pieces:

        def describe(buf: Any, p: _Piece = p) -> Any:
            return load_tensor(p.key, p.data.dtype, p.box, p.full_shape, p.offset, flattened_range=p.flat, data=buf)

        items.append((p.data, describe, (p.flat, p.offset)))
    where = native_location(dir, storage_options)
    io.load(items, [], where, comm, strict="raise_unexpected", threads=threads)


class Checkpointer:
    """Saves and loads flat (non-nested) state dicts of tensors, DTensors and flat shards as
    OLMo-core 0.1.x checkpoint directories (``rank_{r}.safetensors`` + ``metadata.json``).
    For a model and its optimizer together use :func:`save_model_and_optim_state` and
    :func:`load_model_and_optim_state`. ``storage_options`` configure an object store for every
    call (``object_store`` keys over the environment: ``{"aws_endpoint": …}``, …)."""

    METADATA_FILENAME = "metadata.json"

    def __init__(self, *, storage_options: StorageOptions = None) -> None:
        self.storage_options = dict(storage_options) if storage_options else None

    def save(
        self, dir: PathOrStr, state_dict: Dict[str, Any], save_overwrite: bool = False
    ) -> Tuple[StorageMetadata, List[PathOrStr]]:
        """Saves ``state_dict`` (every rank calls it with its own pieces); returns the metadata
        and the files this rank created. ``metadata.json`` is written last, once every rank's
        file is complete. An existing checkpoint is kept unless ``save_overwrite``."""
        dir, options = split_location(dir, self.storage_options)
        d = _normalize(dir)
        comm, rank = io.communicator()
        native, keep_alive = save_tensors(state_dict, rank)
        report = _native.save_olmo([(native, native_location(d, options))], comm, overwrite=save_overwrite)[0]
        del keep_alive
        # report["metadata"] is the text of metadata.json (see _native.save_olmo)
        return StorageMetadata.from_json(cast(str, report["metadata"])), files_created(d, report)

    def load(
        self,
        dir: PathOrStr,
        state_dict: Dict[str, Any],
        no_dist: bool = False,
        metadata: Optional[StorageMetadata] = None,
        _safetensors_mfl: Any = None,
        _check_for_nans: bool = False,
    ) -> None:
        """Loads ``state_dict`` in place: each tensor (or this rank's piece of it) is filled from
        the checkpoint, whatever layout it was saved in; only the needed bytes are read. A key
        the checkpoint lacks, or another dtype or shape, raises naming it. Collective unless
        ``no_dist`` (as OLMo-core's): the ranks check the checksum blocks they share together,
        so from an object store each downloads only the bytes it needs (``metadata`` and the
        private arguments are accepted for compatibility)."""
        del metadata, _safetensors_mfl, _check_for_nans
        pieces = [p for key, t in state_dict.items() for p in _pieces(key, t, 0)]
        dir, options = split_location(dir, self.storage_options)
        comm, _ = io.communicator(no_dist=no_dist)
        _load_pieces(_normalize(dir), pieces, comm, storage_options=options)

    def unshard(
        self,
        dir: PathOrStr,
        device: Optional[torch.device] = None,
        rank0_only: bool = False,
        no_dist: bool = False,
        num_threads: Optional[int] = None,
    ) -> Dict[str, torch.Tensor]:
        """Every full tensor of the checkpoint, in metadata order. With ``rank0_only`` ranks
        other than 0 get ``{}``; there is no communication either way."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank0_only and no_dist and rank != 0:
            raise ValueError(f"calling `unshard()` with `rank0_only=True` and `no_dist=True` is undefined for rank {rank}")
        if rank0_only and rank != 0:
            return {}
        dir, options = split_location(dir, self.storage_options)
        d = _normalize(dir)
        meta = Checkpointer(storage_options=options).get_metadata(d)
        out = {k: torch.empty(m.shape, dtype=m.torch_dtype) for k, m in meta.tensors.items()}
        pieces = [_Piece(k, t, tuple(t.shape), (0,) * t.dim(), tuple(t.shape), None) for k, t in out.items()]
        # OLMo-core's num_threads=0 means no threading: one thread.
        threads = None if num_threads is None else max(num_threads, 1)
        _load_pieces(d, pieces, None, threads=threads, storage_options=options)
        if device is not None:
            out = {k: t.to(device) for k, t in out.items()}
        return out

    def get_metadata(self, dir: PathOrStr, no_dist: bool = False) -> StorageMetadata:
        """The checkpoint's metadata (read and checked by the core; no communication)."""
        del no_dist
        dir, options = split_location(dir, self.storage_options)
        return StorageMetadata.from_json(_native.olmo_metadata(native_location(_normalize(dir), options)))
