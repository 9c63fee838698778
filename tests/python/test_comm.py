"""The torch.distributed communicator keeps the tensors it hands to collectives referenced from
Python until torch's worker threads have let go of them (else a rank exiting right after a
save could abort in gloo's worker: SIGABRT at interpreter exit)."""

from __future__ import annotations

import time

import torch

from tessera._core import comm as _comm


def test_held_tensors_stay_until_torch_lets_go() -> None:
    _comm._in_flight.clear()
    used = torch.zeros(3, requires_grad=True)
    kept_by_torch = used.sin()  # autograd keeps a C++ reference to `used`, as a worker would
    done = torch.zeros(3)
    _comm._hold(used, done)
    _comm._hold()  # the next collective prunes what only Python still holds
    assert [t is used for t in _comm._in_flight] == [True]
    del kept_by_torch
    _comm._hold()
    assert _comm._in_flight == []


def test_exit_waits_for_torch_then_clears() -> None:
    _comm._in_flight.clear()
    used = torch.zeros(3, requires_grad=True)
    kept_by_torch = used.sin()
    _comm._hold(used)
    start = time.monotonic()
    _comm._release_at_exit(timeout=0.2)  # torch never lets go here: waits out the timeout
    assert time.monotonic() - start >= 0.2 and _comm._in_flight == []
    del kept_by_torch
    _comm._hold(torch.zeros(1))
    start = time.monotonic()
    _comm._release_at_exit(timeout=5.0)  # nothing in use: returns at once
    assert time.monotonic() - start < 1.0 and _comm._in_flight == []
