"""Async save from Python: staged copies, background commit, requests and the calls queue."""

from __future__ import annotations

import threading
from typing import Any, Dict, List

import pytest
import torch

from tessera._launch import run_ranks
from tessera import dist_checkpointing as dc
from tessera.dist_checkpointing import AsyncCallsQueue, AsyncRequest, AsyncSaver, ShardedTensor
from tessera._core.staging import PinnedPool as _PinnedPool
from tessera.errors import InvalidShardingError


def truth(step: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(8, 64, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16)}


def state(t: Dict[str, torch.Tensor], rank: int = 0, world: int = 1) -> Dict[str, Any]:
    rows = 8 // world
    w = t["w"][rank * rows : (rank + 1) * rows].clone()
    return {
        "w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", t["b"].clone(), replica_id=rank),
        "step": 3,
    }


def assert_holds(ckpt: str, t: Dict[str, torch.Tensor]) -> None:
    plain = dc.load_plain_tensors(ckpt)
    for k, v in t.items():
        assert torch.equal(plain[k].view(torch.uint8), v.view(torch.uint8)), k


def test_tensors_may_change_once_save_returns(tmp_path: Any) -> None:
    t = truth(1)
    sd = state(t)
    saver = AsyncSaver(1 << 20)
    request = dc.save(sd, str(tmp_path / "c"), async_sharded_save=True, async_saver=saver)
    # The next optimizer step overwrites the parameters while the save writes in the background.
    sd["w"].data.mul_(-1)
    sd["b"].data.zero_()
    calls: List[int] = []
    request.add_finalize_fn(lambda: calls.append(1))
    report = request.finalize()
    assert report["chunks"] == 2 and calls == [1]
    assert request.finalize() is report and calls == [1]  # finalizing again runs nothing twice
    assert_holds(str(tmp_path / "c"), t)
    assert 0 < saver.peak_bytes_in_use <= saver.capacity
    assert saver.is_idle()


def test_a_state_larger_than_the_budget_is_staged_in_waves(tmp_path: Any) -> None:
    g = torch.Generator().manual_seed(5)
    big = torch.randn(256, 4096, generator=g)  # 4 MiB, in 1 MiB checksum blocks
    saver = AsyncSaver(2 << 20, buffer_size=1 << 20)
    sd = {"big": ShardedTensor.from_rank_offsets("big", big.clone())}
    request = dc.save(sd, str(tmp_path / "w"), async_sharded_save=True, async_saver=saver)
    request.finalize()
    assert saver.capacity == 2 << 20 and saver.peak_bytes_in_use <= saver.capacity
    assert torch.equal(dc.load_plain_tensors(str(tmp_path / "w"))["big"], big)


def test_the_queue_finalizes_in_order_without_blocking(tmp_path: Any) -> None:
    queue = AsyncCallsQueue()
    saver = AsyncSaver(1 << 20)
    truths = [truth(s) for s in range(3)]
    order: List[int] = []
    for s, t in enumerate(truths):
        req = dc.save(state(t), str(tmp_path / f"s{s}"), async_sharded_save=True, async_saver=saver)
        req.add_finalize_fn(lambda s=s: order.append(s))
        assert queue.schedule_async_request(req) == s
    finalized: List[int] = []
    while queue.get_num_unfinalized_calls():
        finalized += queue.maybe_finalize_async_calls(blocking=False)
    assert finalized == [0, 1, 2] and order == [0, 1, 2]
    for s, t in enumerate(truths):
        assert_holds(str(tmp_path / f"s{s}"), t)
    queue.close()


def test_errors_found_before_writing_raise_from_save(tmp_path: Any) -> None:
    t = truth(2)
    sd = state(t)
    sd["w2"] = ShardedTensor("w", t["w"], torch.float32, (8, 64), (8, 64), (0, 0), None)  # overlaps "w"
    with pytest.raises(InvalidShardingError):
        dc.save(sd, str(tmp_path / "bad"), async_sharded_save=True, async_saver=AsyncSaver(1 << 20))


