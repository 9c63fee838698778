"""Classes that describe how local data maps onto global checkpoint entries.

The main use is wrapping the tensors of a state dict in ``ShardedTensor`` (mostly through
``ShardedTensor.from_rank_offsets``) so that a checkpoint saved in one parallel layout can be
loaded in another. Names, fields and semantics follow Megatron-Core's ``mapping`` module, which
is also where every other mapping class is importable from.

torch is not needed to import this module (an optional extra of the package, imported where
used): data may be a torch tensor or a numpy array, and ``dtype`` is whatever ``data.dtype`` is
(a ``torch.dtype`` for torch tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, List, Optional, Tuple, Union, cast

import numpy as np

from .. import _native
from .._core.descriptors import sharded_save_tensor
from .._core.dtypes import tessera_dtype_to_torch, torch_dtype_to_tessera
from .base import (
    LocalNonpersistentObject,
    LocalNonpersitentObject,
    ReplicaId,
    ShardedBase,
    ShardedStateDict,
    StateDict,
    _int_tuple,
    is_main_replica,
)
from .core import CheckpointingException
from .factories import FactoryBuildFn, FactoryMergeFn, ShardedTensorFactory, apply_factories, apply_factory_merges

__all__ = [
    "ReplicaId",
    "StateDict",
    "ShardedStateDict",
    "ShardedBase",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "FactoryBuildFn",
    "FactoryMergeFn",
    "LocalNonpersistentObject",
    "LocalNonpersitentObject",
    "is_main_replica",
    "apply_factories",
    "apply_factory_merges",
    "torch_dtype_to_tessera",
    "tessera_dtype_to_torch",
]


@dataclass
class ShardedTensor(ShardedBase):
    """One process's piece of a global tensor.

    ``global_offset`` is in elements; the first ``prepend_axis_num`` global axes have no local
    counterpart (the local tensor is as if unsqueezed there, e.g. a layer index of stacked
    layers). ``axis_fragmentations`` (None for uneven sharding) says into how many equal chunks
    each global axis is cut. ``flattened_range`` selects the part of the flattened local box
    that ``data`` (then 1-D) holds. With ``allow_shape_mismatch`` the stored global shape may
    differ on load (the loaded data is padded or truncated).
    """

    key: str
    data: Optional[Any] = field(repr=False)
    dtype: Any
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self) -> None:
        # torch.Size and lists are accepted but stored as plain tuples so metadata compares equal.
        self.local_shape = _int_tuple(self.local_shape, "local_shape", self.key)
        self.global_shape = _int_tuple(self.global_shape, "global_shape", self.key)
        self.global_offset = _int_tuple(self.global_offset, "global_offset", self.key)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = _int_tuple(self.axis_fragmentations, "axis_fragmentations", self.key)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Checks that shapes, offsets, fragmentations, the flattened range and the data agree.

        The geometry is checked by the core (``tessera._native.SaveTensor.check``: the check a
        save or load makes first), here because Megatron's API checks at construction, before
        the core sees the tensor; the box must lie inside the global shape unless
        ``allow_shape_mismatch``. Raises CheckpointingException (the core's
        ``InvalidShardingError``, or ``InvalidArgumentError`` for a negative size), or TypeError
        for a field of the wrong type.
        """
        self._validate_flattened_range()
        self._validate_data()
        sharded_save_tensor(self).check(in_bounds=not self.allow_shape_mismatch)

    def _validate_flattened_range(self) -> None:
        # Kept here: the form of the Python slice, which the core never sees (it gets
        # ``(start, stop)``; the bounds are the core's check).
        r = self.flattened_range
        if r is None:
            return
        if not isinstance(r, slice) or not isinstance(r.start, int) or not isinstance(r.stop, int):
            raise CheckpointingException(f"{self.key!r}: flattened_range must be a slice of ints, got {r!r}")
        if r.step not in (None, 1):
            raise CheckpointingException(f"{self.key!r}: flattened_range {r} must not have a step")

    def _validate_data(self) -> None:
        # Kept here: the data object (its dtype and shape), which the core never sees; it gets
        # the bytes only, and only when saving or loading.
        if self.data is None:
            return
        data_shape = tuple(self.data.shape)
        if self.data.dtype != self.dtype:
            raise CheckpointingException(f"{self.key!r}: data dtype {self.data.dtype} differs from dtype {self.dtype}")
        if self.flattened_range is None:
            if data_shape != self.local_shape:
                raise CheckpointingException(
                    f"{self.key!r}: data shape {data_shape} differs from local_shape {self.local_shape}"
                )
            return
        expected = self.flattened_range.stop - self.flattened_range.start
        if len(data_shape) != 1 or data_shape[0] != expected:
            raise CheckpointingException(
                f"{self.key!r}: with flattened_range {self.flattened_range} data must be 1-D with {expected} "
                f"elements, got shape {data_shape}"
            )

    def box_shape(self) -> Tuple[int, ...]:
        """Shape of the local box in global coordinates (1 on each prepended axis)."""
        return (1,) * self.prepend_axis_num + self.local_shape

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """Index of the local box in the global tensor: ints on prepended axes, slices after."""
        prepend = self.prepend_axis_num
        return tuple(self.global_offset[:prepend]) + tuple(
            slice(off, off + size) for off, size in zip(self.global_offset[prepend:], self.local_shape)
        )

    def local_coordinates(self) -> Tuple[Any, ...]:
        """Per-axis numpy index arrays of the local elements selected by ``flattened_range``."""
        if self.flattened_range is None:
            raise CheckpointingException(
                f"local_coordinates is undefined for {self} without flattened_range"
            )
        mask = np.zeros(math.prod(self.local_shape), dtype=bool)
        mask[self.flattened_range.start : self.flattened_range.stop] = True
        return np.nonzero(mask.reshape(self.local_shape))

    def global_coordinates(self) -> Tuple[Any, ...]:
        """Per-axis numpy index arrays, in the global tensor, of the elements ``data`` holds."""
        if self.flattened_range is None:
            raise CheckpointingException(
                f"global_coordinates is undefined for {self} without flattened_range"
            )
        local = self.local_coordinates()
        count = len(local[0]) if local else 0
        prepended = tuple(np.zeros(count, dtype=np.int64) for _ in range(self.prepend_axis_num))
        return tuple(c + off for c, off in zip(prepended + tuple(local), self.global_offset))

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """Offset of the local box counted in chunks (box sizes) rather than elements."""
        return tuple(off // max(size, 1) for off, size in zip(self.global_offset, self.box_shape()))

    @property
    def has_regular_grid(self) -> bool:
        """Whether the tensor is cut on a regular grid (``axis_fragmentations`` is given)."""
        return self.axis_fragmentations is not None

    def narrow(self, dim: int, start: int, length: int) -> List["ShardedTensor"]:
        """``torch.narrow`` of the local tensor on every rank, as one ShardedTensor in a list.

        ``dim`` is a local axis (prepended axes not counted). Every rank narrows its own piece
        the same way, so the global tensor shrinks in proportion: global shape and offset on
        that axis are scaled by ``length / local size``, which needs a regular grid there.
        """
        if self.flattened_range is not None:
            raise CheckpointingException(f"{self.key!r}: narrow of a flattened ShardedTensor is not supported")
        axis = dim + self.prepend_axis_num
        local = self.local_shape[dim]
        glob, off = self.global_shape[axis], self.global_offset[axis]
        if local == 0 or glob % local != 0 or off % local != 0 or (glob * length) % local or (off * length) % local:
            raise CheckpointingException(
                f"{self.key!r}: narrow needs a regular grid on axis {dim}: global shape {self.global_shape} "
                f"and offset {self.global_offset} must be multiples of the local size {local}"
            )
        # narrow needs the data (a ShardedTensor without data fails here, as in megatron-core)
        data = cast(Any, self.data).narrow(dim, start, length)
        global_shape = self.global_shape[:axis] + (glob * length // local,) + self.global_shape[axis + 1 :]
        global_offset = self.global_offset[:axis] + (off * length // local,) + self.global_offset[axis + 1 :]
        return [
            replace(
                self,
                data=data,
                local_shape=tuple(data.shape),
                global_shape=global_shape,
                global_offset=global_offset,
            )
        ]

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """Chunk size along each global axis implied by ``axis_fragmentations``."""
        if self.axis_fragmentations is None:
            raise CheckpointingException(f"{self} has no axis_fragmentations (uneven sharding)")
        chunks = []
        for axis, (size, fragments) in enumerate(zip(self.global_shape, self.axis_fragmentations)):
            if not self.allow_shape_mismatch and size % fragments != 0:
                raise CheckpointingException(
                    f"{self.key!r}: axis {axis} of size {size} is not divisible into {fragments} fragments"
                )
            chunks.append(size // fragments)
        return tuple(chunks)

    def without_data(self) -> "ShardedTensor":
        return replace(self, data=None)

    def init_data(self, device: Any, init_fn: Optional[Callable[..., Any]] = None) -> None:
        """Allocates ``data`` (``init_fn``, default ``torch.empty``) if it is None."""
        if self.data is not None:
            return
        if init_fn is None:
            import torch

            init_fn = torch.empty
        data = init_fn(self.local_shape, dtype=self.dtype, device=device)
        if self.flattened_range is not None:
            data = data.flatten()[self.flattened_range.start : self.flattened_range.stop]
        self.data = data

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: Any,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: Any,
    ) -> "ShardedTensor":
        """Builds the ShardedTensor from offsets given in ranks.

        Each ``(axis, axis_rank_offset, axis_fragm)`` says: cut the global tensor into
        ``axis_fragm`` equal chunks along global ``axis``; ``data`` is chunk
        ``axis_rank_offset``. Axes ``< prepend_axis_num`` are the prepended ones (local size 1).
        """
        if flattened_range is not None:
            raise CheckpointingException(
                f"{key!r}: from_rank_offsets does not take flattened_range; use from_rank_offsets_flat"
            )
        shape = tuple(data.shape)
        global_shape, global_offset, fragmentations = _native.from_rank_offsets(
            key, shape, rank_offsets, prepend_axis_num
        )
        return cls(
            key,
            data,
            data.dtype,
            shape,
            global_shape,
            global_offset,
            fragmentations,
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: Any,
        non_flat_local_shape: Tuple[int, ...],
        *rank_offsets: Tuple[int, int, int],
        flattened_range: slice,
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        **init_kwargs: Any,
    ) -> "ShardedTensor":
        """Like from_rank_offsets for 1-D ``data`` holding ``flattened_range`` of a local
        tensor of shape ``non_flat_local_shape`` (e.g. a distributed-optimizer slice)."""
        if flattened_range is None:
            raise CheckpointingException(f"{key!r}: from_rank_offsets_flat needs a flattened_range")
        local_shape = _int_tuple(non_flat_local_shape, "non_flat_local_shape", key)
        global_shape, global_offset, fragmentations = _native.from_rank_offsets(
            key, local_shape, rank_offsets, prepend_axis_num
        )
        return cls(
            key,
            data,
            data.dtype,
            local_shape,
            global_shape,
            global_offset,
            fragmentations,
            replica_id,
            prepend_axis_num,
            flattened_range=flattened_range,
            **init_kwargs,
        )

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key={self.key!r})"


@dataclass
class ShardedObject(ShardedBase):
    """One process's piece of a global object that cannot be resharded.

    Conceptually a fully sharded ShardedTensor whose elements are arbitrary objects:
    ``global_offset`` counts shards, not elements, and loading needs the same sharding.
    """

    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.global_shape = _int_tuple(self.global_shape, "global_shape", self.key)
        self.global_offset = _int_tuple(self.global_offset, "global_offset", self.key)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        # Megatron's one check at construction, kept here: the core checks objects only when
        # they are saved or validated (with every rank's shards: offsets inside the grid, each
        # shard once), and has no check of one object alone to call.
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"{self.key!r}: global_shape {self.global_shape} and global_offset {self.global_offset} "
                "have different ranks"
            )

    def without_data(self) -> "ShardedObject":
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """Key of this particular shard: ``key/shard_<offset>_<shape>`` (dot-separated)."""
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> "ShardedObject":
        """The data-less ShardedObject a ``unique_key`` names."""
        key, _, shard = unique_key.rpartition("/")
        parts = shard.split("_")
        if not key or len(parts) != 3 or parts[0] != "shard":
            raise CheckpointingException(f"{unique_key!r} is not a ShardedObject unique key")

        def numbers(text: str) -> Tuple[int, ...]:
            return tuple(int(x) for x in text.split(".")) if text else ()

        return cls(key, None, numbers(parts[2]), numbers(parts[1]), replica_id)

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key={self.key!r})"
