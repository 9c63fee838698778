"""A checkpoint OLMo-core 3.0 wrote itself (crates/tessera/tests/fixtures/olmo3: 2 FSDP2 ranks,
torch DCP, the optimizer state unflattened as OLMo-core saves it by default) loads whole
through tessera.torch: every tensor and every optimizer value, none silently left behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import torch
import torch.nn as nn

import tessera.torch as tt

FIXTURE = Path(__file__).resolve().parents[2] / "crates" / "tessera" / "tests" / "fixtures" / "olmo3"


class TinyOlmo3(nn.Module):
    """The fixture's model (scripts/fixtures/make_olmo3_fixtures.py): head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 12)
        self.out = nn.Linear(12, 8, bias=False)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight
        self.logit_scale = nn.Parameter(torch.ones(1))


def _fresh() -> tuple:
    model = TinyOlmo3()
    p = dict(model.named_parameters())
    # Other hyperparameters than the saved ones: the load must replace every one of them.
    optim = torch.optim.AdamW(
        [
            {"params": [p["proj.weight"], p["out.weight"]], "lr": 1.0, "betas": (0.5, 0.5), "weight_decay": 0.5},
            {"params": [p["embed.weight"], p["proj.bias"], p["logit_scale"]], "lr": 1.0, "eps": 0.5},
        ]
    )
    return model, optim


def _expected() -> Dict[str, Any]:
    return torch.load(FIXTURE / "expected.pt", weights_only=True)


def test_an_olmo_core_3_checkpoint_loads_whole() -> None:
    model, optim = _fresh()
    tt.load_model_and_optim_state(str(FIXTURE / "model_and_optim"), model, optim)
    want = _expected()
    assert model.head.weight is model.embed.weight
    for key, value in want["model"].items():
        assert torch.equal(model.state_dict()[key], value), key
    opts = tt.StateDictOptions(flatten_optimizer_state_dict=False)
    got = tt.get_optimizer_state_dict(model, optim, options=opts)
    assert len(got["param_groups"]) == len(want["optim"]["param_groups"])
    for g_got, g_want in zip(got["param_groups"], want["optim"]["param_groups"]):
        assert g_got == g_want
    for param, state in want["optim"]["state"].items():
        for name, value in state.items():
            assert torch.equal(got["state"][param][name], value), (param, name)


def test_an_olmo_core_3_checkpoint_unshards_with_its_param_groups() -> None:
    full = tt.unshard_optim_state(str(FIXTURE / "model_and_optim"))
    want = _expected()["optim"]
    for group in want["param_groups"]:
        for param in group["params"]:
            got = full["param_groups"][param]
            for name, value in group.items():
                if name == "params":
                    continue
                # No request to give them a type: a tuple comes back as the list it is stored as.
                assert (list(got[name]) if isinstance(value, tuple) else got[name]) == (
                    list(value) if isinstance(value, tuple) else value
                ), (param, name)
    for param, state in want["state"].items():
        for name, value in state.items():
            assert torch.equal(full["state"][param][name], value), (param, name)
    model = tt.unshard_model_state(str(FIXTURE / "model_and_optim"))
    for key, value in _expected()["model"].items():
        assert torch.equal(model[key], value), key