def test_the_pinned_pool_reuses_buffers() -> None:
    pool = _PinnedPool(pin=False)  # page-locking needs CUDA; the reuse logic is the same
    a = pool.take(10, torch.float32)
    b = pool.take(10, torch.float32)
    assert a.data_ptr() != b.data_ptr()
    pool.give_back_all()
    again = {pool.take(10, torch.float32).data_ptr() for _ in range(2)}
    assert again == {a.data_ptr(), b.data_ptr()}
    assert pool.held_bytes() == 80


def _async_ranks(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    main = threading.main_thread()
    collectives: Dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in ("all_gather", "broadcast", "all_reduce", "barrier")}

    def counting(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is main:
                collectives[name] = collectives.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapped

    queue = AsyncCallsQueue()
    truths = [truth(10 + s) for s in range(2)]
    for s, t in enumerate(truths):
        sd = state(t, rank, world)
        queue.schedule_async_request(dc.save(sd, f"{root}/step{s}", async_sharded_save=True))
        sd["w"].data.fill_(float("nan"))  # the caller's next step
    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    try:
        finalized: List[int] = []
        polls = 0
        while queue.get_num_unfinalized_calls():
            finalized += queue.maybe_finalize_async_calls(blocking=False)
            polls += 1
        assert finalized == [0, 1]
        # One agreement per request looked at (as Megatron's queue), nothing else: the
        # commit's own collectives run on the saver's group, off the training thread.
        assert set(collectives) <= {"all_reduce"}, collectives
        assert polls <= collectives.get("all_reduce", 0) <= polls + 2
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    counts = [None] * world
    dist.all_gather_object(counts, collectives.get("all_reduce", 0))
    assert len(set(counts)) == 1, f"ranks polled out of step: {counts}"
    dist.barrier()
    if rank == 0:
        for s, t in enumerate(truths):
            assert_holds(f"{root}/step{s}", t)


def test_async_save_across_processes_polls_in_step(tmp_path: Any) -> None:
    run_ranks(2, _async_ranks, str(tmp_path))


class _Call:
    """A Megatron-shaped request (as nvidia-resiliency-ext makes them): ``async_fn`` runs in
    the background, for longer on one rank than on the other."""

    def __init__(self, seconds: float) -> None:
        import time

        self.async_fn = time.sleep
        self.async_fn_args = (seconds,)
        self.preload_fn = None
        self.finalize_fns: List[Any] = []


def _mixed_queue_ranks(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    queue = AsyncCallsQueue()
    for s in range(3):
        sd = state(truth(30 + s), rank, world)
        # A native save, then a request of Megatron's shape that one rank finishes later.
        queue.schedule_async_request(dc.save(sd, f"{root}/step{s}", async_sharded_save=True))
        queue.schedule_async_request(_Call(0.0 if rank == 0 else 0.05))
        for _ in range(40):
            queue.maybe_finalize_async_calls(blocking=False)
            grad = torch.tensor([10.0])
            dist.all_reduce(grad)  # the training step's gradient all-reduce
            assert grad.item() == 10.0 * world, f"the training all-reduce met a queue collective: {grad.item()}"
    queue.maybe_finalize_async_calls(blocking=True)
    dist.barrier()


def test_a_queue_of_both_kinds_keeps_ranks_in_step(tmp_path: Any) -> None:
    """Every rank finalizes a request at the same poll, whatever its kind: no rank's poll
    all-reduce pairs with another rank's training collective."""
    run_ranks(2, _mixed_queue_ranks, str(tmp_path))


def test_the_strategy_saves_async_and_sync(tmp_path: Any) -> None:
    strategy = dc.strategies.TesseraSaveShardedStrategy()
    assert isinstance(strategy, dc.AsyncSaveShardedStrategy)
    t = truth(7)
    request = strategy.async_save(state(t), str(tmp_path / "a"))
    assert isinstance(request, AsyncRequest)
    request.finalize()
    assert_holds(str(tmp_path / "a"), t)
    strategy.save(state(t), str(tmp_path / "s"))
    assert_holds(str(tmp_path / "s"), t)


def _parallel_load(rank: int, world: int, root: str) -> None:
    from tessera import _native
    from tessera._core.comm import TorchComm

    t = truth(20)
    # Every rank wants the whole state (data-parallel replicas loading the same weights).
    want = {
        "w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 64)),
        "b": ShardedTensor.from_rank_offsets("b", torch.empty(64, dtype=torch.bfloat16)),
    }
    strategy = dc.FullyParallelLoadStrategyWrapper(dc.strategies.TesseraLoadShardedStrategy())
    loaded = dc.load(want, f"{root}/ckpt", sharded_strategy=strategy)
    for k, v in t.items():
        assert torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)), k
    # The communicator's all_to_all is a real personalized exchange.
    got = TorchComm().all_to_all([bytes([rank, r]) * (r + 1) for r in range(world)])
    assert got == [bytes([r, rank]) * (rank + 1) for r in range(world)]
    # The ranks together read the bytes once; each got the rest from its peer.
    sh = [
        _native.LoadTensor(key="w", dtype="f32", local_shape=(8, 64), global_shape=(8, 64), global_offset=(0, 0),
                           data_ptr=want["w"].data.data_ptr(), nbytes=8 * 64 * 4)
    ]
    out = _native.load(sh, [], f"{root}/ckpt", TorchComm(), exchange_reads=True)
    stats = out["stats"]
    assert stats["bytes_read"] + stats["bytes_received"] == stats["bytes_needed"]
    import torch.distributed as dist

    reads = [None] * world
    dist.all_gather_object(reads, stats["bytes_read"])
    assert sum(reads) == stats["bytes_needed"], reads


