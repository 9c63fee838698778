"""`tessera.torch`: DTensor state dicts and FSDP2 model + optimizer checkpoints, resharded
across world sizes, on CPU with gloo."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from tessera._launch import run_ranks
import tessera.torch as tt

ROWS, COLS = 10, 6  # 10 rows over 4 ranks: uneven shards


def full_tensors() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(ROWS, COLS, generator=g),
        "b": torch.randn(COLS, generator=g).to(torch.bfloat16),
        "rep": torch.randn(3, 3, generator=g),
    }


def dtensor_state(world: int, mesh_shape: tuple) -> Dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = full_tensors()
    mesh = init_device_mesh("cpu", mesh_shape)
    if len(mesh_shape) == 1:
        w = distribute_tensor(full["w"], mesh, [Shard(0)])
        b = distribute_tensor(full["b"], mesh, [Shard(0)])
        rep = distribute_tensor(full["rep"], mesh, [Replicate()])
    else:
        w = distribute_tensor(full["w"], mesh, [Shard(0), Shard(1)])
        b = distribute_tensor(full["b"], mesh, [Replicate(), Shard(0)])
        rep = distribute_tensor(full["rep"], mesh, [Replicate(), Replicate()])
    return {"model": {"w": w, "b": b, "rep": rep}, "step": 3, "note": "hello"}


def _save_dtensors(rank: int, world: int, ckpt: str) -> None:
    tt.save(dtensor_state(world, (world,)), ckpt)


def _load_dtensors(rank: int, world: int, ckpt: str, mesh_shape: tuple) -> None:
    sd = dtensor_state(world, mesh_shape)
    for t in sd["model"].values():
        t.to_local().zero_()
    sd["step"], sd["note"] = 0, ""
    tt.load(sd, ckpt)
    full = full_tensors()
    for k, t in sd["model"].items():
        assert torch.equal(t.full_tensor(), full[k]), k
    assert sd["step"] == 3 and sd["note"] == "hello"


def test_dtensors_saved_at_2_load_at_4_in_2d_and_unshard(tmp_path: Any) -> None:
    ckpt = str(tmp_path / "dt")
    run_ranks(2, _save_dtensors, ckpt)
    run_ranks(4, _load_dtensors, ckpt, (2, 2))
    run_ranks(4, _load_dtensors, ckpt, (4,))
    full = full_tensors()
    got = tt.unshard(ckpt)
    assert set(got) == {"model.w", "model.b", "model.rep"}
    for k in full:
        assert torch.equal(got[f"model.{k}"], full[k]), k
    meta = tt.get_metadata(ckpt)
    assert meta["model.b"] == {"dtype": torch.bfloat16, "shape": (COLS,)}


# ---------------------------------------------------------------------------------------------
# FSDP2: train, save, load at other world sizes, continue.


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))


def batches(n: int):
    g = torch.Generator().manual_seed(99)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 5, generator=g)) for _ in range(n)]


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, data) -> None:
    for x, y in data:
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """Parameters and optimizer state gathered to full tensors (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, optim, options=opts)
    out = {f"model.{k}": v.clone() for k, v in msd.items()}
    out.update({f"optim.{k}": v.clone() for k, v in osd.items() if isinstance(v, torch.Tensor)})
    return out


def _fsdp_train_save(rank: int, world: int, ckpt: str, truth_path: str) -> None:
    model = shard(make_model())
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = batches(4)
    train(model, optim, data[:2])
    tt.save_model_and_optim_state(ckpt, model, optim)
    saved = full_state(model, optim)
    train(model, optim, data[2:])
    after = full_state(model, optim)
    if rank == 0:
        torch.save({"saved": saved, "after": after}, truth_path)


