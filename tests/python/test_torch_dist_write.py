"""tessera's Rust writer of Megatron ``torch_dist`` checkpoints (``_native.save_torch_dist``),
read by torch itself: ``torch.distributed.checkpoint.load`` on one process loads what two gloo
ranks wrote (split differently from how they held it) with exact values, sharded objects
included; ``torch.load`` reads ``common.pt``. (megatron-core's own load of the same layout:
``scripts/interop/check_torch_dist_interop.py``.)"""

from __future__ import annotations

import io
import json
import os
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tessera import _native
from tessera._core.comm import default_comm
from tessera._core.descriptors import save_object, save_tensor
from tessera._launch import run_ranks


def full_tensors() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "decoder.qkv.weight": torch.randn(8, 6, generator=g),
        "embedding.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "decoder.proj.weight": torch.randn(3, 10, generator=g).to(torch.float16),
        "decoder.norm.weight": torch.randn(5, generator=g),
        "step": torch.tensor(17, dtype=torch.int64),
    }


def _tuple(
    key: str, local: torch.Tensor, full: torch.Tensor, offset: List[int], replica: int, keep: List[Any]
) -> _native.SaveTensor:
    local = local.contiguous()
    keep.append(local)
    return save_tensor(key, local.dtype, local.shape, full.shape, offset, replica_id=replica, data=local)


def _object_payload(value: Any) -> bytes:
    """A plain value as tessera's Python layer tags it (``TSV1``), anything else as ``TPT1`` +
    ``torch.save(obj)``: the writer wraps it in the one-element list Megatron stores."""
    try:
        return b"TSV1" + _native.encode_value(value)
    except TypeError:
        buf = io.BytesIO()
        torch.save(value, buf)
        return b"TPT1" + buf.getvalue()


def rng_state(rank: int) -> Any:
    if rank == 0:
        return {"rank": 0, "seed": b"\x00\xff"}
    return {"rank": rank, "generator": torch.arange(4, dtype=torch.uint8) + rank}


def _save(rank: int, world: int, path: str) -> None:
    full = full_tensors()
    keep: List[Any] = []
    tensors = []
    q = full["decoder.qkv.weight"]  # split on axis 0
    rows = q.shape[0] // world
    tensors.append(_tuple("decoder.qkv.weight", q[rank * rows : (rank + 1) * rows], q, [rank * rows, 0], 0, keep))
    e = full["embedding.weight"]  # split on axis 1
    cols = e.shape[1] // world
    tensors.append(_tuple("embedding.weight", e[:, rank * cols : (rank + 1) * cols], e, [0, rank * cols], 0, keep))
    p = full["decoder.proj.weight"]  # uneven split on axis 1
    a, b = (0, 7) if rank == 0 else (7, 10)
    tensors.append(_tuple("decoder.proj.weight", p[:, a:b], p, [0, a], 0, keep))
    for key in ("decoder.norm.weight", "step"):  # replicated: every rank holds it
        t = full[key]
        tensors.append(_tuple(key, t, t, [0] * t.dim(), rank, keep))
    objects = [save_object("rng_state", (world,), (rank,), 0, _object_payload(rng_state(rank)))]
    common_pt = None
    if rank == 0:
        buf = io.BytesIO()
        torch.save({"iteration": 3, "args": {"lr": 0.5, "name": "tiny"}}, buf)
        common_pt = buf.getvalue()
    report = _native.save_torch_dist(tensors, objects, common_pt, path, default_comm())
    assert report["file"] == f"__{rank}_0.distcp"
    assert report["files"] == world
    assert (report["index_bytes"] > 0) == (rank == 0)