def test_fully_parallel_load_reads_each_byte_once_across_processes(tmp_path: Any) -> None:
    t = truth(20)
    dc.save(state(t), str(tmp_path / "ckpt"))
    run_ranks(2, _parallel_load, str(tmp_path))


def test_the_fully_parallel_save_wrapper_saves_like_the_base_strategy(tmp_path: Any) -> None:
    base = dc.strategies.TesseraSaveShardedStrategy()
    wrapper = dc.FullyParallelSaveStrategyWrapper(base)
    t = truth(21)
    dc.save(state(t), str(tmp_path / "s"), sharded_strategy=wrapper)
    assert_holds(str(tmp_path / "s"), t)
    wrapper.async_save(state(t), str(tmp_path / "a")).finalize()
    assert_holds(str(tmp_path / "a"), t)


def test_queue_runs_a_megatron_shaped_request(caplog):
    # nvidia-resiliency-ext's local checkpointing hands Megatron's queue its own (immutable)
    # AsyncRequest: async_fn in the background, preload_fn's result as the second argument,
    # finalize functions at finalization.
    from collections import namedtuple

    from tessera.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    Req = namedtuple("Req", "async_fn async_fn_args finalize_fns async_fn_kwargs preload_fn is_frozen call_idx")
    calls = []
    req = Req(
        async_fn=lambda a, state, k=None: calls.append(("run", a, state, k)),
        async_fn_args=("x", None),
        finalize_fns=[lambda: calls.append("finalized")],
        async_fn_kwargs={"k": 3},
        preload_fn=lambda: "preloaded",
        is_frozen=False,
        call_idx=None,
    )
    queue = AsyncCallsQueue()
    assert queue.schedule_async_request(req) == 0
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert calls == [("run", "x", "preloaded", 3), "finalized"]

    def boom(*_, **__):
        raise OSError("disk full")

    # A failure is logged and the finalize functions still run (they check, as Megatron's do).
    calls.clear()
    queue.schedule_async_request(req._replace(async_fn=boom, preload_fn=None))
    with caplog.at_level("ERROR"):
        assert queue.maybe_finalize_async_calls(blocking=True) == [1]
    assert calls == ["finalized"] and "disk full" in caplog.text