def _fsdp_load_continue(rank: int, world: int, ckpt: str, truth_path: str) -> None:
    truth = torch.load(truth_path)
    model = shard(make_model())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    tt.load_model_and_optim_state(ckpt, model, optim)
    loaded = full_state(model, optim)
    assert set(loaded) == set(truth["saved"])
    for k, v in truth["saved"].items():
        assert torch.equal(loaded[k], v), k
    train(model, optim, batches(4)[2:])
    after = full_state(model, optim)
    for k, v in truth["after"].items():
        # Another world size reduces gradients in another order: equal up to rounding.
        if world == 2:
            assert torch.equal(after[k], v), k
        else:
            torch.testing.assert_close(after[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_fsdp2_train_save_load_at_1_2_4_and_continue(tmp_path: Any) -> None:
    ckpt, truth = str(tmp_path / "fsdp"), str(tmp_path / "truth.pt")
    run_ranks(2, _fsdp_train_save, ckpt, truth)
    for world in (2, 4, 1):
        run_ranks(world, _fsdp_load_continue, ckpt, truth)
    saved = torch.load(truth)["saved"]
    model = tt.unshard_model_state(ckpt, no_dist=True)
    for k, v in model.items():
        assert torch.equal(v, saved[f"model.{k}"]), k
    optim = tt.unshard_optim_state(ckpt, no_dist=True)
    exp_avg = {p: s["exp_avg"] for p, s in optim["state"].items()}
    assert set(exp_avg) == {k for k in model}
    assert optim["param_groups"]["0.weight"]["lr"] == pytest.approx(0.01)


def test_plain_module_save_load_without_process_group(tmp_path: Any) -> None:
    ckpt = str(tmp_path / "plain")
    model = make_model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, optim, batches(2))
    tt.save_model_and_optim_state(ckpt, model, optim)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    tt.load_model_and_optim_state(ckpt, fresh, fresh_optim)
    assert fresh_optim.state_dict()["param_groups"][0]["lr"] == pytest.approx(0.01)
    assert_trains_alike(model, optim, fresh, fresh_optim)


def assert_trains_alike(model: torch.nn.Module, optim: Any, fresh: torch.nn.Module, fresh_optim: Any) -> None:
    """``fresh`` holds ``model``'s weights and ``fresh_optim`` ``optim``'s state, and both pairs
    train on to the same weights."""
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
    want, got = optim.state_dict(), fresh_optim.state_dict()
    for pid, state in want["state"].items():
        for name, value in state.items():
            assert torch.equal(got["state"][pid][name], value), (pid, name)
    train(model, optim, batches(4)[2:])
    train(fresh, fresh_optim, batches(4)[2:])
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------
# torchtitan-style state: Stateful wrappers, DCP's call habits


class ModelWrapper:
    """torchtitan's ModelWrapper: the model's state through torch's state-dict helpers."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> Dict[str, Any]:
        return tt.get_model_state_dict(self.model)

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        tt.set_model_state_dict(self.model, sd)


class OptimizersContainer:
    """torchtitan's OptimizersContainer: flattened optimizer state keyed by parameter name."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim
        self.opts = tt.StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> Dict[str, Any]:
        return tt.get_optimizer_state_dict(self.model, self.optim, options=self.opts)

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        tt.set_optimizer_state_dict(self.model, self.optim, sd, options=self.opts)


class TrainState:
    """torchtitan's TrainState: plain values, one of them a tuple."""

    def __init__(self) -> None:
        self.step, self.losses, self.window = 0, [], (0, 0)

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "losses": list(self.losses), "window": self.window}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.step, self.losses, self.window = sd["step"], sd["losses"], tuple(sd["window"])


def titan_state(model: torch.nn.Module, optim: torch.optim.Optimizer, train_state: TrainState) -> Dict[str, Any]:
    return {"model": ModelWrapper(model), "optimizer": OptimizersContainer(model, optim), "train_state": train_state}


def _titan_save(rank: int, world: int, ckpt: str, truth_path: str, use_async: bool) -> None:
    model = shard(make_model())
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    train(model, optim, batches(2))
    ts = TrainState()
    ts.step, ts.losses, ts.window = 2, [0.5, 0.25], (3, 4)
    state = titan_state(model, optim, ts)
    if use_async:
        from torch.distributed.checkpoint import FileSystemWriter

        future = tt.async_save(state, storage_writer=FileSystemWriter(ckpt), process_group=dist.group.WORLD)
        train(model, optim, batches(3)[2:])  # the state may change once async_save returned
        assert future.result()["files"] == world
    else:
        tt.save(state, checkpoint_id=ckpt)
    if rank == 0 and not use_async:
        torch.save(full_state(model, optim), truth_path)
    elif not use_async:
        full_state(model, optim)


