"""tessera.olmo_core: OLMo-core 0.1.x's checkpoint API on tessera's core, on CPU with gloo.

A TinyLM saved under FSDP1 (use_orig_params) at 2 ranks is loaded under FSDP1 at 3 ranks,
FSDP2 at 3 ranks and a plain module in one process, each into a freshly built model and
optimizer, and saved again: every load gives back the saved parameters exactly (no optimizer
step applied), and every re-save unshards to the same state. DDP with SGD + momentum, Adam,
the real OLMo-core fixtures, the metadata models and the errors are covered too. The round
trips against ai2-olmo-core itself run in scripts/interop/olmo_interop.sh (a venv with torch 2.7.1).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import tessera.olmo_core as oc
from tessera.errors import AlreadyExistsError, CorruptError, KeyMismatchError, MismatchError
from tessera._launch import run_ranks
import olmo_models
from olmo_models import TinyLM, full_params, wrap

FIXTURES = Path(__file__).resolve().parents[2] / "crates/tessera/tests/fixtures/olmo"
VOCAB, DIM, HIDDEN = 19, 8, 12


def make_model(seed: int) -> TinyLM:
    return olmo_models.make_model(seed, VOCAB, DIM, HIDDEN)


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    olmo_models.train(model, optim, steps, seed, VOCAB)


def unsharded(ckpt: str) -> Dict[str, torch.Tensor]:
    """The whole checkpoint: model tensors and the flat optimizer state (not its pickles)."""
    out = {f"model/{k}": v for k, v in oc.unshard_model_state(ckpt, no_dist=True).items()}
    optim = oc.Checkpointer().unshard(f"{ckpt}/optim", no_dist=True)
    out.update({f"optim/{k}": v for k, v in optim.items() if k.startswith("state.")})
    return out


def assert_same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys()))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (what, k)


# ---- the chain: FSDP1 w2 -> FSDP1 w3, FSDP2 w3 -> plain ----------------------------------------


def _save_fsdp1_w2(rank: int, world: int, tmp: str) -> None:
    model = wrap("fsdp1", make_model(1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, optim, 2, seed=10 + rank)
    files = oc.save_model_and_optim_state(f"{tmp}/A", model, optim)
    assert Path(f"{tmp}/A/model/rank_{rank}.safetensors") in files
    params = full_params(model)
    if rank == 0:
        torch.save(params, f"{tmp}/truth.pt")


def _load_w3_and_resave(rank: int, world: int, tmp: str) -> None:
    truth = torch.load(f"{tmp}/truth.pt")
    for kind, out in (("fsdp1", "B"), ("fsdp2", "C")):
        model = wrap(kind, make_model(2))  # other weights: everything must come from the checkpoint
        optim = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.0)
        assert not optim.state
        oc.load_model_and_optim_state(f"{tmp}/A", model, optim)
        got = full_params(model)
        assert_same(got, truth, f"{kind} world {world}")  # exactly: no weight-decay step
        assert optim.param_groups[0]["lr"] == pytest.approx(1e-2)
        assert optim.param_groups[0]["weight_decay"] == pytest.approx(0.1)
        assert isinstance(optim.param_groups[0]["betas"], tuple)
        oc.save_model_and_optim_state(f"{tmp}/{out}", model, optim)
        dist.barrier()


def test_fsdp1_fsdp2_plain_round_trips_across_world_sizes(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    run_ranks(2, _save_fsdp1_w2, tmp)
    run_ranks(3, _load_w3_and_resave, tmp)
    truth = torch.load(f"{tmp}/truth.pt")
    # One process, no process group: a plain module and a fresh optimizer.
    model = make_model(3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    oc.load_model_and_optim_state(f"{tmp}/B", model, optim)
    assert_same(full_params(model), truth, "plain")
    oc.save_model_and_optim_state(f"{tmp}/D", model, optim)
    a = unsharded(f"{tmp}/A")
    for other in "BCD":
        assert_same(unsharded(f"{tmp}/{other}"), a, f"A vs {other}")
    # The optimizer state dict, unsharded: by parameter id, param groups without their names.
    osd = oc.unshard_optim_state(f"{tmp}/A", no_dist=True)
    assert osd["param_groups"][0]["params"] == list(range(14)) and "_param_names" not in osd["param_groups"][0]
    assert set(osd["state"][0]) == {"exp_avg", "exp_avg_sq", "step"}
    assert torch.equal(osd["state"][0]["exp_avg"], a["optim/state.embed.weight.__exp_avg"])
    # Training goes on identically from the loaded state and from the state it was loaded from.
    again = make_model(4)
    again_optim = torch.optim.AdamW(again.parameters(), lr=0.5)
    oc.load_model_and_optim_state(f"{tmp}/D", again, again_optim)
    train(model, optim, 2, seed=99)
    train(again, again_optim, 2, seed=99)
    assert_same(full_params(again), full_params(model), "continued")


# ---- DDP and other optimizers -------------------------------------------------------------------


def _save_ddp_sgd(rank: int, world: int, tmp: str) -> None:
    model = nn.parallel.DistributedDataParallel(make_model(5))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, optim, 2, seed=20 + rank)
    oc.save_model_and_optim_state(f"{tmp}/ddp", model, optim)
    if rank == 0:
        torch.save({"params": full_params(model.module), "optim": optim.state_dict()}, f"{tmp}/ddp_truth.pt")


def test_ddp_sgd_momentum_loads_into_a_plain_module(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    run_ranks(2, _save_ddp_sgd, tmp)
    truth = torch.load(f"{tmp}/ddp_truth.pt")
    meta = oc.Checkpointer().get_metadata(f"{tmp}/ddp/model")
    assert all(k.startswith("module.") and not m.is_sharded for k, m in meta.tensors.items())
    # Each replicated tensor is written once, the writing spread over the ranks holding it.
    assert all(len(m.shard_spec_per_file) == 1 for m in meta.tensors.values())
    assert {f for m in meta.tensors.values() for f in m.shard_spec_per_file} == {"rank_0.safetensors", "rank_1.safetensors"}
    model = make_model(6)
    optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    oc.load_model_and_optim_state(f"{tmp}/ddp", model, optim)  # keys saved with "module."
    assert_same(full_params(model), truth["params"], "ddp -> plain")
    got, want = optim.state_dict(), truth["optim"]
    assert got["param_groups"][0]["momentum"] == pytest.approx(0.9)
    for pid, state in want["state"].items():
        assert torch.equal(got["state"][pid]["momentum_buffer"], state["momentum_buffer"]), pid


def test_adam_plain_round_trip_and_checkpointer_api(tmp_path: Any) -> None:
    model = make_model(7)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.8, 0.9))
    train(model, optim, 1, seed=1)
    oc.save_model_and_optim_state(tmp_path / "adam", model, optim)
    fresh = make_model(8)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1.0)
    oc.load_model_and_optim_state(str(tmp_path / "adam"), fresh, fresh_optim)
    assert_same(full_params(fresh), full_params(model), "adam")
    assert fresh_optim.param_groups[0]["betas"] == (0.8, 0.9)
    # Checkpointer: a flat state dict of mixed dtypes, 0-d and empty tensors.
    sd = {
        "w": torch.randn(5, 3),
        "h": torch.randn(4).to(torch.bfloat16),
        "i": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "s": torch.tensor(2.5),
        "e": torch.empty(0, 4),
        "b": torch.tensor([True, False]),
    }
    meta, files = oc.Checkpointer().save(tmp_path / "ck", sd)
    assert files == [tmp_path / "ck/rank_0.safetensors", tmp_path / "ck/metadata.json"]
    assert meta == oc.Checkpointer().get_metadata(tmp_path / "ck")
    assert json.dumps(meta.model_dump()) == (tmp_path / "ck/metadata.json").read_text()
    assert meta.tensors["h"].dtype == "BF16" and meta.tensors["s"].shape == ()
    back = oc.Checkpointer().unshard(tmp_path / "ck")
    assert_same(back, sd, "checkpointer")
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    oc.Checkpointer().load(tmp_path / "ck", target)
    assert_same(target, sd, "checkpointer load")


# ---- real OLMo-core checkpoints -----------------------------------------------------------------


def test_olmo_core_fixtures_load_into_a_plain_model() -> None:
    from safetensors.torch import load_file

    for name in ("olmo01_fsdp_w2", "olmo_fsdp1_w2", "olmo_fsdp1_w3"):
        ckpt = FIXTURES / name
        expected = load_file(str(FIXTURES / f"{name}.expected.safetensors"))
        (vocab, dim), hidden = expected["model/embed.weight"].shape, expected["model/blocks.0.ff_in.weight"].shape[0]
        model = TinyLM(vocab, dim, hidden, out=expected["model/lm_head.weight"].shape[0])
        optim = torch.optim.AdamW(model.parameters(), lr=1.0)
        oc.load_model_and_optim_state(ckpt, model, optim)
        for k, v in model.state_dict().items():
            assert torch.equal(v, expected[f"model/{k}"]), (name, k)
        names = [n for n, _ in model.named_parameters()]
        state = optim.state_dict()["state"]
        for i, n in enumerate(names):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(state[i][key], expected[f"optim/state.{n}.__{key}"]), (name, n, key)
        unshard = oc.unshard_model_state(ckpt)
        assert_same(unshard, {k[6:]: v for k, v in expected.items() if k.startswith("model/")}, name)


def test_metadata_models_mirror_olmo_core() -> None:
    for path in FIXTURES.glob("*/*/metadata.json"):
        text = path.read_text()
        meta = oc.Checkpointer().get_metadata(path.parent)
        assert json.dumps(meta.model_dump()) == text, path
        assert oc.StorageMetadata(**json.loads(text)) == meta
        assert oc.StorageMetadata.model_validate_json(meta.model_dump_json()) == meta
    flat = oc.TensorShardSpec(flattened_offsets=[[0, 3], [5, 6]])
    assert flat.local_numel == 4 and list(flat.get_flattened_offsets((2, 3))) == [(0, 3), (5, 6)]
    box = oc.TensorShardSpec(local_shape=(2, 2), global_offset=(1, 1))
    assert list(box.get_flattened_offsets((4, 3))) == [(4, 6), (7, 9)]
    assert list(oc.TensorShardSpec(local_shape=(2, 3), global_offset=(1, 0)).get_merged_flattened_offsets((4, 3))) == [(3, 9)]
    assert box.compute_overlap_with(oc.TensorShardSpec(flattened_offsets=[(4, 6), (7, 9)]), (4, 3)) == oc.OverlapType.EQUAL
    assert box.compute_overlap_with(oc.TensorShardSpec(local_shape=(1, 1), global_offset=(1, 1)), (4, 3)) == "SUPERSET"
    assert box.compute_overlap_with(oc.TensorShardSpec(local_shape=(1, 1), global_offset=(0, 0)), (4, 3)) is None
    t = oc.TensorStorageMetadata(shape=[4, 3], is_sharded=True, dtype="F32", shard_spec_per_file={"a": {"flattened_offsets": [[0, 12]]}})
    assert t.torch_dtype == torch.float32 and t.get_numel_in_file("a") == 12 and t.get_numel_in_file("b") == 0
    assert torch.isnan(t.materialize_empty()).all()


def test_errors_name_the_key_or_file(tmp_path: Any) -> None:
    sd = {"w": torch.randn(4, 3)}
    oc.Checkpointer().save(tmp_path / "ck", sd)
    with pytest.raises(AlreadyExistsError):
        oc.Checkpointer().save(tmp_path / "ck", sd)
    oc.Checkpointer().save(tmp_path / "ck", {"w": torch.ones(4, 3)}, save_overwrite=True)
    assert torch.equal(oc.Checkpointer().unshard(tmp_path / "ck")["w"], torch.ones(4, 3))
    with pytest.raises(KeyMismatchError, match="nope"):
        oc.Checkpointer().load(tmp_path / "ck", {"nope": torch.empty(2)})
    with pytest.raises(MismatchError, match='"w"'):
        oc.Checkpointer().load(tmp_path / "ck", {"w": torch.empty(3, 4)})
    meta = json.loads((tmp_path / "ck/metadata.json").read_text())
    # The overwrite wrote rank files of its own names beside the old ones (gone since).
    (rank_file,) = meta["tensors"]["w"]["shard_spec_per_file"]
    assert rank_file.startswith("rank_0-"), rank_file
    assert sorted(os.listdir(tmp_path / "ck")) == sorted(["metadata.json", rank_file])
    meta["tensors"]["w"]["shard_spec_per_file"][rank_file]["flattened_offsets"] = [[0, 13]]
    (tmp_path / "ck/metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CorruptError, match='metadata.json.*"w"'):
        oc.Checkpointer().load(tmp_path / "ck", {"w": torch.empty(4, 3)})
    model = make_model(1)
    with pytest.raises(FileNotFoundError):
        oc.load_model_and_optim_state(tmp_path / "missing", model)
    assert os.path.isdir(tmp_path / "ck")


def test_loads_in_place_into_existing_optimizer_state(tmp_path: Any) -> None:
    model = make_model(9)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, optim, 2, seed=3)
    oc.save_model_and_optim_state(tmp_path / "a", model, optim)
    other = make_model(10)
    other_optim = torch.optim.AdamW(other.parameters(), lr=1e-3)
    train(other, other_optim, 1, seed=4)  # state exists: it is filled in place
    before = {id(p): other_optim.state[p]["exp_avg"].data_ptr() for p in other.parameters()}
    oc.load_model_and_optim_state(tmp_path / "a", other, other_optim)
    for p, q in zip(other.parameters(), model.parameters()):
        assert other_optim.state[p]["exp_avg"].data_ptr() == before[id(p)]
        assert torch.equal(other_optim.state[p]["exp_avg"], optim.state[q]["exp_avg"])
        assert torch.equal(p, q)


def test_a_parameter_missing_from_the_checkpoint_is_named(tmp_path: Any) -> None:
    model = make_model(11)
    oc.save_model_and_optim_state(tmp_path / "a", model, torch.optim.SGD(model.parameters(), lr=0.1))
    bigger = make_model(11)
    bigger.extra = nn.Linear(2, 2)
    with pytest.raises(KeyMismatchError, match="extra.weight"):
        oc.load_model_and_optim_state(tmp_path / "a", bigger)


def test_other_apis_read_olmo_core_checkpoints() -> None:
    from safetensors.torch import load_file

    import tessera.torch as tt
    from tessera import dist_checkpointing as dc

    ckpt = FIXTURES / "olmo_fsdp2_w2"
    expected = load_file(str(FIXTURES / "olmo_fsdp2_w2.expected.safetensors"))
    assert_same(tt.unshard(ckpt), expected, "tessera.torch.unshard")
    # A Megatron-style sharded load of a row slice, and the decoded param groups as common state.
    key = "model/embed.weight"
    full = expected[key]
    data = torch.empty(full.shape[0] - 2, full.shape[1])
    st = dc.ShardedTensor(key, data, data.dtype, tuple(data.shape), tuple(full.shape), (2, 0), None)
    sd = {key: st}
    loaded = dc.load(sd, str(ckpt))
    assert torch.equal(loaded[key], full[2:])
    common = dc.load_common_state_dict(str(ckpt))
    assert common["optim"]["param_groups"][0]["lr"] == pytest.approx(1e-2)


def test_saving_before_the_first_step_creates_state_and_keeps_parameters(tmp_path: Any) -> None:
    model = make_model(12)
    before = full_params(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    oc.save_model_and_optim_state(tmp_path / "a", model, optim)
    assert_same(full_params(model), before, "parameters after a step-0 save")  # no weight decay applied
    keys = set(oc.Checkpointer().get_metadata(tmp_path / "a/optim").tensors)
    assert {f"state.{n}.__exp_avg" for n in before} <= keys  # what OLMo-core's load asks for
    fresh = make_model(13)
    oc.load_model_and_optim_state(tmp_path / "a", fresh, torch.optim.AdamW(fresh.parameters(), lr=0.5))
    assert_same(full_params(fresh), before, "loaded")


def test_a_hyperparameter_that_is_not_plain_data_is_kept_with_a_warning(tmp_path: Any) -> None:
    model = make_model(14)
    optim = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), foreach=False)
    train(model, optim, 1, seed=5)
    oc.save_model_and_optim_state(tmp_path / "a", model, optim)
    fresh = make_model(15)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=torch.tensor(0.5), foreach=False)
    with pytest.warns(UserWarning, match="'lr'"):
        oc.load_model_and_optim_state(tmp_path / "a", fresh, fresh_optim)
    assert float(fresh_optim.param_groups[0]["lr"]) == pytest.approx(0.5)
    assert_same(full_params(fresh), full_params(model), "parameters")
