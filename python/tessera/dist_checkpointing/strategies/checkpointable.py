"""ShardedTensors that PyTorch DCP itself can save and load (Megatron-Core's
``strategies.checkpointable``).

``torch.distributed.checkpoint`` asks a tensor subclass implementing its ``_Checkpointable``
protocol (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``) where
its piece lies in the global tensor. These wrappers answer from the ShardedTensor's box, so a
state dict of them goes through plain ``dcp.save`` / ``dcp.load`` (torch >= 2.6), and the
loaded bytes land in the ShardedTensor's own ``data``. tessera's engine is not involved: this
is for code that drives DCP directly.
"""

from __future__ import annotations

from typing import Any, List, Optional, cast

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..mapping import ShardedTensor

__all__ = ["CheckpointableShardedTensor", "LocalShardsContainer"]


def _box(sh_ten: ShardedTensor) -> ChunkStorageMetadata:
    """The ShardedTensor's box as DCP's chunk (global offset, local shape)."""
    if sh_ten.flattened_range is not None or sh_ten.prepend_axis_num:
        raise ValueError(
            f"{sh_ten.key!r}: DCP's checkpointable protocol takes a plain box (no flattened_range, "
            "no prepended axes)"
        )
    if sh_ten.data is None or tuple(sh_ten.data.shape) != tuple(sh_ten.local_shape):
        raise ValueError(f"{sh_ten.key!r}: data of shape {tuple(sh_ten.local_shape)} is needed")
    return ChunkStorageMetadata(offsets=torch.Size(sh_ten.global_offset), sizes=torch.Size(sh_ten.local_shape))


class _NoOps(torch.Tensor):
    """A metadata-only tensor subclass: DCP reads its protocol methods, nothing computes on it."""

    # torch's stubs type Tensor.__torch_dispatch__ as a plain function (the disabled default);
    # subclasses define it as a classmethod, as torch documents.
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise TypeError(f"{cls.__name__} holds checkpoint metadata; tensor operations ({func}) are not defined on it")


class CheckpointableShardedTensor(_NoOps):
    """One ShardedTensor as a DCP-checkpointable tensor of the global shape."""

    _sh_ten: ShardedTensor

    @staticmethod
    def __new__(cls, data: Optional[torch.Tensor], sh_ten: ShardedTensor) -> "CheckpointableShardedTensor":
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(sh_ten.global_shape), dtype=sh_ten.dtype)

    def __init__(self, data: Optional[torch.Tensor], sh_ten: ShardedTensor) -> None:
        self._data = data
        self._sh_ten = sh_ten

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> "CheckpointableShardedTensor":
        """Wraps ``sh_ten`` (its ``data`` is what is saved, and loaded into)."""
        if not isinstance(sh_ten, ShardedTensor):
            raise TypeError(f"expected a ShardedTensor, got {type(sh_ten).__name__}")
        return cls(sh_ten.data, sh_ten)

    def __create_write_items__(
        self, fqn: str, sh_ten: "CheckpointableShardedTensor", index: Optional[int] = None
    ) -> List[WriteItem]:
        """DCP's write item of this piece: one shard at the ShardedTensor's box."""
        chunk = _box(sh_ten._sh_ten)
        assert sh_ten._sh_ten.data is not None  # _box raised otherwise
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets, index),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(sh_ten._sh_ten.data),
                    size=torch.Size(sh_ten._sh_ten.global_shape),
                ),
            )
        ]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        """The one chunk this rank loads: the ShardedTensor's box."""
        return [_box(self._sh_ten)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The memory of this piece (saved from, loaded into)."""
        # DCP asks for it after __create_write_items__ / __create_chunk_list__, whose _box
        # required the data.
        return cast(torch.Tensor, self._sh_ten.data)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._sh_ten})"


class LocalShardsContainer(_NoOps):
    """Several pieces of one global tensor held by one rank, as the single tensor per key DCP
    expects; each piece is a CheckpointableShardedTensor."""

    @staticmethod
    def __new__(cls, local_shards: List[torch.Tensor]) -> "LocalShardsContainer":
        if not local_shards:
            raise ValueError("LocalShardsContainer needs at least one shard")
        first = local_shards[0]
        return torch.Tensor._make_wrapper_subclass(cls, first.size(), dtype=first.dtype)

    def __init__(self, local_shards: List[torch.Tensor]) -> None:
        for shard in local_shards:
            if not isinstance(shard, CheckpointableShardedTensor):
                raise TypeError(f"LocalShardsContainer holds CheckpointableShardedTensors, got {type(shard).__name__}")
        # every shard was just checked to be a CheckpointableShardedTensor
        self._local_shards = cast(List[CheckpointableShardedTensor], list(local_shards))

    def __create_write_items__(self, fqn: str, container: "LocalShardsContainer") -> List[WriteItem]:
        """The write items of every piece, numbered so DCP tells them apart."""
        return [
            item
            for i, shard in enumerate(container._local_shards)
            for item in shard.__create_write_items__(fqn, shard, index=i)
        ]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        """Every piece's chunk."""
        return [chunk for shard in self._local_shards for chunk in shard.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The piece at ``index.offset`` (the hint ``index.index`` is tried first)."""
        # (as for one piece: DCP asks after __create_*__, whose _box required the data)
        want = tuple(index.offset) if index.offset is not None else None
        hinted = index.index
        if hinted is not None and 0 <= hinted < len(self._local_shards):
            shard = self._local_shards[hinted]
            if want is None or tuple(shard._sh_ten.global_offset) == want:
                return cast(torch.Tensor, shard._sh_ten.data)
        for shard in self._local_shards:
            if tuple(shard._sh_ten.global_offset) == want:
                return cast(torch.Tensor, shard._sh_ten.data)
        raise ValueError(f"no local shard at offset {want} of {index.fqn!r}")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({len(self._local_shards)} shards)"