def test_torch_loads_what_two_ranks_wrote(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save, path)
    names = sorted(os.listdir(path))
    # tessera keeps a copy of the committed common.pt beside it (FORMAT.md, "Writing torch_dist").
    copies = [n for n in names if n.startswith(".tessera-common-")]
    assert len(copies) == 1, names
    names = [n for n in names if n not in copies]
    assert names[0] == ".metadata" and names[3:] == ["common.pt", "metadata.json"], names
    # One data file per rank, named for this save (__{rank}_{k}.distcp, the same k).
    assert [n.split("_")[2] for n in names[1:3]] == ["0", "1"], names
    assert names[1].split("_")[3] == names[2].split("_")[3] and names[1].endswith(".distcp"), names
    with open(os.path.join(path, "metadata.json")) as f:
        assert json.load(f) == {
            "sharded_backend": "torch_dist",
            "sharded_backend_version": 1,
            "common_backend": "torch",
            "common_backend_version": 1,
        }

    # One process reads everything two wrote, as whole tensors (a different sharding).
    full = full_tensors()
    state: Dict[str, Any] = {k: torch.zeros_like(v) for k, v in full.items()}
    state["rng_state/shard_0_2"] = io.BytesIO()
    state["rng_state/shard_1_2"] = io.BytesIO()
    assert not dist.is_initialized()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    for k, v in full.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k
    for r in range(2):
        got = state[f"rng_state/shard_{r}_2"]
        if isinstance(got, io.BytesIO):  # torch >= 2.x hands byte items back as streams
            got = torch.load(got, weights_only=True)
        assert isinstance(got, list) and len(got) == 1
        want = rng_state(r)
        assert got[0].keys() == want.keys()
        for k in want:
            w, g = want[k], got[0][k]
            assert torch.equal(g, w) if isinstance(w, torch.Tensor) else g == w, (r, k)

    # A slice, as a TP rank of another layout would ask for it: the middle rows.
    meta = dcp.FileSystemReader(path).read_metadata()
    assert meta.state_dict_metadata["decoder.qkv.weight"].size == torch.Size([8, 6])
    assert len(meta.state_dict_metadata["decoder.norm.weight"].chunks) == 1, "a replica is stored once"

    common = torch.load(os.path.join(path, "common.pt"), weights_only=True)
    assert common == {"iteration": 3, "args": {"lr": 0.5, "name": "tiny"}}

    # tessera reads it back too.
    found = _native.detect(path)
    assert (found.backend, found.version, found.is_dcp, found.is_megatron) == ("torch_dist", 1, True, True)