def _titan_load(rank: int, world: int, ckpt: str, truth_path: str) -> None:
    model = shard(make_model())
    optim = torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.1, 0.2))
    ts = TrainState()
    from torch.distributed.checkpoint import FileSystemReader

    tt.load(titan_state(model, optim, ts), storage_reader=FileSystemReader(ckpt))
    assert (ts.step, ts.losses, ts.window) == (2, [0.5, 0.25], (3, 4))
    group = optim.param_groups[0]
    assert group["lr"] == pytest.approx(0.01) and tuple(group["betas"]) == (0.8, 0.95)
    loaded = full_state(model, optim)
    truth = torch.load(truth_path)
    assert set(loaded) == set(truth)
    for k, v in truth.items():
        assert torch.equal(loaded[k], v), k


def test_torchtitan_stateful_state_round_trips_across_world_sizes(tmp_path: Any) -> None:
    ckpt, truth = str(tmp_path / "titan"), str(tmp_path / "truth.pt")
    run_ranks(2, _titan_save, ckpt, truth, False)
    run_ranks(1, _titan_load, ckpt, truth)
    run_ranks(2, _titan_load, ckpt, truth)
    # Optimizer hyper-parameters and the train state are plain values every tool reads.
    from tessera import _native

    common = {tuple(p): v for p, v in _native.load_common(ckpt)}
    assert common[("train_state", "window")] == [3, 4]
    assert common[("optimizer", "param_groups.0.weight.betas")] == [0.8, 0.95]
    assert not [p for p, v in common.items() if isinstance(v, dict) and "__tessera_torch_save__" in v]
    # async_save, given a torch storage writer, writes the same checkpoint.
    run_ranks(2, _titan_save, str(tmp_path / "titan-async"), truth, True)
    assert sorted(tt.get_metadata(str(tmp_path / "titan-async"))) == sorted(tt.get_metadata(ckpt))


def test_key_mismatch_reads_like_pytorch_and_strict_false_keeps_values(tmp_path: Any) -> None:
    from tessera.errors import KeyMismatchError

    ckpt = str(tmp_path / "k")
    tt.save({"a": torch.ones(2), "b": torch.ones(3), "t": (1, 2)}, ckpt)
    sd = {"a": torch.zeros(2), "c": torch.full((3,), 7.0), "t": (0, 0)}
    with pytest.raises(KeyMismatchError, match=r'Missing key\(s\) in state_dict: "c"\.') as e:
        tt.load(sd, ckpt)
    assert e.value.missing_keys == ["c"] and "Unexpected" not in str(e.value) and ckpt in str(e.value)
    tt.load(sd, ckpt, strict=False)
    assert sd["a"].tolist() == [1.0, 1.0] and sd["c"].tolist() == [7.0] * 3 and sd["t"] == (1, 2)
    with pytest.raises(ValueError, match="checkpoint_id"):
        tt.save({"a": torch.ones(1)})


# ---------------------------------------------------------------------------------------------
# A newcomer's first models: ties, fresh optimizers, values the checkpoint lacks


