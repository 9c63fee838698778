"""Megatron-style save and resharded load through `tessera.dist_checkpointing`, on real
torch (CPU) with gloo process groups of 1, 2 and 4 ranks."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict

import pytest
import torch

from tessera._launch import run_ranks
from tessera import dist_checkpointing as dc
from tessera.dist_checkpointing import ShardedObject, ShardedTensor, ShardedTensorFactory, StrictHandling
from tessera.errors import AlreadyExistsError, InvalidShardingError, KeyMismatchError, TesseraError

L, H, F, V = 4, 8, 12, 16


def truth() -> Dict[str, torch.Tensor]:
    """The global model, identical in every process."""
    g = torch.Generator().manual_seed(1234)
    t = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    return {
        "embedding.weight": t(V, H),
        "layers.qkv": t(L, 3 * H, H),
        "layers.proj": t(L, H, H),
        "layers.fc1_w": t(L, F, H),
        "layers.fc1_v": t(L, F, H),
        "layers.norm": t(L, H),
        "final_norm": t(H),
    }


def part(n: int, parts: int, i: int) -> slice:
    size = n // parts
    return slice(i * size, (i + 1) * size)


def swiglu_factory(key: str, fused: torch.Tensor, g: int, tp: int, tp_rank: int) -> ShardedTensorFactory:
    """A fused [w; v] fc1 weight saved as two tensors, each TP-split on its rows."""

    def build(key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any) -> Dict[str, ShardedTensor]:
        w, v = torch.chunk(t, 2, dim=0)
        return {
            name: ShardedTensor.from_rank_offsets(
                f"layers.fc1_{name}", half, (0, g, L), (1, tp_rank, tp), replica_id=replica_id, prepend_axis_num=1
            )
            for name, half in (("w", w), ("v", v))
        }

    def merge(sub: Dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([sub["w"], sub["v"]], dim=0)

    return ShardedTensorFactory(key, fused, build, merge, replica_id=0)


def model_state(tp: int, pp: int, tp_rank: int, pp_rank: int, fill: Callable[[torch.Tensor], torch.Tensor]):
    """The sharded state dict of one rank of a TP × PP layout; `fill` makes the local data
    from the truth slice (a copy to save, zeros to load into)."""
    w = truth()
    sd: Dict[str, Any] = {}
    if pp_rank == 0:
        sd["embedding"] = ShardedTensor.from_rank_offsets(
            "embedding.weight", fill(w["embedding.weight"][part(V, tp, tp_rank)]), (0, tp_rank, tp)
        )
    per_stage = L // pp
    layers = []
    for i in range(per_stage):
        g = pp_rank * per_stage + i
        fused = torch.cat([w["layers.fc1_w"][g][part(F, tp, tp_rank)], w["layers.fc1_v"][g][part(F, tp, tp_rank)]])
        layers.append(
            {
                "qkv": ShardedTensor.from_rank_offsets(
                    "layers.qkv", fill(w["layers.qkv"][g][part(3 * H, tp, tp_rank)]), (0, g, L), (1, tp_rank, tp),
                    prepend_axis_num=1,
                ),
                "proj": ShardedTensor.from_rank_offsets(
                    "layers.proj", fill(w["layers.proj"][g][:, part(H, tp, tp_rank)]), (0, g, L), (2, tp_rank, tp),
                    prepend_axis_num=1,
                ),
                "fc1": swiglu_factory("layers.fc1", fill(fused), g, tp, tp_rank),
                "norm": ShardedTensor.from_rank_offsets(
                    "layers.norm", fill(w["layers.norm"][g]), (0, g, L), replica_id=(0, tp_rank, 0),
                    prepend_axis_num=1,
                ),
            }
        )
    sd["layers"] = layers
    if pp_rank == pp - 1:
        sd["final_norm"] = ShardedTensor.from_rank_offsets("final_norm", fill(w["final_norm"]), replica_id=tp_rank)
    return sd


def expected_state(tp: int, pp: int, tp_rank: int, pp_rank: int) -> Dict[str, Any]:
    """What a load under that layout must give: the truth slices (fc1 merged back)."""
    sd = model_state(tp, pp, tp_rank, pp_rank, lambda x: x.clone())
    out: Dict[str, Any] = {}
    if "embedding" in sd:
        out["embedding"] = sd["embedding"].data
    out["layers"] = [
        {"qkv": ly["qkv"].data, "proj": ly["proj"].data, "fc1": ly["fc1"].data, "norm": ly["norm"].data}
        for ly in sd["layers"]
    ]
    if "final_norm" in sd:
        out["final_norm"] = sd["final_norm"].data
    return out


def assert_same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        for k in want:
            assert k in got, f"{where}.{k} missing"
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got)}"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{tuple(got.shape)}"
        assert torch.equal(got, want), f"{where}: values differ"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _save_tp2_pp2(rank: int, world: int, ckpt: str) -> None:
    tp_rank, pp_rank = rank % 2, rank // 2
    sd = model_state(2, 2, tp_rank, pp_rank, lambda x: x.clone())
    sd["iteration"] = 7
    sd["args"] = argparse.Namespace(lr=0.1, name="gpt")
    sd["names"] = ["a", "b"]
    sd["schedule"] = (1, 2.5)
    sd["rng"] = ShardedObject("rng_state", {"seed": rank, "state": [rank, rank + 1]}, (2, 2), (pp_rank, tp_rank))
    sd["scratch"] = dc.LocalNonpersistentObject("not saved")
    dc.save(sd, ckpt, content_metadata={"format": "demo", "step": 7})


def _load_tp1_pp4(rank: int, world: int, ckpt: str) -> None:
    sd = model_state(1, 4, 0, rank, torch.zeros_like)
    sd["scratch"] = dc.LocalNonpersistentObject(f"local {rank}")
    state = dc.load(sd, ckpt)
    assert_same(state, expected_state(1, 4, 0, rank))
    assert state["iteration"] == 7 and state["names"] == ["a", "b"] and state["schedule"] == (1, 2.5)
    assert state["args"] == argparse.Namespace(lr=0.1, name="gpt")
    assert state["scratch"] == f"local {rank}"


@pytest.fixture(scope="module")
def tp2_pp2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    ckpt = str(tmp_path_factory.mktemp("ckpt") / "tp2pp2")
    run_ranks(4, _save_tp2_pp2, ckpt)
    return ckpt


def test_tp2_pp2_loads_at_tp1_pp4(tp2_pp2_checkpoint: str) -> None:
    run_ranks(4, _load_tp1_pp4, tp2_pp2_checkpoint)


def test_tp2_pp2_loads_in_one_process(tp2_pp2_checkpoint: str) -> None:
    sd = model_state(1, 1, 0, 0, torch.zeros_like)
    sd["rng"] = [ShardedObject("rng_state", None, (2, 2), (p, t)) for p in range(2) for t in range(2)]
    state = dc.load(sd, tp2_pp2_checkpoint)
    assert_same(state, expected_state(1, 1, 0, 0))
    assert [o["seed"] for o in state["rng"]] == [0, 1, 2, 3]
    assert state["rng"][3] == {"seed": 3, "state": [3, 4]}
    assert "scratch" not in state


def test_metadata_plain_tensors_common_and_content(tp2_pp2_checkpoint: str) -> None:
    w = truth()
    meta = dc.load_tensors_metadata(tp2_pp2_checkpoint)
    assert set(meta) == set(w)
    for key, sh in meta.items():
        assert sh.dtype == torch.bfloat16 and tuple(sh.global_shape) == tuple(w[key].shape), key
    plain = dc.load_plain_tensors(tp2_pp2_checkpoint)
    for key, t in w.items():
        assert torch.equal(plain[key], t), key
    common = dc.load_common_state_dict(tp2_pp2_checkpoint)
    assert common["iteration"] == 7 and common["args"].lr == 0.1
    assert dc.load_content_metadata(tp2_pp2_checkpoint) == {"format": "demo", "step": 7}
    objects = dc.load_sharded_objects({"r": ShardedObject("rng_state", None, (2, 2), (1, 0))}, tp2_pp2_checkpoint)
    assert objects["r"]["seed"] == 2


def test_save_refuses_to_overwrite(tp2_pp2_checkpoint: str) -> None:
    sd = {"x": ShardedTensor.from_rank_offsets("x", torch.ones(3))}
    with pytest.raises(AlreadyExistsError):
        dc.save(sd, tp2_pp2_checkpoint)
    assert issubclass(AlreadyExistsError, dc.CheckpointingException)


def _overlap(rank: int, world: int, ckpt: str) -> None:
    sd = {"w": ShardedTensor("w", torch.ones(3, 2), torch.float32, (3, 2), (4, 2), (rank, 0), None)}
    with pytest.raises(InvalidShardingError) as e:
        dc.save(sd, ckpt)
    assert e.value.key == "w"


def test_invalid_sharding_raises_on_every_rank(tmp_path: Any) -> None:
    run_ranks(2, _overlap, str(tmp_path / "bad"))
    assert not (tmp_path / "bad" / "tessera.index").exists()


@pytest.mark.parametrize("mode", list(StrictHandling))
def test_strict_handling_modes(tmp_path: Any, mode: StrictHandling) -> None:
    ckpt = str(tmp_path / "ckpt")
    dc.save({"a": ShardedTensor.from_rank_offsets("a", torch.arange(4.0)), "b": ShardedTensor.from_rank_offsets("b", torch.ones(2))}, ckpt)
    request = {
        "a": ShardedTensor.from_rank_offsets("a", torch.zeros(4)),
        "zzz": ShardedTensor.from_rank_offsets("zzz", torch.zeros(2)),
    }
    if mode in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
        with pytest.raises(KeyMismatchError):
            dc.load(request, ckpt, strict=mode)
        return
    if mode == StrictHandling.ASSUME_OK_UNEXPECTED:
        with pytest.raises(TesseraError):
            dc.load(request, ckpt, strict=mode)
        return
    out = dc.load(request, ckpt, strict=mode)
    if StrictHandling.requires_returning_mismatch_keys(mode):
        state, missing, unexpected = out
        assert unexpected == {"zzz"}
        assert missing == ({"b"} if mode == StrictHandling.RETURN_ALL else set())
    else:
        state = out
    assert torch.equal(state["a"], torch.arange(4.0))
    assert "zzz" not in state


def test_allow_shape_mismatch_pads_and_truncates(tmp_path: Any) -> None:
    ckpt = str(tmp_path / "ckpt")
    stored = torch.arange(24.0).reshape(6, 4)
    dc.save({"e": ShardedTensor.from_rank_offsets("e", stored)}, ckpt)
    bigger = ShardedTensor.from_rank_offsets("e", torch.full((8, 4), 7.0), allow_shape_mismatch=True)
    got = dc.load({"e": bigger}, ckpt)["e"]
    assert torch.equal(got[:6], stored) and torch.equal(got[6:], torch.zeros(2, 4))
    smaller = ShardedTensor.from_rank_offsets("e", torch.zeros(4, 4), allow_shape_mismatch=True)
    assert torch.equal(dc.load({"e": smaller}, ckpt)["e"], stored[:4])


def test_load_casts_a_tensor_stored_in_another_dtype(tmp_path: Any) -> None:
    # Megatron-Core loads into the request's dtype as copy_ does (its test_tensor_shape_mismatch
    # saves int64 and loads float32).
    ckpt = str(tmp_path / "ckpt")
    stored = torch.arange(-6, 18).reshape(6, 4)
    dc.save({"i": ShardedTensor.from_rank_offsets("i", stored)}, ckpt)
    as_f32 = dc.load({"i": ShardedTensor.from_rank_offsets("i", torch.zeros(6, 4))}, ckpt)["i"]
    assert as_f32.dtype == torch.float32 and torch.equal(as_f32, stored.to(torch.float32))
    half = ShardedTensor.from_rank_offsets("i", torch.zeros(3, 4, dtype=torch.bfloat16), (0, 1, 2))
    got = dc.load({"i": half}, ckpt)["i"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, stored[3:].to(torch.bfloat16))


def test_tied_tensors_load_into_their_own_buffers(tmp_path: Any) -> None:
    # T5 ties one parameter under two keys; both load, each with the values of its own key.
    ckpt = str(tmp_path / "ckpt")
    a, b = torch.arange(8.0), torch.arange(8.0) + 100
    dc.save({"a": ShardedTensor.from_rank_offsets("a", a), "b": ShardedTensor.from_rank_offsets("b", b)}, ckpt)
    shared = torch.zeros(8)
    sd = {"a": ShardedTensor.from_rank_offsets("a", shared), "b": ShardedTensor.from_rank_offsets("b", shared)}
    out = dc.load(sd, ckpt)
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b)
    assert out["a"] is shared, "the first owner of the memory is loaded in place"


def test_flattened_ranges_and_every_dtype(tmp_path: Any) -> None:
    ckpt = str(tmp_path / "ckpt")
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
    full = {str(d): (torch.arange(30).reshape(5, 6) % 7).to(d) for d in dtypes}
    sd = {}
    for name, t in full.items():
        # Two flat pieces of the same box, boundaries mid-row.
        flat = t.reshape(-1)
        sd[name] = [
            ShardedTensor(name, flat[:13].clone(), t.dtype, (5, 6), (5, 6), (0, 0), None, flattened_range=slice(0, 13)),
            ShardedTensor(name, flat[13:].clone(), t.dtype, (5, 6), (5, 6), (0, 0), None, flattened_range=slice(13, 30)),
        ]
    dc.save(sd, ckpt)
    plain = dc.load_plain_tensors(ckpt)
    for name, t in full.items():
        assert plain[name].dtype == t.dtype
        assert torch.equal(plain[name].view(torch.uint8), t.view(torch.uint8)), name


def test_async_flag_returns_a_request_finalized_later(tmp_path: Any) -> None:
    ckpt = str(tmp_path / "ckpt")
    request = dc.save({"a": ShardedTensor.from_rank_offsets("a", torch.arange(6.0))}, ckpt, async_sharded_save=True)
    assert isinstance(request, dc.AsyncRequest)
    request.execute_sync()
    assert request.is_done()
    assert request.finalize()["chunks"] == 1
    assert torch.equal(dc.load_plain_tensors(ckpt)["a"], torch.arange(6.0))


def _validate(rank: int, world: int, overlap: bool) -> None:
    rows = 3 if overlap else 2
    sh = ShardedTensor("v", torch.ones(rows, 2), torch.float32, (rows, 2), (4, 2), (2 * rank if not overlap else rank, 0), None)
    if overlap:
        with pytest.raises(InvalidShardingError):
            dc.validate_sharding_integrity([sh])
    else:
        dc.validate_sharding_integrity([sh])


def test_validate_sharding_integrity_on_every_rank() -> None:
    run_ranks(2, _validate, False)
    run_ranks(2, _validate, True)


def test_remove_sharded_tensors(tmp_path: Any) -> None:
    ckpt = str(tmp_path / "ckpt")
    dc.save({k: ShardedTensor.from_rank_offsets(k, torch.ones(2)) for k in ("opt.a", "opt.b", "model.w")}, ckpt)
    assert sorted(dc.remove_sharded_tensors(ckpt, "opt.")) == ["opt.a", "opt.b"]
    assert set(dc.load_tensors_metadata(ckpt)) == {"model.w"}


def _cached_saves(rank: int, world: int, root: str) -> None:
    """Three saves with one caching strategy per rank: the first plans, the next two reuse it
    (the structure is the same), every checkpoint holds its own step's values; a changed
    structure replans."""
    from tessera.dist_checkpointing.strategies import TesseraSaveShardedStrategy

    strategy = TesseraSaveShardedStrategy(cached_metadata=True)
    for step in range(3):
        w = torch.full((4, 8), float(step * 10 + rank))
        sd = {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world)), "step": step}
        dc.save(sd, f"{root}/step{step}", sharded_strategy=strategy)
    assert (strategy.plan_cache.hits, strategy.plan_cache.misses) == (2, 1)
    for step in range(3):
        full = dc.load_plain_tensors(f"{root}/step{step}")["w"]
        for r in range(world):
            assert torch.equal(full[4 * r : 4 * (r + 1)], torch.full((4, 8), float(step * 10 + r)))
    wide = torch.zeros(4, 16)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", wide, (0, rank, world))}, f"{root}/wide", sharded_strategy=strategy)
    assert (strategy.plan_cache.hits, strategy.plan_cache.misses) == (2, 2)


def test_cached_metadata_reuses_the_plan_across_saves(tmp_path: Any) -> None:
    run_ranks(2, _cached_saves, str(tmp_path))
