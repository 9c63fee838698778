"""tessera.olmo_core.v3: OLMo-core 3.x's ``olmo_core.distributed.checkpoint`` API over tessera.

Runs with the project's torch (no ai2-olmo-core here); OLMo-core 3.0.0's own Trainer and loads
run against it in .venv-olmo3 (scripts/interop/olmo3_trainer.sh, scripts/interop/olmo3_interop.sh)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import tessera.olmo_core.v3 as v3
from tessera._launch import run_ranks
import olmo_models
from olmo_models import TinyLM, full_params, wrap

VOCAB, DIM, HIDDEN = 19, 8, 12


def make_model(seed: int) -> TinyLM:
    return olmo_models.make_model(seed, VOCAB, DIM, HIDDEN)


def fresh(seed: int, kind: str = "plain") -> tuple:
    """A model with other weights and an optimizer with other hyperparameters and no state:
    everything must come from the checkpoint."""
    model = wrap(kind, make_model(seed))
    return model, torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.1, 0.2), weight_decay=0.0)


def full_optim(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def assert_same_optim(got: Dict[str, Any], want: Dict[str, Any], what: str) -> None:
    assert got["param_groups"] == want["param_groups"], what
    assert got["state"].keys() == want["state"].keys(), what
    for fqn, state in want["state"].items():
        for name, t in state.items():
            assert torch.equal(got["state"][fqn][name], t), (what, fqn, name)


def _save_fsdp2_w2(rank: int, world: int, tmp: str) -> None:
    model = wrap("fsdp2", make_model(1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    olmo_models.train(model, optim, 2, 10 + rank, VOCAB)
    v3.save_model_and_optim_state(f"{tmp}/A", model, optim)
    params, osd = full_params(model), full_optim(model, optim)
    if rank == 0:
        torch.save({"model": params, "optim": osd}, f"{tmp}/truth.pt")


def _load_w3(rank: int, world: int, tmp: str) -> None:
    truth = torch.load(f"{tmp}/truth.pt", weights_only=False)
    model, optim = fresh(2, "fsdp2")
    v3.load_model_and_optim_state(f"{tmp}/A", model, optim)
    assert all(torch.equal(a, truth["model"][k]) for k, a in full_params(model).items())
    osd = full_optim(model, optim)  # whole on rank 0 only (cpu_offload)
    if rank == 0:
        assert_same_optim(osd, truth["optim"], f"fsdp2 world {world}")
    assert isinstance(optim.param_groups[0]["betas"], tuple)
    v3.save_model_and_optim_state(f"{tmp}/B", model, optim)
    dist.barrier()


def test_fsdp2_w2_loads_into_w3_and_one_process(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    run_ranks(2, _save_fsdp2_w2, tmp)
    run_ranks(3, _load_w3, tmp)
    truth = torch.load(f"{tmp}/truth.pt", weights_only=False)
    for ckpt in ("A", "B"):
        model, optim = fresh(3)
        v3.load_model_and_optim_state(f"{tmp}/{ckpt}", model, optim)
        assert all(torch.equal(p, truth["model"][k]) for k, p in full_params(model).items()), ckpt
        assert_same_optim(full_optim(model, optim), truth["optim"], ckpt)
    # The metadata OLMo-core's train modules read: DCP's keys, the optimizer unflattened.
    keys = v3.get_checkpoint_metadata(f"{tmp}/A").state_dict_metadata
    assert "model.embed.weight" in keys and "optim.state.embed.weight.exp_avg" in keys
    # torch DCP itself reads the model tensors.
    import torch.distributed.checkpoint as dcp

    model = make_model(4)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=f"{tmp}/A", no_dist=True)
    assert all(torch.equal(sd["model"][k], truth["model"][k]) for k in truth["model"])


def _trained(tmp: Any) -> tuple:
    model = make_model(5)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    olmo_models.train(model, optim, 2, 3, VOCAB)
    ckpt = str(tmp / "ck")
    v3.save_model_and_optim_state(ckpt, model, optim)
    return model, optim, ckpt


def test_unshard_checkpoint_and_load_keys(tmp_path: Any) -> None:
    model, optim, ckpt = _trained(tmp_path)
    want_model = model.state_dict()
    want_optim = full_optim(model, optim)
    model_path, optim_path = v3.unshard_checkpoint(ckpt, tmp_path / "one")
    assert (model_path, optim_path) == (tmp_path / "one" / "model.pt", tmp_path / "one" / "optim.pt")
    got = torch.load(model_path)
    assert got.keys() == want_model.keys() and all(torch.equal(got[k], want_model[k]) for k in got)
    got_optim = torch.load(optim_path, weights_only=False)
    assert got_optim["state"].keys() == want_optim["state"].keys()
    assert torch.equal(got_optim["state"]["lm_head.weight"]["exp_avg"], want_optim["state"]["lm_head.weight"]["exp_avg"])
    assert got_optim["param_groups"][0]["lr"] == 1e-2
    # An existing file is kept unless save_overwrite.
    before = model_path.read_bytes()
    with pytest.raises(FileExistsError):
        v3.unshard_checkpoint(ckpt, tmp_path / "one")
    assert model_path.read_bytes() == before
    v3.unshard_checkpoint(ckpt, tmp_path / "one", save_overwrite=True)

    per_tensor, none = v3.unshard_checkpoint(ckpt, tmp_path / "per", unshard_strategy=v3.UnshardStrategy.one_file_per_tensor())
    assert none is None
    assert torch.equal(torch.load(per_tensor / "model-embed-weight.pt")["embed.weight"], want_model["embed.weight"])
    chunks, _ = v3.unshard_checkpoint(
        ckpt, tmp_path / "chunks", use_safetensors=True, unshard_strategy=v3.UnshardStrategy.chunks(200)
    )
    from safetensors.torch import load_file

    merged: Dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(chunks)):
        merged.update(load_file(chunks / f))
    assert len(os.listdir(chunks)) > 1 and merged.keys() == want_model.keys()
    with pytest.raises(NotImplementedError):
        v3.unshard_checkpoint(ckpt, tmp_path / "x", optim=True, use_safetensors=True)
    with pytest.raises(ValueError):
        v3.UnshardStrategy(name=v3.UnshardStrategyType.chunks)

    whole, weight, lr, exp_avg = v3.load_keys(
        ckpt, ["model", "model.lm_head.weight", "optim.param_groups.0.lr", "optim.state.lm_head.weight.exp_avg"]
    )
    assert whole.keys() == want_model.keys()
    assert torch.equal(weight, want_model["lm_head.weight"]) and lr == 1e-2
    assert torch.equal(exp_avg, want_optim["state"]["lm_head.weight"]["exp_avg"])
    with pytest.raises(KeyError, match="model.nope"):
        list(v3.load_keys(ckpt, ["model.nope"]))


def test_key_mapping_strict_and_overwrite(tmp_path: Any) -> None:
    model, optim, ckpt = _trained(tmp_path)

    class Renamed(TinyLM):
        """The same model whose head has another name."""

        def __init__(self) -> None:
            super().__init__(VOCAB, DIM, HIDDEN)
            self.head = self.lm_head
            del self.lm_head

    other = Renamed()
    other_optim = torch.optim.AdamW(other.parameters(), lr=0.5)
    v3.load_model_and_optim_state(ckpt, other, other_optim, key_mapping={"head.weight": "lm_head.weight"})
    assert torch.equal(other.head.weight, model.lm_head.weight)
    assert torch.equal(
        full_optim(other, other_optim)["state"]["head.weight"]["exp_avg"],
        full_optim(model, optim)["state"]["lm_head.weight"]["exp_avg"],
    )
    # Without the mapping the head is missing from the checkpoint, and strict says which.
    with pytest.raises(KeyError, match="head.weight"):
        v3.load_model_and_optim_state(ckpt, Renamed(), None)

    # A non-empty directory needs save_overwrite; an overwrite replaces the checkpoint whole.
    with pytest.raises(FileExistsError):
        v3.save_model_and_optim_state(ckpt, model, optim)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    v3.save_model_and_optim_state(ckpt, model, optim, save_overwrite=True)
    again, _ = fresh(6)
    v3.load_model_and_optim_state(ckpt, again)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


def test_state_dicts_sync_and_async(tmp_path: Any) -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 7, "nested": {"name": "run", "xs": [1, 2]}}
    v3.save_state_dict(tmp_path / "s", state)
    future = v3.async_save_state_dict(tmp_path / "a", state)
    assert future.result() is None
    for where in ("s", "a"):
        got = {"w": torch.zeros(2, 3), "step": 0, "nested": {"name": "", "xs": []}}
        v3.load_state_dict(tmp_path / where, got)
        assert torch.equal(got["w"], state["w"]) and got["step"] == 7 and got["nested"] == state["nested"]
    with pytest.raises(FileExistsError):
        v3.save_state_dict(tmp_path / "s", state)
    v3.save_state_dict(tmp_path / "s", {**state, "step": 8}, save_overwrite=True)
    got = {"step": 0}
    v3.load_state_dict(tmp_path / "s", got)
    assert got["step"] == 8


def test_state_dict_helpers_of_the_train_modules() -> None:
    sd: Dict[str, Any] = {
        "model": {"blocks.0.w": 1, "head.w": 2},
        "optim": {"state": {"blocks.0.w": {"exp_avg": 3}}, "param_groups": [{"lr": 0.1, "params": ["blocks.0.w", "head.w"]}]},
    }
    import copy

    pruned = copy.deepcopy(sd)
    allowed = {"model.blocks.0.w", "optim.state.blocks.0.w.exp_avg", "optim.param_groups.0.lr"}
    assert v3.prune_state_dict(pruned, allowed) == {"model.head.w", "optim.param_groups.0.params"}
    assert pruned["model"] == {"blocks.0.w": 1} and pruned["optim"]["param_groups"] == [{"lr": 0.1}]
    v3.merge_state_dicts(pruned, sd)
    assert pruned == sd
    swapped = copy.deepcopy(sd)
    v3.swap_param_keys(swapped, {"head.w": "lm_head.w"})
    assert "lm_head.w" in swapped["model"] and swapped["optim"]["param_groups"][0]["params"] == ["blocks.0.w", "lm_head.w"]
    v3.swap_param_keys(swapped, {"head.w": "lm_head.w"}, reverse=True, quiet=True)
    assert swapped == sd
    flat = {"model": {"head.w": 2}, "optim": {"state.head.w.exp_avg": 3, "param_groups.head.w.lr": 0.1}}
    v3.swap_param_keys(flat, {"head.w": "lm_head.w"})
    assert flat["optim"] == {"state.lm_head.w.exp_avg": 3, "param_groups.lm_head.w.lr": 0.1}


def test_stands_in_for_olmo_cores_module(tmp_path: Any, monkeypatch: Any) -> None:
    """The README's one line: every public name of OLMo-core 3.0's module, its submodules, and
    OLMo-core's ``_StorageInfo`` (named in the .metadata OLMo-core writes) resolve."""
    monkeypatch.setitem(sys.modules, "olmo_core.distributed.checkpoint", v3)
    from olmo_core.distributed.checkpoint import (  # type: ignore[import-not-found]  # noqa: F401
        RemoteFileSystemReader,
        RemoteFileSystemWriter,
        UnshardStrategy,
        UnshardStrategyType,
        async_save_model_and_optim_state,
        async_save_state_dict,
        get_checkpoint_metadata,
        load_keys,
        load_model_and_optim_state,
        load_state_dict,
        merge_state_dicts,
        prune_state_dict,
        save_model_and_optim_state,
        save_state_dict,
        swap_param_keys,
        unshard_checkpoint,
    )
    from tessera.olmo_core.v3.filesystem import _StorageInfo

    assert _StorageInfo("__0_0.distcp", 0, 4).length == 4
    # OLMo-core's DCP storage classes hand a checkpoint to torch's own save and load.
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(4.0)}
    dcp.save(state, storage_writer=RemoteFileSystemWriter(tmp_path / "d", thread_count=2), no_dist=True)
    got = {"w": torch.zeros(4)}
    dcp.load(got, storage_reader=RemoteFileSystemReader(tmp_path / "d"), no_dist=True)
    assert torch.equal(got["w"], state["w"])
    with pytest.raises(ValueError, match="object stores"):
        RemoteFileSystemWriter("s3://bucket/ckpt")
    f = async_save_model_and_optim_state(tmp_path / "m", make_model(0))
    assert f.result() is None and (Path(tmp_path) / "m" / ".metadata").is_file()