class TiedLM(torch.nn.Module):
    """An embedding tied to the output head, as most language models have it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(x))))


def test_tied_weights_load_as_dcp_loads_them(tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = TiedLM()
    ckpt, dcp_ckpt = str(tmp_path / "t"), str(tmp_path / "dcp")
    tt.save({"model": model}, ckpt)
    dcp.save({"model": model.state_dict()}, checkpoint_id=dcp_ckpt)
    for source in (ckpt, dcp_ckpt):
        fresh = TiedLM()
        tt.load({"model": fresh}, source)
        assert fresh.head.weight is fresh.emb.weight  # still tied
        for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
            assert torch.equal(a, b), (source, name)


def test_a_fresh_optimizer_loads_as_a_stateful(tmp_path: Any) -> None:
    model = make_model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, optim, batches(2))
    ckpt = str(tmp_path / "o")
    tt.save({"model": model, "optim": optim, "epoch": 3}, ckpt)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    before = [p.detach().clone() for p in fresh.parameters()]
    sd = {"optim": fresh_optim, "epoch": 0}
    tt.load(sd, ckpt)  # the optimizer alone: creating its state must not move the parameters
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    tt.load({"model": fresh, "optim": fresh_optim, "epoch": 0}, ckpt)
    assert fresh_optim.state_dict()["param_groups"][0]["lr"] == pytest.approx(0.01) and sd["epoch"] == 3
    assert_trains_alike(model, optim, fresh, fresh_optim)


def test_strict_covers_values(tmp_path: Any) -> None:
    from tessera.errors import KeyMismatchError

    ckpt = str(tmp_path / "v")
    tt.save({"w": torch.ones(2), "step": 5}, ckpt)
    sd = {"w": torch.zeros(2), "step": 0, "epoch": 1, "sched": {"last": 2}}
    with pytest.raises(KeyMismatchError, match=r'Missing key\(s\) in state_dict: "epoch", "sched"\.') as e:
        tt.load(sd, ckpt)
    assert e.value.missing_keys == ["epoch", "sched"] and "strict=False" in str(e.value)
    tt.load(sd, ckpt, strict=False)
    assert sd["step"] == 5 and sd["epoch"] == 1 and sd["w"].tolist() == [1.0, 1.0]


def test_torch_layout_optimizer_state_loads_whole(tmp_path: Any) -> None:
    """OLMo-core 3.0's default: the optimizer state unflattened (``param_groups`` a list naming
    its ``params``), written by torch DCP itself; every value loads, none silently."""
    import torch.distributed.checkpoint as dcp

    model = make_model()
    groups = [
        {"params": [model[0].weight, model[0].bias], "lr": 0.01, "weight_decay": 0.1},
        {"params": [model[2].weight, model[2].bias], "lr": 0.02, "weight_decay": 0.0, "betas": (0.8, 0.9)},
    ]
    optim = torch.optim.AdamW(groups)
    train(model, optim, batches(2))
    opts = tt.StateDictOptions(flatten_optimizer_state_dict=False)
    ckpt = str(tmp_path / "dcp")
    dcp.save(
        {"model": tt.get_model_state_dict(model), "optim": tt.get_optimizer_state_dict(model, optim, options=opts)},
        checkpoint_id=ckpt,
    )
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))
    fresh_optim = torch.optim.AdamW(
        [{"params": list(fresh[0].parameters()), "lr": 1.0}, {"params": list(fresh[2].parameters()), "lr": 1.0}]
    )
    tt.load_model_and_optim_state(ckpt, fresh, fresh_optim)
    want, got = optim.state_dict(), fresh_optim.state_dict()
    for g_want, g_got in zip(want["param_groups"], got["param_groups"]):
        assert {k: v for k, v in g_want.items()} == {k: v for k, v in g_got.items()}
    for pid, state in want["state"].items():
        for name, value in state.items():
            assert torch.equal(got["state"][pid][name], value), (pid, name)
    full = tt.unshard_optim_state(ckpt)
    assert full["param_groups"]["2.weight"]["betas"] == (0.8, 0.9) or full["param_groups"]["2.weight"]["betas"] == [0.8, 0.9]
    assert full["param_groups"]["0.bias"]["lr"] == 0.01 and set(full["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_messages_say_what_was_looked_for_and_what_to_do(tmp_path: Any) -> None:
    from tessera.errors import NotFoundError, TesseraError

    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFoundError, match="the directory is empty"):
        tt.load({"w": torch.zeros(2)}, str(tmp_path / "empty"))
    runs = tmp_path / "runs"
    for step in ("step100", "step200"):
        tt.save({"w": torch.ones(2, 2)}, str(runs / step))
    with pytest.raises(NotFoundError, match=r"step100/, step200/ \(checkpoints\): pass one of them"):
        tt.load({"w": torch.zeros(2, 2)}, str(runs))
    with pytest.raises(TesseraError, match=r"stored global shape is \[2, 2\].*tensor of the stored shape") as e:
        tt.load({"w": torch.zeros(4, 1)}, str(runs / "step100"))
    assert "allow_shape_mismatch" not in str(e.value)  # not an argument tt.load takes


def test_a_tensor_stored_in_another_dtype_is_cast_on_load_as_dcp_casts(tmp_path: Any) -> None:
    """torchtitan's last-step export saves the model in bf16 (``export_dtype``); loading it into
    the fp32 model casts, as DCP's load does (``Tensor.copy_``)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    export = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    tt.save(export, str(tmp_path / "tessera"))
    dcp.save(export, checkpoint_id=str(tmp_path / "dcp"))
    for ckpt in ("tessera", "dcp"):
        ours = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        sd = ours.state_dict()
        tt.load(sd, str(tmp_path / ckpt))
        for k, v in sd.items():
            assert v.dtype == torch.float32
            assert torch.equal(v, export[k].to(torch.float32)), k
    # DCP itself, into fp32 targets, gives the same values.
    theirs = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(theirs, checkpoint_id=str(tmp_path / "dcp"))
    mine = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    tt.load(mine, str(tmp_path / "tessera"))
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    # Narrowing too (fp32 stored, bf16 requested), into a non-contiguous target.
    tt.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7}, str(tmp_path / "f32"))
    target = torch.zeros(3, 2, dtype=torch.bfloat16).t()
    tt.load({"w": target}, str(tmp_path / "f32"))
    assert torch.equal(target, (torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7).to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# DCP's call habits as torchtitan's CheckpointManager has them


class _RankData:
    """A dataloader's state as torchtitan keeps it: under a key of this data-parallel rank."""

    def __init__(self, rank: int, position: int) -> None:
        self.rank, self.position = rank, position

    def state_dict(self) -> Dict[str, Any]:
        return {f"dp_rank_{self.rank}": {"position": self.position, "epoch": 1}}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.position = sd[f"dp_rank_{self.rank}"]["position"]


def _save_per_rank_values(rank: int, world: int, ckpt: str, how: str) -> None:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

    state = {"w": torch.full((2,), float(rank)), "dataloader": _RankData(rank, 100 + rank), "step": 7}
    if how == "sync":
        tt.save(state, ckpt)
    elif how == "thread":
        assert tt.async_save(state, checkpoint_id=ckpt, process_group=dist.group.WORLD).result()["files"] >= 1
    else:  # torchtitan's async_with_pinned_mem call (pinning and non-blocking copies need CUDA)
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_async_staging=True, use_non_blocking_copy=False))
        response = tt.async_save(
            state,
            checkpoint_id=ckpt,
            process_group=dist.group.WORLD,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
        assert isinstance(response, AsyncSaveResponse)
        response.staging_completion.result()
        response.upload_completion.result()
        stager.close()


def _load_per_rank_values(rank: int, world: int, ckpt: str) -> None:
    state = {"w": torch.zeros(2), "dataloader": _RankData(rank, 0), "step": 0}
    tt.load(state, ckpt)
    assert state["dataloader"].position == 100 + rank and state["step"] == 7


@pytest.mark.parametrize("how", ["sync", "thread", "stager"])
def test_every_ranks_own_values_are_saved_and_handed_back(tmp_path: Any, how: str) -> None:
    """Each rank's dataloader state (a key of its own) is saved and each rank gets its own back,
    as DCP saves every rank's values; a key all ranks hold is stored once."""
    ckpt = str(tmp_path / how)
    run_ranks(2, _save_per_rank_values, ckpt, how)
    run_ranks(2, _load_per_rank_values, ckpt)
    from tessera import _native

    common = {tuple(p): v for p, v in _native.load_common(ckpt)}
    assert common[("dataloader", "dp_rank_0", "position")] == 100
    assert common[("dataloader", "dp_rank_1", "position")] == 101
    assert common[("step",)] == 7


def test_dcp_call_options_are_taken_or_refused_by_name(tmp_path: Any) -> None:
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    ckpt = str(tmp_path / "c")
    tt.save({"w": torch.ones(2)}, checkpoint_id=ckpt, planner=DefaultSavePlanner(), no_dist=True, use_collectives=True)
    out = {"w": torch.zeros(2)}
    tt.load(out, checkpoint_id=ckpt, planner=DefaultLoadPlanner(), no_dist=True)
    assert torch.equal(out["w"], torch.ones(2))

    class Custom(DefaultSavePlanner):
        pass

    with pytest.raises(TypeError, match="custom planner \\(Custom\\)"):
        tt.save({"w": torch.ones(2)}, str(tmp_path / "d"), planner=Custom())
    with pytest.raises(ValueError, match="use_collectives=False is not supported"):
        tt.async_save({"w": torch.ones(2)}, str(tmp_path / "d"), use_collectives=False)
    assert not (tmp_path / "d").exists()


# FSDP2 over tensor parallelism: FSDP shards dimension 0, which TP already sharded
# (_StridedShard), as torchtitan's 2-D parallelism does.


def _fsdp_tp_model(mesh_shape: tuple) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 6))
    if mesh_shape:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    return model


