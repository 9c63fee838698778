"""torchtitan 0.3.0's own CheckpointManager on tessera, against the same runs on torch DCP.

Run in `.venv-titan` (scripts/torchtitan-env.sh makes it): `bash scripts/torchtitan_interop.sh`.
Each scenario runs twice, once with torchtitan's `dcp` name as torch DCP and once as
`tessera.torch.dcp` (the switch the README shows), on CPU with gloo, and the final full model
and optimizer state of the two must be equal bit for bit; each run also checks what it can on
its own (the step it resumed from, each rank's data position). Scenarios, per `async_mode`
(disabled, async, async_with_pinned_mem):

1. train 2 ranks (FSDP2) steps 1..4, checkpoint every 2 steps (`keep_latest_k=2`), the last a
   full checkpoint; a step-3 folder left half written (no commit marker) must not be resumed;
2. a new job of 2 ranks resumes from the latest and trains to step 6;
3. a new job of 1 rank resumes from `load_step=4` (another world size) and trains to step 6;
4. a run of 2 ranks trains steps 1..2 and ends with a model-only export in bf16; a new job of
   1 rank in an empty folder starts from it (`initial_load_path`), casting bf16 to fp32.

On CPU, async_with_pinned_mem runs with its stager's pinning and non-blocking copies off (torch
refuses them without an accelerator), for both backends alike.

Prints one line per scenario and "torchtitan interop: all N scenarios match torch DCP".
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from tessera._launch import run_ranks

STEPS_FIRST, STEPS_ALL = 4, 6


class RankData:
    """A dataloader as torchtitan keeps one: its state under this data-parallel rank's key."""

    def __init__(self, rank: int) -> None:
        self.rank, self.position = rank, 0

    def batch(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.rank + self.position)
        self.position += 1
        return torch.randn(4, 8, generator=g)

    def state_dict(self) -> Dict[str, Any]:
        return {f"dp_rank_{self.rank}": {"position": self.position}}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.position = sd[f"dp_rank_{self.rank}"]["position"]