OLMO3_FIXTURE = Path(__file__).resolve().parents[2] / "crates" / "tessera" / "tests" / "fixtures" / "olmo3"


def test_reads_what_olmo_core_3_wrote() -> None:
    """The checkpoint ai2-olmo-core 3.0.0 wrote (2 FSDP2 ranks; tied embedding and head; two
    param groups) loads whole into one process through the 3.x API, and unshards and
    load_keys give its contents."""
    from test_olmo3 import _expected, _fresh

    want = _expected()
    ckpt = str(OLMO3_FIXTURE / "model_and_optim")
    model, optim = _fresh()
    v3.load_model_and_optim_state(ckpt, model, optim)
    assert model.head.weight is model.embed.weight
    for key, value in want["model"].items():
        assert torch.equal(model.state_dict()[key], value), key
    got = full_optim(model, optim)
    for g_got, g_want in zip(got["param_groups"], want["optim"]["param_groups"]):
        assert g_got == g_want
    for fqn, state in want["optim"]["state"].items():
        for name, value in state.items():
            assert torch.equal(got["state"][fqn][name], value), (fqn, name)
    lr, exp_avg = v3.load_keys(ckpt, ["optim.param_groups.1.lr", "optim.state.proj.weight.exp_avg"])
    assert lr == want["optim"]["param_groups"][1]["lr"]
    assert torch.equal(exp_avg, want["optim"]["state"]["proj.weight"]["exp_avg"])
    meta = v3.get_checkpoint_metadata(ckpt)
    assert "optim.param_groups.0.params" in meta.state_dict_metadata  # OLMo-core's own test of the layout


def test_the_0_1_api_names_the_3_x_module_for_a_3_x_checkpoint() -> None:
    import tessera.olmo_core as oc
    from tessera.errors import NotFoundError
    from test_olmo3 import _fresh

    model, optim = _fresh()
    with pytest.raises(NotFoundError, match="tessera.olmo_core.v3"):
        oc.load_model_and_optim_state(str(OLMO3_FIXTURE), model, optim)