def _fsdp_tp_save(rank: int, world: int, ckpt: str) -> None:
    model = _fsdp_tp_model((2, 2))
    placements = {type(p).__name__ for t in model.state_dict().values() for p in t.placements}
    assert "_StridedShard" in placements, placements
    sd = get_sd(model)
    tt.save({"model": sd}, ckpt)


def get_sd(model: torch.nn.Module) -> Dict[str, Any]:
    return dict(model.state_dict())


def _fsdp_tp_load(rank: int, world: int, ckpt: str, mesh_shape: tuple) -> None:
    truth = _fsdp_tp_model(())
    model = _fsdp_tp_model(mesh_shape)
    sd = get_sd(model)
    for t in sd.values():
        (t.to_local() if hasattr(t, "to_local") else t).zero_()
    tt.load({"model": sd}, ckpt)
    for k, v in truth.state_dict().items():
        got = sd[k].full_tensor() if hasattr(sd[k], "full_tensor") else sd[k]
        assert torch.equal(got, v), k


def test_fsdp_over_tensor_parallel_saves_and_loads_at_other_sizes(tmp_path: Any) -> None:
    ckpt = str(tmp_path / "fsdp_tp")
    run_ranks(4, _fsdp_tp_save, ckpt)
    run_ranks(4, _fsdp_tp_load, ckpt, (2, 2))
    run_ranks(1, _fsdp_tp_load, ckpt, ())
    full = tt.unshard(ckpt)
    truth = _fsdp_tp_model(()).state_dict()
    assert all(torch.equal(full[f"model.{k}"], v) for k, v in truth.items())


