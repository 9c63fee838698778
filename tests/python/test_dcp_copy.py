"""``tessera convert --to dcp`` makes a checkpoint that ``torch.distributed.checkpoint`` loads
with every value, as DCP itself would have written it: a state dict with an optimizer's
parameter groups loads whole (``load``), and so do the loads that rebuild the state dict from
the checkpoint alone (``planner_data``: what OLMo-core's ``load_keys`` and
``unshard_checkpoint`` do); and ``tessera diff`` finds the copy equal to its source.

The ``tessera`` command is ``$TESSERA_CLI`` when set (a binary built from this tree), else
``python -m tessera``."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict


def tessera(*args: str) -> subprocess.CompletedProcess:
    cli = os.environ.get("TESSERA_CLI")
    cmd: List[str] = [cli] if cli else [sys.executable, "-m", "tessera"]
    out = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"tessera {' '.join(args)}: {out.stdout}\n{out.stderr}"
    return out


def state(fill: bool) -> Dict[str, Any]:
    """A training state: a model, an optimizer's state and parameter groups (as
    ``get_optimizer_state_dict`` gives them), a step and assorted plain values; with ``fill``
    the saved values, else a request of the same structure holding other values."""
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=g)
        return x if fill else torch.zeros_like(x)

    v = (lambda saved, other: saved if fill else other)
    return {
        "model": {"layers.0.weight": t(4, 3), "layers.0.bias": t(4)},
        "optim": {
            "state": {
                "layers.0.weight": {"exp_avg": t(4, 3), "step": torch.tensor(v(3.0, 0.0))},
                "layers.0.bias": {"exp_avg": t(4), "step": torch.tensor(v(3.0, 0.0))},
            },
            "param_groups": [
                {
                    "lr": v(0.1, 0.0),
                    "betas": v((0.9, 0.95), (0.0, 0.0)),
                    "weight_decay": v(0.01, 1.0),
                    "params": ["layers.0.weight"],
                },
                {"lr": v(0.2, 0.0), "betas": v((0.8, 0.9), (0.0, 0.0)), "weight_decay": 0.0, "params": ["layers.0.bias"]},
            ],
        },
        "step": v(7, 0),
        "extra": {"name": v("run", ""), "flags": v([True, False], []), "none": v(None, 1), "nested": v([[1, 2], [3]], [])},
    }


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types: a tuple stays a tuple through the copy (Adam's
    ``betas``; OLMo-core 3.0 compares them by type)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.fixture()
def copy(tmp_path: Any) -> Dict[str, str]:
    """A state saved by DCP, converted to tessera's format, and that converted to DCP."""
    src, native, out = (str(tmp_path / n) for n in ("src", "native", "copy"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state(fill=True), checkpoint_id=src, no_dist=True)
    tessera("convert", src, native)
    tessera("convert", native, out, "--to", "dcp")
    return {"src": src, "native": native, "copy": out}


def test_dcp_loads_every_value_of_the_copy(copy: Dict[str, str]) -> None:
    request = state(fill=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(request, checkpoint_id=copy["copy"], no_dist=True)
    assert same(request, state(fill=True)), request
    assert request["optim"]["param_groups"][0]["lr"] == 0.1 and request["step"] == 7


def test_the_copy_records_the_paths_dcp_records(copy: Dict[str, str]) -> None:
    ours = dcp.FileSystemReader(copy["copy"]).read_metadata()
    theirs = dcp.FileSystemReader(copy["src"]).read_metadata()
    assert ours.planner_data == theirs.planner_data
    kinds = lambda m: {k: type(v).__name__ for k, v in m.state_dict_metadata.items()}  # noqa: E731
    assert kinds(ours) == kinds(theirs)


def test_loads_without_a_state_dict_rebuild_it_from_the_copy(copy: Dict[str, str], tmp_path: Any) -> None:
    # OLMo-core's load_keys / unshard_checkpoint: the keys asked for, nested as saved.
    optim: Dict[str, Any] = {}
    _load_state_dict(
        optim,
        storage_reader=dcp.FileSystemReader(copy["copy"]),
        planner=_EmptyStateDictLoadPlanner(keys=["optim"]),
        no_dist=True,
    )
    assert list(optim) == ["optim"] and same(optim["optim"], state(fill=True)["optim"]), optim
    # torch's own DCP-to-torch.save conversion: everything.
    whole = str(tmp_path / "whole.pt")
    dcp_to_torch_save(copy["copy"], whole)
    assert same(torch.load(whole, weights_only=False), state(fill=True))


def test_tessera_finds_the_copy_equal_to_its_source(copy: Dict[str, str]) -> None:
    out = tessera("diff", copy["native"], copy["copy"])
    assert "equal" in out.stdout, out.stdout
    out = tessera("diff", copy["src"], copy["copy"])
    assert "equal" in out.stdout, out.stdout
