"""A tensor's place in its global tensor: local data, global shape, offset, replica.

A plain tensor is whole (offset 0) and every rank's copy is a replica of the others; a DTensor
says its place through its mesh and placements (``Shard`` and ``Replicate``, uneven shards
included). ``cpu_contiguous`` is the host memory the core reads from or writes into.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence, Tuple

if TYPE_CHECKING:
    import torch
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeGuard

__all__ = ["is_dtensor", "layout", "cpu_contiguous"]


def is_dtensor(t: Any) -> "TypeGuard[DTensor]":
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def layout(t: "torch.Tensor", rank: int) -> Tuple["torch.Tensor", Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """(local tensor, global shape, global offset, replica id) of a tensor or DTensor."""
    if not is_dtensor(t):
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
    coord: Sequence[int] = t.device_mesh.get_coordinate() or []
    replica = tuple(int(coord[i]) for i, p in enumerate(t.placements) if p.is_replicate()) or (0,)
    return local, tuple(t.shape), tuple(int(x) for x in offset), replica


def cpu_contiguous(t: Any, copy: bool = False) -> Any:
    """The tensor as CPU C-contiguous memory: CUDA tensors are staged to host (a copy), and
    non-contiguous tensors are copied into a contiguous one; ``copy``: always a copy (an async
    save writes after the caller has moved on)."""
    if copy:
        import torch

        return t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
    if t.device.type != "cpu":
        t = t.detach().to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    return t.detach()
