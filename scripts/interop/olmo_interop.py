"""Round trips between tessera.olmo_core and ai2-olmo-core 0.1.0 itself, both ways.

Run by scripts/interop/olmo_interop.sh in .venv-olmo (torch 2.7.1 + ai2-olmo-core 0.1.0 + tessera), on
CPU with gloo ranks started here. A TinyLM is trained 2 steps with AdamW (weight decay 0.1) and
saved; the truth is its full parameters (FSDP1: ``summon_full_params``) and OLMo-core's own
unshard of what it saved.

  olmo -> tessera  OLMo-core saves under FSDP1 at 2 ranks; tessera loads it into fresh models
                   and optimizers under FSDP1 at 3 ranks, FSDP2 at 3 ranks and a plain module:
                   parameters exactly as saved; tessera's unshard of model and optimizer state
                   equals OLMo-core's; tessera re-saves what it loaded, which unshards the same.
  tessera -> olmo  tessera saves under FSDP1 at 2 ranks, FSDP2 at 2 ranks and DDP at 2 ranks,
                   and FSDP1 before any optimizer step; OLMo-core loads each (FSDP1 at 3 ranks,
                   FSDP2, DDP and the step-0 FSDP1 at 2) with
                   ``load_model_and_optim_state``: parameters and optimizer state as saved; OLMo-
                   core's ``Checkpointer().unshard`` of tessera's files equals tessera's; a
                   ``Checkpointer`` directory of mixed dtypes, 0-d and empty tensors too.
  own FSDP         OLMo-core's own FSDP (ShardedFlatParameter) at 2 ranks: tessera's save of it
                   equals OLMo-core's, and each loads the other's.

OLMo-core 0.1.0 applies one optimizer step with zero gradients when it loads into an optimizer
without state (weight decay then scales the loaded parameters by 1 - lr*wd); before its loads
here the optimizer state is initialised first (``init_optimizer_state``), so that what is
compared is what it read. Exits non-zero on the first difference.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.nn as nn

from tessera._launch import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests/python"))
import olmo_models  # noqa: E402  (shared with the pytest suite)
from olmo_models import TinyLM, full_params, wrap  # noqa: E402

VOCAB, DIM, HIDDEN = 23, 8, 12


def make_model(seed: int) -> TinyLM:
    return olmo_models.make_model(seed, VOCAB, DIM, HIDDEN)


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    olmo_models.train(model, optim, steps, seed, VOCAB)


def same(a: Dict[str, Any], b: Dict[str, Any], what: str) -> None:
    if a.keys() != b.keys():
        raise AssertionError(f"{what}: keys differ: {sorted(a.keys() ^ b.keys())}")
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                raise AssertionError(f"{what}: {k} differs")
        elif x != y:
            raise AssertionError(f"{what}: {k}: {x!r} != {y!r}")


def olmo_unshard(ckpt: str) -> Dict[str, torch.Tensor]:
    from olmo_core.distributed.checkpoint import Checkpointer

    out = {f"model/{k}": v for k, v in Checkpointer().unshard(f"{ckpt}/model", no_dist=True).items()}
    out.update({f"optim/{k}": v for k, v in Checkpointer().unshard(f"{ckpt}/optim", no_dist=True).items() if k.startswith("state.")})
    return out


def tessera_unshard(ckpt: str) -> Dict[str, torch.Tensor]:
    from tessera.olmo_core import Checkpointer

    out = {f"model/{k}": v for k, v in Checkpointer().unshard(f"{ckpt}/model", no_dist=True).items()}
    out.update({f"optim/{k}": v for k, v in Checkpointer().unshard(f"{ckpt}/optim", no_dist=True).items() if k.startswith("state.")})
    return out


def strip_module(d: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k.replace("model/module.", "model/").replace("state.module.", "state."): v for k, v in d.items()}


# ---- steps run on ranks -----------------------------------------------------------------------


def save_step(rank: int, world: int, tmp: str, writer: str, kind: str, name: str, steps: int = 2) -> None:
    import olmo_core.distributed.checkpoint as olmo
    import tessera.olmo_core as tess

    model = wrap(kind, make_model(1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, optim, steps, seed=10 + rank)
    (olmo if writer == "olmo" else tess).save_model_and_optim_state(f"{tmp}/{name}", model, optim)
    params = full_params(model)
    if rank == 0:
        torch.save(params, f"{tmp}/{name}.truth.pt")


def load_step(rank: int, world: int, tmp: str, reader: str, kind: str, name: str) -> None:
    import olmo_core.distributed.checkpoint as olmo
    import tessera.olmo_core as tess

    truth = torch.load(f"{tmp}/{name}.truth.pt")
    model = wrap(kind, make_model(2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.0)
    if reader == "olmo":
        olmo.init_optimizer_state(optim)  # OLMo-core 0.1.0 would step a fresh optimizer after loading
        olmo.load_model_and_optim_state(f"{tmp}/{name}", model, optim)
    else:
        tess.load_model_and_optim_state(f"{tmp}/{name}", model, optim)
    same(full_params(model), {k: v for k, v in truth.items()}, f"{reader} loads {name} into {kind} at {world}")
    if optim.param_groups[0]["lr"] != 1e-2 or optim.param_groups[0]["weight_decay"] != 0.1:
        raise AssertionError(f"{reader} loads {name}: param group {optim.param_groups[0]}")
    # Re-save what was loaded with tessera: the optimizer state must have come through too.
    tess.save_model_and_optim_state(f"{tmp}/{name}.{reader}.{kind}{world}", model, optim)


def own_fsdp_step(rank: int, world: int, tmp: str) -> None:
    """OLMo-core's own FSDP (ShardedFlatParameter): tessera and OLMo-core save the same trained
    model; OLMo-core's unshards of both agree, and each library loads the other's checkpoint
    into a fresh model to the same parameters."""
    import olmo_core.distributed.checkpoint as olmo
    import tessera.olmo_core as tess
    from olmo_core.distributed.fsdp import FSDP

    model = FSDP(make_model(1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, optim, 2, seed=30 + rank)
    tess.save_model_and_optim_state(f"{tmp}/own_t", model, optim)
    olmo.save_model_and_optim_state(f"{tmp}/own_o", model, optim)
    dist.barrier()
    if rank == 0:
        same(olmo_unshard(f"{tmp}/own_t"), olmo_unshard(f"{tmp}/own_o"), "OLMo-core FSDP saved by tessera and by OLMo-core")
    by_tessera = FSDP(make_model(2))
    tess.load_model_and_optim_state(f"{tmp}/own_o", by_tessera, torch.optim.AdamW(by_tessera.parameters(), lr=0.5))
    by_olmo = FSDP(make_model(3))
    olmo_optim = torch.optim.AdamW(by_olmo.parameters(), lr=0.5)
    olmo.init_optimizer_state(olmo_optim)
    olmo.load_model_and_optim_state(f"{tmp}/own_t", by_olmo, olmo_optim)
    for (n, a), b, c in zip(by_tessera.named_parameters(), by_olmo.parameters(), model.parameters()):
        if not (torch.equal(a, b) and torch.equal(a, c)):
            raise AssertionError(f"OLMo-core FSDP: {n} differs after loading")


def main() -> None:
    import tessera.olmo_core as tess
    from olmo_core.distributed.checkpoint import Checkpointer as OlmoCheckpointer
    from olmo_core.distributed.checkpoint import unshard_optim_state as olmo_unshard_optim

    from importlib.metadata import version

    print(f"torch {torch.__version__}, ai2-olmo-core {version('ai2-olmo-core')}")
    tmp = tempfile.mkdtemp(prefix="olmo-interop-")
    started = time.monotonic()
    try:
        # OLMo-core writes, tessera reads.
        run_ranks(2, save_step, tmp, "olmo", "fsdp1", "olmo_fsdp1")
        run_ranks(3, load_step, tmp, "tessera", "fsdp1", "olmo_fsdp1")
        run_ranks(3, load_step, tmp, "tessera", "fsdp2", "olmo_fsdp1")
        load_step(0, 1, tmp, "tessera", "plain", "olmo_fsdp1")
        truth = olmo_unshard(f"{tmp}/olmo_fsdp1")
        same(tessera_unshard(f"{tmp}/olmo_fsdp1"), truth, "tessera's unshard of OLMo-core's checkpoint")
        for resaved in ("tessera.fsdp13", "tessera.fsdp23", "tessera.plain1"):
            same(tessera_unshard(f"{tmp}/olmo_fsdp1.{resaved}"), truth, f"OLMo-core's checkpoint reloaded ({resaved})")
        a, b = olmo_unshard_optim(f"{tmp}/olmo_fsdp1", no_dist=True), tess.unshard_optim_state(f"{tmp}/olmo_fsdp1", no_dist=True)
        # Pickled tuples come back as lists: the core decodes the pickle to plain values.
        plain = {k: list(v) if isinstance(v, tuple) else v for k, v in a["param_groups"][0].items()}
        same(plain, b["param_groups"][0], "unshard_optim_state param group")
        for pid in a["state"]:
            same(a["state"][pid], b["state"][pid], f"unshard_optim_state state {pid}")
        print("olmo -> tessera: FSDP1 w2 -> FSDP1 w3, FSDP2 w3, plain w1: exact")

        # tessera writes, OLMo-core reads.
        for kind, reader_world, steps in (("fsdp1", 3, 2), ("fsdp2", 2, 2), ("ddp", 2, 2), ("fsdp1", 2, 0)):
            # steps 0: saved before the first optimizer step (tessera then creates the state).
            name = f"tessera_{kind}_{steps}"
            run_ranks(2, save_step, tmp, "tessera", kind, name, steps)
            run_ranks(reader_world, load_step, tmp, "olmo", kind, name)
            mine = tessera_unshard(f"{tmp}/{name}")
            same(olmo_unshard(f"{tmp}/{name}"), mine, f"OLMo-core's unshard of tessera's {kind} checkpoint")
            same(tessera_unshard(f"{tmp}/{name}.olmo.{kind}{reader_world}"), mine, f"tessera's {kind} checkpoint through OLMo-core")
            print(f"tessera -> olmo: {kind} w2 ({steps} steps) -> {kind} w{reader_world}: exact")
        run_ranks(2, own_fsdp_step, tmp)
        print("OLMo-core's own FSDP w2: tessera's save = OLMo-core's; each loads the other's: exact")
        sd = {
            "w": torch.randn(5, 3),
            "h": torch.randn(4).to(torch.bfloat16),
            "f": torch.randn(3).to(torch.float16),
            "i": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "s": torch.tensor(2.5),
            "e": torch.empty(0, 4),
            "u": torch.arange(4, dtype=torch.uint8),
        }
        tess.Checkpointer().save(f"{tmp}/plain", sd)
        same(OlmoCheckpointer().unshard(f"{tmp}/plain", no_dist=True), sd, "OLMo-core unshards tessera's Checkpointer dir")
        target = {k: torch.zeros_like(v) for k, v in sd.items()}
        OlmoCheckpointer().load(f"{tmp}/plain", target)
        same(target, sd, "OLMo-core loads tessera's Checkpointer dir in place")
        print("tessera -> olmo: Checkpointer dir (f32, bf16, f16, i64, u8, 0-d, empty): exact")
        # An overwrite writes rank files of its own names beside the old ones, which stay whole
        # until the new metadata.json replaces the old (FORMAT.md): OLMo-core reads the files
        # metadata.json names.
        sd2 = {k: (v + 1 if v.is_floating_point() else v) for k, v in sd.items()}
        tess.Checkpointer().save(f"{tmp}/plain", sd2, save_overwrite=True)
        files = sorted(os.listdir(f"{tmp}/plain"))
        if any(f == "rank_0.safetensors" for f in files) or len(files) != 2:
            raise AssertionError(f"after the overwrite: {files}")
        same(OlmoCheckpointer().unshard(f"{tmp}/plain", no_dist=True), sd2, "OLMo-core unshards tessera's overwrite")
        print(f"tessera -> olmo: an overwrite ({files[1]}): exact")
        print(f"all round trips exact in {time.monotonic() - started:.0f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A rank that dies by a signal prints every thread's Python stack (ranks inherit this).
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