def test_an_existing_checkpoint_is_kept(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    t = torch.arange(4, dtype=torch.float32)
    keep: List[Any] = []
    _native.save_torch_dist([_tuple("x", t, t, [0], 0, keep)], [], None, path)
    from tessera.errors import AlreadyExistsError

    with pytest.raises(AlreadyExistsError):
        _native.save_torch_dist([_tuple("x", t, t, [0], 0, keep)], [], None, path)
    t2 = t + 1
    _native.save_torch_dist([_tuple("x", t2, t2, [0], 0, keep)], [], None, path, overwrite=True)
    state = {"x": torch.zeros(4)}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert torch.equal(state["x"], t2)
    assert torch.load(os.path.join(path, "common.pt"), weights_only=True) == {}


def test_every_dtype_loads_in_torch(tmp_path: Any) -> None:
    """Typed storages (`_rebuild_tensor_v2`) and the dtypes torch saves untyped
    (`_rebuild_tensor_v3`: fp8, unsigned wider than 8 bits), 0-d and empty tensors."""
    path = str(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, generator=g)
    tensors = {
        "f64": x.double(),
        "f32": x,
        "f16": x.half(),
        "bf16": x.bfloat16(),
        "f8_e4m3fn": x.to(torch.float8_e4m3fn),
        "f8_e5m2": x.to(torch.float8_e5m2),
        "i64": torch.arange(15, dtype=torch.int64).reshape(3, 5) - 7,
        "i32": torch.arange(15, dtype=torch.int32) - 7,
        "i16": torch.arange(15, dtype=torch.int16) - 7,
        "i8": torch.arange(15, dtype=torch.int8) - 7,
        "u8": torch.arange(15, dtype=torch.uint8),
        "u16": torch.arange(15, dtype=torch.int32).to(torch.uint16),
        "u32": torch.arange(15, dtype=torch.int64).to(torch.uint32),
        "u64": torch.arange(15, dtype=torch.int64).to(torch.uint64),
        "bool": x > 0,
    }
    extra = {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    keep: List[Any] = []
    native = []
    for name, t in list(tensors.items()) + list(extra.items()):
        dtype = name if name in tensors else "f32"
        native.append(save_tensor(name, dtype, t.shape, t.shape, (0,) * t.dim(), data=t))
        keep.append(t)
    _native.save_torch_dist(native, [], None, path)
    state = {k: torch.zeros_like(v) for k, v in {**tensors, **extra}.items()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    for k, v in {**tensors, **extra}.items():
        assert state[k].dtype == v.dtype and state[k].shape == v.shape, k
        as_bytes = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731 (bitwise: NaN-safe, any dtype)
        assert torch.equal(as_bytes(state[k]), as_bytes(v)), k


def _megatron_torch_dist_save(rank: int, world: int, path: str, async_save: bool, fail: bool) -> None:
    from torch.distributed.checkpoint import CheckpointException

    import tessera.dist_checkpointing as dc
    from tessera.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from tessera.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from tessera.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    sd = {
        f"k{i}": dc.ShardedTensor.from_rank_offsets(f"k{i}", torch.full((2, 3), float(10 * i + rank)), (0, rank, world))
        for i in range(3)
    }
    real = FileSystemWriterAsync.write_preloaded_data
    seen = []

    def worker(transform_list, local_proc_idx, write_bucket, results_queue, count_queue, use_fsync, **kwargs):
        seen.append(write_bucket.name)
        if fail and rank == 1 and local_proc_idx == 2:
            try:
                raise OSError("disk on fire")
            except OSError as e:
                results_queue.put((local_proc_idx, e))
            count_queue.get()
            count_queue.task_done()
            return
        real(transform_list, local_proc_idx, write_bucket, results_queue, count_queue, use_fsync, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = worker
    try:
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=4)
        queue = AsyncCallsQueue()
        try:
            request = dc.save(sd, path, strategy, async_sharded_save=async_save)
            if async_save:
                queue.schedule_async_request(request)
                while queue.get_num_unfinalized_calls():
                    queue.maybe_finalize_async_calls(blocking=False)
        except CheckpointException as e:
            assert fail, e
            # Details on the coordinator, as megatron raises them; the core's error everywhere.
            assert ("disk on fire" in str(e)) == (rank == 0), str(e)
            assert "disk on fire" in str(e.__cause__) and "rank 1" in str(e.__cause__) or rank == 1, e.__cause__
        else:
            assert not fail, "the failing worker was not reported"
    finally:
        FileSystemWriterAsync.write_preloaded_data = real
    # Every bucket of the rank went through the (replaceable) worker function.
    assert len(seen) == 4 and all(n.startswith(f"__{rank}_") for n in seen), seen


@pytest.mark.parametrize("async_save", [False, True])
def test_megatron_writer_workers_write_each_file_and_a_failing_one_commits_nothing(tmp_path: Any, async_save: bool) -> None:
    ok = str(tmp_path / "ok")
    run_ranks(2, _megatron_torch_dist_save, ok, async_save, False)
    out = {f"k{i}": torch.zeros(4, 3) for i in range(3)}
    dcp.load(out, checkpoint_id=ok, no_dist=True)
    for i in range(3):
        assert out[f"k{i}"].tolist() == [[10.0 * i] * 3] * 2 + [[10.0 * i + 1] * 3] * 2
    assert len([p for p in os.listdir(ok) if p.endswith(".distcp")]) == 8

    bad = str(tmp_path / "bad")
    run_ranks(2, _megatron_torch_dist_save, bad, async_save, True)
    left = sorted(os.listdir(bad)) if os.path.isdir(bad) else []
    assert ".metadata" not in left and not [p for p in left if p.endswith(".distcp")], left
