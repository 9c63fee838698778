"""`tessera.torch.CheckpointManager` across real processes over torch.distributed (gloo): 8
ranks on 4 simulated nodes, a memory root each. Any 2 nodes' roots deleted → the newest step
restored bit-exact from memory; 3 → from the persistent tier, saying why; a rank killed with
SIGKILL during a save → the newest complete step; 4 ranks → the persistent tier, resharded.
(The same over MPI from Rust: scripts/ci/memory_tier_processes.sh.)"""

from __future__ import annotations

import os
import shutil
import signal
from typing import Any, Dict

import pytest
import torch

from tessera._launch import run_ranks
import tessera.torch as tt

ROWS, COLS = 64, 48


def full_w(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + step


def state(world: int, step: int) -> Dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(full_w(step), mesh, [Shard(0)])
    return {"model": {"w": w, "bias": torch.full((7,), float(step))}, "step": step, "note": f"at {step}"}


def manager(root: str, rank: int, world: int) -> tt.CheckpointManager:
    node = f"node{rank * 4 // world}"
    return tt.CheckpointManager(
        os.path.join(root, node),
        os.path.join(root, "persistent"),
        every=1,
        persist_every=3,
        keep_last=2,
        redundancy=(2, 2),
        node=node,
        chunk_bytes=4096,
        staging_bytes=8 << 20,
    )


def _train(rank: int, world: int, root: str, steps: int, kill_rank: int) -> None:
    mgr = manager(root, rank, world)
    for step in range(1, steps + 1):
        if kill_rank >= 0 and step == steps:
            mgr.wait()
            torch.distributed.barrier()
        assert mgr.save(step, state(world, step))
        if rank == kill_rank and step == steps:
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.wait()


def _restore(rank: int, world: int, root: str, min_step: int, tier: str, out: str) -> None:
    mgr = manager(root, rank, world)
    sd = state(world, 0)
    got = mgr.restore(sd)
    assert got is not None
    step = got["step"]
    assert got["tier"] == tier and step >= min_step, got
    assert torch.equal(sd["model"]["w"].full_tensor(), full_w(step))
    assert torch.equal(sd["model"]["bias"], torch.full((7,), float(step)))
    assert sd["step"] == step and sd["note"] == f"at {step}"
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr(got))


def _restored(tmp: Any, root: str, world: int, min_step: int, tier: str) -> str:
    out = str(tmp / "restored.txt")
    run_ranks(world, _restore, root, min_step, tier, out)
    with open(out) as f:
        return f.read()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: Any) -> str:
    root = str(tmp_path_factory.mktemp("memtier") / "job")
    run_ranks(8, _train, root, 7, -1)
    return root


def _copy(trained: str, tmp: Any, lost: list) -> str:
    root = str(tmp / "case")
    shutil.copytree(trained, root)
    for n in lost:
        shutil.rmtree(os.path.join(root, f"node{n}"))
    return root


@pytest.mark.parametrize("lost", [[0, 1], [1, 3]])
def test_two_lost_nodes_restore_bit_exact_from_memory(trained: str, tmp_path: Any, lost: list) -> None:
    got = _restored(tmp_path, _copy(trained, tmp_path, lost), 8, 7, "memory")
    rebuilt = sorted(r for n in lost for r in (2 * n, 2 * n + 1))
    assert f"'rebuilt_ranks': {rebuilt}" in got, got


def test_three_lost_nodes_fall_back_to_the_persistent_tier(trained: str, tmp_path: Any) -> None:
    got = _restored(tmp_path, _copy(trained, tmp_path, [0, 2, 3]), 8, 6, "persistent")
    assert "more than its 2 parity" in got and "restoring step 6 from the persistent tier" in got, got


def test_another_world_size_restores_from_the_persistent_tier(trained: str, tmp_path: Any) -> None:
    got = _restored(tmp_path, _copy(trained, tmp_path, []), 4, 6, "persistent")
    assert "saved by 8 ranks" in got, got


def test_a_rank_killed_during_a_save_restores_the_newest_complete_step(tmp_path: Any) -> None:
    root = str(tmp_path / "killed")
    with pytest.raises(Exception):
        run_ranks(8, _train, root, 4, 5)
    _restored(tmp_path, root, 8, 3, "memory")


def _tied(step: int) -> Dict[str, Any]:
    emb = torch.arange(32, dtype=torch.float32).reshape(8, 4) + step
    return {"model": {"emb": emb, "head": emb}, "step": step}


def _tied_and_dropped(rank: int, world: int, root: str) -> None:
    import faulthandler
    import gc

    # A hang (the drop waiting for background work that needs the GIL) ends the process.
    faulthandler.dump_traceback_later(120, exit=True)

    def mgr() -> tt.CheckpointManager:
        return tt.CheckpointManager(os.path.join(root, f"node{rank}"), None, redundancy=(1, 1), node=f"node{rank}")

    m = mgr()
    for step in range(1, 4):
        assert m.save(step, _tied(step))
    del m  # background work still queued: dropping waits for it without holding the GIL
    gc.collect()
    sd = _tied(0)
    with mgr() as m:
        got = m.restore(sd)
        # The tied pair was saved once, as the restore describes it: the step restores from
        # memory (a layout mismatch would find no step to restore).
        assert got is not None and (got["step"], got["tier"]) == (3, "memory"), got
        assert sd["model"]["head"] is sd["model"]["emb"] and torch.equal(sd["model"]["emb"], _tied(3)["model"]["emb"])
        assert m.save(4, _tied(4))
    with pytest.raises(ValueError, match="closed"):
        m.wait()
    m.close()  # closing twice does nothing
    faulthandler.cancel_dump_traceback_later()


def test_tied_tensors_restore_from_memory_and_a_dropped_manager_finishes_its_work(tmp_path: Any) -> None:
    run_ranks(2, _tied_and_dropped, str(tmp_path / "tied"))


_LEFT_OPEN = []


def _saved_and_left_open(rank: int, world: int, port: int, root: str) -> None:
    import faulthandler

    # A hang at exit ends the process (and fails the test) instead of the run.
    faulthandler.dump_traceback_later(120, exit=True)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    m = tt.CheckpointManager(os.path.join(root, f"node{rank}"), None, redundancy=(1, 1), node=f"node{rank}")
    for step in range(1, 4):
        assert m.save(step, _big(step))
    # Neither closed nor waited for, the process group left standing: the interpreter exits
    # with the copies and parity of 16 MiB states still queued.
    _LEFT_OPEN.append(m)


def _big(step: int) -> Dict[str, Any]:
    return {"w": torch.arange(1 << 22, dtype=torch.float32) + step}


def _restores_step_3(rank: int, world: int, root: str) -> None:
    sd = _big(0)
    with tt.CheckpointManager(os.path.join(root, f"node{rank}"), None, redundancy=(1, 1), node=f"node{rank}") as m:
        got = m.restore(sd)
        assert got is not None and (got["step"], got["tier"]) == (3, "memory"), got
        assert torch.equal(sd["w"], _big(3)["w"])


def test_a_manager_left_open_at_interpreter_exit_finishes_its_work(tmp_path: Any) -> None:
    import torch.multiprocessing as mp

    from tessera._launch import free_port

    root = str(tmp_path / "open")
    mp.start_processes(
        _saved_and_left_open, args=(2, free_port(), root), nprocs=2, join=True, start_method="spawn"
    )
    run_ranks(2, _restores_step_3, root)
