"""The communicator tessera's native layer calls for its small metadata exchanges.

Under ``torch.distributed`` the exchanges are torch collectives on the given (or default)
process group; with no initialized process group a single process needs none.
Messages travel as uint8 tensors (no pickling): sizes are gathered first, then the payloads
padded to the largest.
"""

from __future__ import annotations

import atexit
import ctypes
import time
from typing import Any, List, Optional

# Tensors handed to torch collectives, kept referenced from Python until torch's own worker
# thread has let go of them too. gloo's worker drops its last reference to a finished
# collective a moment after the caller returns; if Python has dropped its references by then,
# that drop needs the GIL, and at interpreter exit (a rank returning right after a save) the
# worker is killed while taking it: "terminate called without an active exception", SIGABRT.
_in_flight: List[Any] = []


def _host_bytes(t: Any, n: int) -> bytes:
    """The first ``n`` bytes of a uint8 tensor, on the host. Read through its address, not
    ``.numpy()``: numpy is not a dependency of torch, and torch without it cannot convert."""
    host = t[:n].cpu().contiguous()
    return ctypes.string_at(host.data_ptr(), n) if n else b""


def _hold(*tensors: Any) -> None:
    """Keeps ``tensors`` referenced until torch no longer uses them (see ``_in_flight``)."""
    _in_flight[:] = [t for t in _in_flight if t._use_count() > 1]
    _in_flight.extend(tensors)


@atexit.register
def _release_at_exit(timeout: float = 5.0) -> None:
    """Waits (briefly) for torch's workers to let go of the held tensors before Python exits."""
    deadline = time.monotonic() + timeout
    while any(t._use_count() > 1 for t in _in_flight) and time.monotonic() < deadline:
        time.sleep(0.001)
    _in_flight.clear()


class TorchComm:
    """tessera communicator over a ``torch.distributed`` process group."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        # gloo moves CPU tensors; NCCL needs them on the current device.
        backend = dist.get_backend(group)
        self._device = "cpu"
        if backend == "nccl":
            import torch

            self._device = f"cuda:{torch.cuda.current_device()}"

    def rank(self) -> int:
        return self._dist.get_rank(self._group)

    def world_size(self) -> int:
        return self._dist.get_world_size(self._group)

    def all_gather(self, data: bytes) -> List[bytes]:
        import torch

        world = self.world_size()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self._device) for _ in range(world)]
        self._dist.all_gather(sizes, size, group=self._group)
        _hold(size, *sizes)
        lengths = [int(s.item()) for s in sizes]
        longest = max(lengths) if lengths else 0
        mine = torch.zeros(max(longest, 1), dtype=torch.uint8, device=self._device)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(world)]
        self._dist.all_gather(out, mine, group=self._group)
        _hold(mine, *out)
        return [_host_bytes(t, n) for t, n in zip(out, lengths)]

    def all_to_all(self, messages: List[bytes]) -> List[bytes]:
        """``messages[r]`` goes to rank ``r``; returns what each rank sent here (sizes first,
        then one ``all_to_all_single`` of the payloads)."""
        import torch

        world = self.world_size()
        if len(messages) != world:
            raise ValueError(f"all_to_all: {len(messages)} messages for {world} ranks")
        sizes = torch.tensor([len(m) for m in messages], dtype=torch.int64, device=self._device)
        incoming = torch.empty(world, dtype=torch.int64, device=self._device)
        self._dist.all_to_all_single(incoming, sizes, group=self._group)
        _hold(incoming, sizes)
        recv_sizes = [int(n) for n in incoming.tolist()]
        payload = b"".join(messages)
        send = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
        send = send.to(self._device)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self._device)
        self._dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=recv_sizes,
            input_split_sizes=[len(m) for m in messages],
            group=self._group,
        )
        _hold(recv, send)
        out, at = [], 0
        data = _host_bytes(recv, recv.numel())
        for n in recv_sizes:
            out.append(data[at : at + n])
            at += n
        return out

    def broadcast(self, data: bytes, root: int) -> bytes:
        import torch

        src = self._dist.get_global_rank(self._group, root) if self._group is not None else root
        size = torch.tensor([len(data) if self.rank() == root else 0], dtype=torch.int64, device=self._device)
        self._dist.broadcast(size, src=src, group=self._group)
        _hold(size)
        n = int(size.item())
        buf = torch.zeros(max(n, 1), dtype=torch.uint8, device=self._device)
        if self.rank() == root and n:
            buf[:n] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._dist.broadcast(buf, src=src, group=self._group)
        _hold(buf)
        return _host_bytes(buf, n)


def initialized_dist() -> Any:
    """``torch.distributed`` when a process group is initialized; None without torch, without
    distributed support, or before ``init_process_group`` (one process, nothing to exchange)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def default_comm(process_group: Any = None, no_dist: bool = False) -> Optional[TorchComm]:
    """The communicator for ``process_group`` (default group), or None for a single process."""
    if no_dist or initialized_dist() is None:
        return None
    return TorchComm(process_group)


def commit_comm(process_group: Any = None) -> Optional[TorchComm]:
    """A communicator of its own for async commits: a gloo group of ``process_group``'s ranks
    (default: all), so that a background commit never meets training traffic; None for a
    single process. Collective: every rank of the group calls it at the same point."""
    dist = initialized_dist()
    if dist is None:
        return None
    ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
    group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=ranks is not None)
    return TorchComm(group)