class TrainState:
    """torchtitan's Trainer as the `train_state` it saves."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def _job(rank: int, world: int, backend: str, folder: str, out: str, cfg: Dict[str, Any]) -> None:
    import torchtitan.components.checkpointer.dcp as titan_dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    if cfg["mode"] == "async_with_pinned_mem":
        # CPU only: torch's DefaultStager refuses pinned memory and non-blocking copies without
        # an accelerator, so the manager's StagingOptions are made without them, for both
        # backends alike; the rest of the mode (background staging, the AsyncSaveResponse it
        # waits on) is torchtitan's own.
        from torch.distributed.checkpoint.staging import StagingOptions

        def cpu_staging(*args: Any, **kwargs: Any) -> Any:
            options = StagingOptions(*args, **kwargs)
            options.use_pinned_memory = options.use_non_blocking_copy = False
            return options

        titan_dcp.StagingOptions = cpu_staging
    if backend == "tessera":
        import tessera.torch.dcp

        titan_dcp.dcp = tessera.torch.dcp  # the whole switch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
            implementation="for-loop",
        ),
        model_parts=[model],
    )
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS_ALL)
    data, ts = RankData(rank), TrainState()
    manager = CheckpointManager(
        CheckpointManager.Config(
            enable=True,
            folder=folder,
            interval=2,
            async_mode=cfg["mode"],
            keep_latest_k=2,
            load_step=cfg.get("load_step", -1),
            initial_load_path=cfg.get("initial_load_path"),
            last_save_model_only=cfg.get("last_save_model_only", False),
            export_dtype=cfg.get("export_dtype", "float32"),
        ),
        dataloader=data,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": ts},
        sd_adapter=None,
    )
    manager.load(step=cfg.get("load_step", -1))
    assert ts.step == cfg["resumed_at"], (ts.step, cfg["resumed_at"])
    if cfg["resumed_at"] and not cfg.get("initial_load_path"):
        assert data.position == cfg["resumed_at"] or world != cfg.get("saved_world", world), data.position
    for step in range(ts.step + 1, cfg["until"] + 1):
        x = data.batch()
        loss = model(x).square().mean()
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        ts.step, ts.ntokens_seen = step, ts.ntokens_seen + x.numel()
        manager.save(step, last_step=step == cfg["until"])
    manager.maybe_wait_for_saving()
    manager.close()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, optimizers.optimizers[0], options=full),
        "train_state": ts.state_dict(),
        "position": data.position,
    }
    if rank == 0:
        torch.save(state, out)
    dist.barrier()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _half_written_step(folder: str, step: int) -> None:
    """A step folder a crashed save left: data files, no commit marker."""
    path = os.path.join(folder, f"step-{step}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(b"partial")


def main() -> int:
    root = tempfile.mkdtemp(prefix="tessera-titan-")
    results: List[str] = []
    try:
        for mode in sys.argv[1:] or ("disabled", "async", "async_with_pinned_mem"):
            outs: Dict[str, Dict[str, Any]] = {}
            for backend in ("dcp", "tessera"):
                base = os.path.join(root, mode, backend)
                ckpt, export, fresh = (os.path.join(base, d) for d in ("ckpt", "export", "fresh"))
                o = {name: os.path.join(base, f"{name}.pt") for name in ("first", "resume2", "resume1", "export")}
                run_ranks(2, _job, backend, ckpt, o["first"], {"mode": mode, "resumed_at": 0, "until": STEPS_FIRST})
                _half_written_step(ckpt, STEPS_FIRST + 1)
                found = sorted(os.listdir(ckpt))
                # The switch took: tessera's DCP directories carry Megatron's common.pt beside
                # .metadata, torch DCP's do not.
                marker = os.path.exists(os.path.join(ckpt, f"step-{STEPS_FIRST}", "common.pt"))
                assert marker == (backend == "tessera"), (backend, os.listdir(os.path.join(ckpt, f"step-{STEPS_FIRST}")))
                kept = os.path.join(root, mode, backend + "-kept")
                shutil.copytree(ckpt, kept)
                run_ranks(2, _job, backend, ckpt, o["resume2"], {"mode": mode, "resumed_at": STEPS_FIRST, "until": STEPS_ALL})
                run_ranks(
                    1,
                    _job,
                    backend,
                    kept,
                    o["resume1"],
                    {"mode": mode, "resumed_at": STEPS_FIRST, "until": STEPS_ALL, "load_step": STEPS_FIRST, "saved_world": 2},
                )
                run_ranks(
                    2,
                    _job,
                    backend,
                    export,
                    o["export"] + ".train",
                    {"mode": mode, "resumed_at": 0, "until": 2, "last_save_model_only": True, "export_dtype": "bfloat16"},
                )
                run_ranks(
                    1,
                    _job,
                    backend,
                    fresh,
                    o["export"],
                    {"mode": mode, "resumed_at": 0, "until": 0, "initial_load_path": os.path.join(export, "step-2")},
                )
                outs[backend] = {k: torch.load(v, weights_only=False) for k, v in o.items()}
                outs[backend]["folders"] = found
            for name in ("first", "resume2", "resume1", "export"):
                same = _equal(outs["dcp"][name], outs["tessera"][name])
                results.append(f"{mode:22s} {name:8s} {'equal to torch DCP' if same else 'DIFFERENT from torch DCP'}")
                print(results[-1], flush=True)
            exported = outs["tessera"]["export"]["model"]
            assert all(v.dtype == torch.float32 for v in exported.values()), "the bf16 export loads into fp32"
            print(f"{mode:22s} step folders after the first run: dcp {outs['dcp']['folders']}, "
                  f"tessera {outs['tessera']['folders']}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    bad = [r for r in results if "DIFFERENT" in r]
    if bad:
        print(f"torchtitan interop: {len(bad)} of {len(results)} scenarios differ from torch DCP")
        return 1
    print(f"torchtitan interop: all {len(results)} scenarios match torch DCP")
    return 0


if __name__ == "__main__":
    sys.exit(main())
