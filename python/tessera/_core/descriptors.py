"""The values that cross into the Rust core (``tessera._native``), made in one place per kind.

Every save, load and validation of the package (``dist_checkpointing``, ``tessera.torch``,
``tessera.olmo_core``) describes its tensors and objects to the core with these helpers:
:func:`save_tensor`, :func:`load_tensor`, :func:`save_object`, :func:`load_object`, and their
forms for this package's ``ShardedTensor`` and ``ShardedObject`` (:func:`sharded_save_tensor`,
...). They only convert (a torch or numpy dtype to its tessera name, memory to its address and
size, a slice to ``(start, end)``); every check of the geometry is the core's.

torch is not imported here: data may be a torch tensor or a numpy array.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

from .. import _native

from ..errors import TesseraError
from .dtypes import to_tessera_dtype

__all__ = [
    "memory",
    "save_tensor",
    "load_tensor",
    "save_object",
    "load_object",
    "sharded_save_tensor",
    "sharded_load_tensor",
    "sharded_save_object",
    "sharded_load_object",
]

FlatRange = Union[None, slice, Tuple[int, int]]


def memory(data: Any) -> Tuple[int, int]:
    """``(data_ptr, nbytes)`` of C-contiguous CPU memory (a torch tensor or a numpy array);
    ``(0, 0)`` for None. The caller keeps the memory alive for the call it is given to."""
    if data is None:
        return 0, 0
    if hasattr(data, "data_ptr"):  # torch
        return int(data.data_ptr()), int(data.numel() * data.element_size())
    return int(data.ctypes.data), int(data.nbytes)  # numpy


def _dtype(key: str, dtype: Any) -> str:
    try:
        return to_tessera_dtype(dtype)
    except TesseraError as e:
        raise TesseraError(f"{key!r}: {e}") from None


def _flat(r: FlatRange) -> Optional[Tuple[int, int]]:
    if r is None:
        return None
    if isinstance(r, slice):
        return (r.start, r.stop)
    return (r[0], r[1])


def save_tensor(
    key: str,
    dtype: Any,
    local_shape: Sequence[int],
    global_shape: Sequence[int],
    global_offset: Sequence[int],
    *,
    data: Any = None,
    prepend_axis_num: int = 0,
    replica_id: Any = 0,
    flattened_range: FlatRange = None,
    axis_fragmentations: Optional[Sequence[int]] = None,
) -> _native.SaveTensor:
    """A tensor shard to save (or, without ``data``, whose layout to check). ``dtype``: torch,
    numpy or tessera name; ``data``: its C-contiguous CPU memory, kept alive by the caller."""
    data_ptr, nbytes = memory(data)
    return _native.SaveTensor(
        key=key,
        dtype=_dtype(key, dtype),
        local_shape=local_shape,
        global_shape=global_shape,
        global_offset=global_offset,
        prepend_axis_num=prepend_axis_num,
        replica_id=replica_id,
        flattened_range=_flat(flattened_range),
        axis_fragmentations=axis_fragmentations,
        data_ptr=data_ptr,
        nbytes=nbytes,
    )


def load_tensor(
    key: str,
    dtype: Any,
    local_shape: Sequence[int],
    global_shape: Sequence[int],
    global_offset: Sequence[int],
    *,
    data: Any,
    prepend_axis_num: int = 0,
    flattened_range: FlatRange = None,
    allow_shape_mismatch: bool = False,
) -> _native.LoadTensor:
    """A tensor shard to load into ``data`` (C-contiguous CPU memory the caller keeps alive and
    leaves alone during the load)."""
    data_ptr, nbytes = memory(data)
    return _native.LoadTensor(
        key=key,
        dtype=_dtype(key, dtype),
        local_shape=local_shape,
        global_shape=global_shape,
        global_offset=global_offset,
        prepend_axis_num=prepend_axis_num,
        flattened_range=_flat(flattened_range),
        allow_shape_mismatch=allow_shape_mismatch,
        data_ptr=data_ptr,
        nbytes=nbytes,
    )


def save_object(
    key: str, global_shape: Sequence[int], global_offset: Sequence[int], replica_id: Any = 0, data: bytes = b""
) -> _native.SaveObject:
    """An object shard to save (its serialized ``data``), or without data, whose layout to check."""
    return _native.SaveObject(
        key=key, global_shape=global_shape, global_offset=global_offset, replica_id=replica_id, data=data
    )


def load_object(key: str, global_shape: Sequence[int], global_offset: Sequence[int]) -> _native.LoadObject:
    """An object shard to load."""
    return _native.LoadObject(key=key, global_shape=global_shape, global_offset=global_offset)


def sharded_save_tensor(sh: Any, data: Any = None) -> _native.SaveTensor:
    """:func:`save_tensor` of a ``ShardedTensor``; ``data``: its data as CPU C-contiguous memory
    (None: the layout only)."""
    return save_tensor(
        sh.key,
        sh.dtype,
        sh.local_shape,
        sh.global_shape,
        sh.global_offset,
        data=data,
        prepend_axis_num=sh.prepend_axis_num,
        replica_id=sh.replica_id,
        flattened_range=sh.flattened_range,
        axis_fragmentations=sh.axis_fragmentations,
    )


def sharded_load_tensor(sh: Any, data: Any) -> _native.LoadTensor:
    """:func:`load_tensor` of a ``ShardedTensor`` into ``data``."""
    return load_tensor(
        sh.key,
        sh.dtype,
        sh.local_shape,
        sh.global_shape,
        sh.global_offset,
        data=data,
        prepend_axis_num=sh.prepend_axis_num,
        flattened_range=sh.flattened_range,
        allow_shape_mismatch=bool(sh.allow_shape_mismatch),
    )


def sharded_save_object(o: Any, data: bytes = b"") -> _native.SaveObject:
    """:func:`save_object` of a ``ShardedObject`` with its encoded ``data``."""
    return save_object(o.key, o.global_shape, o.global_offset, o.replica_id, data)


def sharded_load_object(o: Any) -> _native.LoadObject:
    """:func:`load_object` of a ``ShardedObject``."""
    return load_object(o.key, o.global_shape, o.global_offset)
