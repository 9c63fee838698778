"""A tensor's place in its global tensor: local data, global shape, offset, replica.

A plain tensor is whole (offset 0) and every rank's copy is a replica of the others; a DTensor
says its place through its mesh and placements (``Shard``, ``_StridedShard`` where it makes one
box, as FSDP2 over tensor parallelism does, and ``Replicate``, uneven shards included). ``cpu_contiguous`` is the host memory the core reads from or writes into.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Sequence, Tuple

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

    strided = False
    for p in t.placements:
        if p.is_partial():
            raise ValueError("a DTensor with a Partial placement holds no defined values; redistribute it first")
        if _is_strided(p):
            strided = True
        elif not (p.is_shard() or p.is_replicate()):
            raise ValueError(f"unsupported DTensor placement {p!r} (supported: Shard, _StridedShard, Replicate)")
    local = t.to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"DTensor local shape {tuple(local.shape)} differs from its placement's {tuple(shape)}")
    coord: Sequence[int] = t.device_mesh.get_coordinate() or []
    if strided:
        _check_one_box(t, coord, tuple(shape), tuple(offset))
    replica = tuple(int(coord[i]) for i, p in enumerate(t.placements) if p.is_replicate()) or (0,)
    return local, tuple(t.shape), tuple(int(x) for x in offset), replica


def _is_strided(p: Any) -> bool:
    """Whether ``p`` is torch's ``_StridedShard`` (FSDP2 over tensor parallelism shards a
    dimension TP already sharded: the rank's rows come from each of ``split_factor`` chunks)."""
    return type(p).__name__ == "_StridedShard"


def _chunks(indices: List[int], n: int) -> List[List[int]]:
    """``indices`` cut as ``torch.chunk`` cuts a dimension into ``n``: pieces of ceil(len/n),
    the last ones shorter or empty."""
    size = -(-len(indices) // n) if indices else 0
    return [indices[i * size : (i + 1) * size] for i in range(n)]


def _check_one_box(t: Any, coord: Sequence[int], shape: Tuple[int, ...], offset: Tuple[int, ...]) -> None:
    """A DTensor with a ``_StridedShard`` placement holds, per dimension, the global indices
    its placements pick in mesh order (a strided shard takes its piece of each of its
    ``split_factor`` chunks). Where FSDP2 shards over TP these indices are consecutive, and the
    local tensor is the box torch's offset names; where they are not, the local tensor is no
    box of the global one, which a checkpoint's chunks must be, and it is refused here rather
    than saved or filled wrongly."""
    picked = {d: list(range(n)) for d, n in enumerate(t.shape)}
    for mesh_dim, p in enumerate(t.placements):
        if not (p.is_shard() or _is_strided(p)):
            continue
        n, c = t.device_mesh.size(mesh_dim), int(coord[mesh_dim])
        if _is_strided(p):
            split = _chunks(picked[p.dim], int(p.split_factor))
            picked[p.dim] = [i for part in split for i in _chunks(part, n)[c]]
        else:
            picked[p.dim] = _chunks(picked[p.dim], n)[c]
    for d, idx in picked.items():
        box = list(range(offset[d], offset[d] + shape[d]))
        if idx != box and shape[d] > 0:
            raise ValueError(
                f"unsupported DTensor layout {tuple(t.placements)}: dimension {d} of this rank's shard holds global "
                f"indices {idx[:4]}{'…' if len(idx) > 4 else ''}, not one run {offset[d]}..{offset[d] + shape[d]}; "
                "redistribute it to Shard/Replicate placements first"
            )


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