def test_a_strided_shard_that_is_no_box_is_refused() -> None:
    from tessera._core.layout import _check_one_box

    class Mesh:
        def size(self, dim: int) -> int:
            return 2

    class Strided:
        dim, split_factor = 0, 2

        def is_shard(self) -> bool:
            return False

    Strided.__name__ = "_StridedShard"

    class T:
        shape = (8,)
        device_mesh = Mesh()
        placements = (Strided(),)

    # Rank 0 of 2 takes rows {0, 1} of chunk [0..4) and {4, 5} of [4..8): two runs.
    with pytest.raises(ValueError, match=r"holds global indices \[0, 1, 4, 5\], not one run 0..4"):
        _check_one_box(T(), [0], (4,), (0,))


# tessera.torch.dcp: DCP's defaults (a DCP directory, overwrite), as torchtitan's manager calls it


def _titan_like_save(rank: int, world: int, folder: str, step: int, mode: str) -> None:
    import tessera.torch.dcp as tdcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    model = shard(make_model())
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, optim, batches(step % 3 + 1))
    ts = TrainState()
    ts.step = step
    state = {**titan_state(model, optim, ts), "dataloader": _RankData(rank, 10 * step + rank)}
    ckpt = f"{folder}/step-{step}"
    if mode == "disabled":
        tdcp.save(state, checkpoint_id=ckpt)
    elif mode == "async":
        tdcp.async_save(state, checkpoint_id=ckpt, process_group=dist.new_group(backend="gloo")).result()
    else:
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_async_staging=True, use_non_blocking_copy=False))
        response = tdcp.async_save(
            state,
            checkpoint_id=ckpt,
            process_group=dist.new_group(backend="gloo"),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
        response.staging_completion.result()
        response.upload_completion.result()
        stager.close()
    full = full_state(model, optim)  # collective: every rank gathers
    if rank == 0:
        torch.save(full, f"{folder}/truth-{step}.pt")


def _titan_like_resume(rank: int, world: int, folder: str, step: int) -> None:
    import os
    import re

    import tessera.torch.dcp as tdcp

    # torchtitan's discovery: a step-N folder counts if it holds DCP's .metadata.
    found = [
        int(m.group(1))
        for name in os.listdir(folder)
        if (m := re.search(r"step-(\d+)", name)) and os.path.isfile(os.path.join(folder, name, ".metadata"))
    ]
    assert max(found) == step, found
    model = shard(make_model())
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    ts = TrainState()
    data = _RankData(rank, 0)
    tdcp.load({**titan_state(model, optim, ts), "dataloader": data}, checkpoint_id=f"{folder}/step-{step}")
    assert ts.step == step and data.position == 10 * step + rank
    truth = torch.load(f"{folder}/truth-{step}.pt")
    loaded = full_state(model, optim)
    assert all(torch.equal(loaded[k], v) for k, v in truth.items())


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_dcp_defaults_module_writes_dcp_directories_found_resumed_and_resaved(tmp_path: Any, mode: str) -> None:
    folder = str(tmp_path / "checkpoint")
    run_ranks(2, _titan_like_save, folder, 1, mode)
    run_ranks(2, _titan_like_save, folder, 2, mode)
    run_ranks(2, _titan_like_save, folder, 2, mode)  # re-saving a step replaces it, as DCP does
    run_ranks(2, _titan_like_resume, folder, 2)
    run_ranks(1, _titan_like_resume, folder, 2)
    # torch DCP itself reads the tensors of the directory.
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(f"{folder}/step-2").read_metadata()
    assert any(k.startswith("optimizer.state.") for k in meta.state_dict_metadata)


def test_a_hugging_face_storage_writer_gets_what_it_writes_from_dcp(tmp_path: Any) -> None:
    """tessera does not write Hugging Face's layout with DCP's sharding metadata: a
    HuggingFaceStorageWriter (torchtitan's last-step export) is handed to DCP's own save, and
    the files are what it writes; tessera reads them back."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    import tessera.torch.dcp as tdcp

    sd = {"model.w": torch.arange(6.0).reshape(2, 3), "model.b": torch.ones(3, dtype=torch.bfloat16)}
    out = tmp_path / "hf"
    writer = HuggingFaceStorageWriter(path=str(out), save_distributed=True, enable_consolidation=True)
    tdcp.save(sd, storage_writer=writer, no_dist=True)  # torchtitan's call, on one rank
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files, sorted(p.name for p in out.iterdir())
    stored = {k: v for f in files for k, v in load_file(str(out / f)).items()}
    assert stored.keys() == sd.keys() and all(torch.equal(stored[k], v) for k, v in sd.items())
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    tdcp.load(back, storage_reader=HuggingFaceStorageReader(str(out)))
    assert all(torch.equal(back[k], v) for k, v in sd.items())


# format="dcp": the values as DCP's own save stores them, for torch.distributed.checkpoint.load.


def _dcp_values_state(fill: bool, rank: int) -> Dict[str, Any]:
    """A state whose values are of every kind DCP keeps (ints, floats, strings, None, bools, a
    list of numbers, a list of dicts, a tuple, an optimizer state dict's parameter groups) and a
    key of this rank's own (a dataloader's position, as torchtitan keeps it); with ``fill`` the
    saved values, else a request of the same shape holding others."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    osd = optim.state_dict()
    v = (lambda saved, other: saved if fill else other)
    if not fill:
        for group in osd["param_groups"]:
            group.update(lr=0.0, betas=(0.0, 0.0), weight_decay=1.0, amsgrad=True)
        osd["state"] = {k: {n: torch.zeros_like(t) for n, t in s.items()} for k, s in osd["state"].items()}
    return {
        "model": {k: t if fill else torch.zeros_like(t) for k, t in model.state_dict().items()},
        "optim": osd,
        "step": v(7, 0),
        "loss": v(1.25, 0.0),
        "extra": {
            "name": v("run", ""),
            "none": v(None, 1),
            "flag": v(True, False),
            "sizes": v([1, 2, 3], [0]),
            "stages": v([{"name": "warmup", "steps": 10}, {"name": "decay", "steps": 90}], [{"name": "", "steps": 0}, {"name": "", "steps": 0}]),
            "shape": v((4, "x"), (0, "")),
        },
        "dataloader": {f"dp_rank_{rank}": {"position": v(100 + rank, 0)}},
    }


def _same(a: Any, b: Any, at: str = "") -> None:
    """Equal, with the same types (a tuple stays a tuple)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), at
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (at, a, b)
        for k in a:
            _same(a[k], b[k], f"{at}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (at, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{at}.{i}")
    else:
        assert type(a) is type(b) and a == b, (at, a, b)


def _save_dcp_values(rank: int, world: int, ckpt: str, how: str) -> None:
    state = _dcp_values_state(True, rank)
    if how == "async":
        tt.async_save(state, checkpoint_id=ckpt, format="dcp", process_group=dist.group.WORLD).result()
    else:
        tt.save(state, ckpt, format="dcp")


def _dcp_load_values(rank: int, world: int, ckpt: str) -> None:
    """torch's own DCP load, each rank requesting its own dataloader key."""
    import torch.distributed.checkpoint as dcp

    request = _dcp_values_state(False, rank)
    dcp.load(request, checkpoint_id=ckpt)
    _same(_dcp_values_state(True, rank), request)


@pytest.mark.parametrize("world,how", [(1, "sync"), (1, "async"), (2, "sync"), (2, "async")])
def test_dcp_format_values_load_through_torchs_own_dcp_load(tmp_path: Any, world: int, how: str) -> None:
    """A ``format="dcp"`` save's values are DCP byte items under DCP's keys: torch's own
    ``torch.distributed.checkpoint.load`` gives every one back, of its type (a tuple a tuple),
    every rank's own key included; ``common.pt`` still holds them for Megatron and tessera."""
    import torch.distributed.checkpoint as dcp

    ckpt = str(tmp_path / "ckpt")
    if world == 1 and how == "sync":
        _save_dcp_values(0, 1, ckpt, how)
    else:
        run_ranks(world, _save_dcp_values, ckpt, how)
    # Every rank's values, loaded in one process.
    for rank in range(world):
        request = _dcp_values_state(False, rank)
        dcp.load(request, checkpoint_id=ckpt, no_dist=True)
        _same(_dcp_values_state(True, rank), request)
    if world == 2:
        run_ranks(world, _dcp_load_values, ckpt)
    # DCP's own keys and paths, as its save records them.
    metadata = dcp.FileSystemReader(ckpt).read_metadata()
    assert metadata.planner_data["optim.param_groups.0.betas"] == ("optim", "param_groups", 0, "betas")
    assert metadata.planner_data["extra.stages.1.steps"] == ("extra", "stages", 1, "steps")
    assert metadata.planner_data["model.weight"] == ("model", "weight")
    assert metadata.planner_data["optim.state.0.exp_avg"] == ("optim", "state", "0", "exp_avg")
    # Megatron's common.pt as before, and tessera's load.
    common = torch.load(f"{ckpt}/common.pt", weights_only=True)
    assert common["step"] == 7 and common["extra"]["shape"] == (4, "x")
    assert common["dataloader"] == {f"dp_rank_{r}": {"position": 100 + r} for r in range(world)}
    # (tessera's load reads common.pt, whose "dataloader" holds every rank's key.)
    request, want = _dcp_values_state(False, world - 1), _dcp_values_state(True, world - 1)
    tt.load(request, ckpt)
    assert request.pop("dataloader") == common["dataloader"]
    want.pop("dataloader")
    _same(want, request)
