"""torchtitan 0.3.0's own CheckpointManager on tessera, against the same runs on torch DCP.

Run in `.venv-titan` (scripts/env/torchtitan_env.sh makes it): `bash scripts/interop/torchtitan_interop.sh`.
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
   1 rank in an empty folder starts from it (`initial_load_path`), casting bf16 to fp32;

and once each, `seed`: a seed checkpoint (step 0, model only, from 1 rank), a 2-rank job that
starts from it and trains to step 2, and one that resumes with `exclude_from_loading`
(dataloader, LR scheduler) and trains to step 4; `tp`: 4 ranks with FSDP2 over tensor parallelism (a 2 x 2 mesh, `_StridedShard`)
train steps 1..2, and new jobs of 2 and of 1 rank (FSDP only) resume and train to step 4;
`hf`: 2 ranks train a tiny transformers Llama and end with the last step exported in Hugging
Face's layout (`last_save_in_hf`, a state-dict adapter spreading the tensors over two files:
torchtitan's sharded path, consolidated by torch), which `safetensors` and transformers'
`from_pretrained` read as the trained model; a new 1-rank job starts from it
(`initial_load_in_hf`). Arguments name the scenarios to run (modes,
`hf`); none runs all.

On CPU, async_with_pinned_mem runs with its stager's pinning and non-blocking copies off (torch
refuses them without an accelerator), for both backends alike.

Prints one line per scenario and "torchtitan interop: all N scenarios match torch DCP".
"""

from __future__ import annotations

import json
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

    def tokens(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.rank + self.position)
        self.position += 1
        return torch.randint(0, 32, (2, 8), generator=g)

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


def _tiny_llama() -> Any:
    """A Hugging Face model (transformers' Llama, tiny), so that the export can be checked by
    transformers itself: ``from_pretrained`` of the exported folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _hf_adapter(keys: List[str]) -> Any:
    """A state-dict adapter as torchtitan's models have one. The model is already Hugging
    Face's, so names stay; ``fqn_to_index_mapping`` spreads the tensors over two files, so the
    export takes torchtitan's sharded path (per-rank files, then torch's consolidation)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

    class Adapter(BaseStateDictAdapter):
        def __init__(self) -> None:
            self.hf_assets_path = None
            self.fqn_to_index_mapping = {k: 1 + i % 2 for i, k in enumerate(keys)}

        def to_hf(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
            return dict(state_dict)

        def from_hf(self, hf_state_dict: Dict[str, Any]) -> Dict[str, Any]:
            return dict(hf_state_dict)

        def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> Any:
            return HuggingFaceStorageReader(path)

    return Adapter()


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
    torch.manual_seed(cfg.get("init_seed", 0))  # a seed checkpoint's model starts elsewhere
    if cfg.get("hf"):
        model = _tiny_llama()
    else:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    dp_rank = rank
    if cfg.get("tp"):
        # torchtitan's 2-D parallelism: tensor parallel inside pairs of ranks, FSDP2 across them
        # (FSDP shards the dimension TP sharded: _StridedShard).
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        dp_rank = mesh["dp"].get_local_rank()
    else:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
            implementation="for-loop",
        ),
        model_parts=[model],
    )
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS_ALL)
    data, ts = RankData(dp_rank), TrainState()
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
            last_save_in_hf=cfg.get("hf", False),
            initial_load_in_hf=cfg.get("hf", False) and bool(cfg.get("initial_load_path")),
            export_dtype=cfg.get("export_dtype", "float32"),
            exclude_from_loading=cfg.get("exclude", []),
        ),
        dataloader=data,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": ts},
        sd_adapter=_hf_adapter(list(model.state_dict())) if cfg.get("hf") else None,
    )
    manager.load(step=cfg.get("load_step", -1))
    assert ts.step == cfg["resumed_at"], (ts.step, cfg["resumed_at"])
    if cfg["resumed_at"] and not cfg.get("initial_load_path") and "dataloader" not in cfg.get("exclude", []):
        assert data.position == cfg["resumed_at"] or world != cfg.get("saved_world", world), data.position
    if "dataloader" in cfg.get("exclude", []):
        assert data.position == 0, data.position
    if cfg.get("seed"):
        manager.save(0, last_step=True)  # the trainer's create_seed_checkpoint
    for step in range(ts.step + 1, cfg["until"] + 1):
        if cfg.get("hf"):
            x = data.tokens()
            loss = model(x).logits.square().mean()
        else:
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


def _compare(label: str, runs: Dict[str, Dict[str, Any]], names: Any, results: List[str]) -> None:
    """Adds (and prints) one line per scenario: the tessera run's result against torch DCP's."""
    for name in names:
        same = _equal(runs["dcp"][name], runs["tessera"][name])
        results.append(f"{label:22s} {name:8s} {'equal to torch DCP' if same else 'DIFFERENT from torch DCP'}")
        print(results[-1], flush=True)


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
        modes = [m for m in sys.argv[1:] if m not in ("hf", "tp", "seed")] if sys.argv[1:] else ["disabled", "async", "async_with_pinned_mem"]
        for mode in modes:
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
            _compare(mode, outs, ("first", "resume2", "resume1", "export"), results)
            exported = outs["tessera"]["export"]["model"]
            assert all(v.dtype == torch.float32 for v in exported.values()), "the bf16 export loads into fp32"
            print(f"{mode:22s} step folders after the first run: dcp {outs['dcp']['folders']}, "
                  f"tessera {outs['tessera']['folders']}", flush=True)
        # A seed checkpoint (step 0, model only), a job that starts from it, and one that
        # resumes with the dataloader and LR scheduler excluded from loading.
        if not sys.argv[1:] or "seed" in sys.argv[1:]:
            seed: Dict[str, Any] = {}
            for backend in ("dcp", "tessera"):
                base = os.path.join(root, "seed", backend)
                ckpt = os.path.join(base, "ckpt")
                o = {name: os.path.join(base, f"{name}.pt") for name in ("seed", "start", "exclude")}
                plain = {"mode": "disabled", "last_save_model_only": True}
                run_ranks(1, _job, backend, ckpt, o["seed"], {**plain, "resumed_at": 0, "until": 0, "seed": True, "init_seed": 123})
                run_ranks(2, _job, backend, ckpt, o["start"], {"mode": "disabled", "resumed_at": 0, "until": 2})
                excluded = {"mode": "disabled", "resumed_at": 2, "until": 4, "exclude": ["dataloader", "lr_scheduler"]}
                run_ranks(2, _job, backend, ckpt, o["exclude"], excluded)
                seed[backend] = {k: torch.load(v, weights_only=False) for k, v in o.items()}
                # The seed holds the model only, under DCP's commit marker (what torchtitan finds);
                # the jobs start from other weights (init_seed), so a missed seed shows as a
                # difference from torch DCP's run below.
                assert os.path.isfile(os.path.join(ckpt, "step-0", ".metadata"))
            _compare("seed, exclude", seed, ("seed", "start", "exclude"), results)
        # FSDP2 over TP on 4 ranks (2 x 2), resumed by FSDP alone at 2 ranks and at 1.
        if not sys.argv[1:] or "tp" in sys.argv[1:]:
            tp: Dict[str, Any] = {}
            for backend in ("dcp", "tessera"):
                base = os.path.join(root, "tp", backend)
                ckpt, kept = os.path.join(base, "ckpt"), os.path.join(base, "kept")
                o = {name: os.path.join(base, f"{name}.pt") for name in ("first", "resume2", "resume1")}
                run_ranks(4, _job, backend, ckpt, o["first"], {"mode": "disabled", "resumed_at": 0, "until": 2, "tp": True})
                shutil.copytree(ckpt, kept)
                again = {"mode": "disabled", "resumed_at": 2, "until": 4, "saved_world": 4}
                run_ranks(2, _job, backend, ckpt, o["resume2"], again)
                run_ranks(1, _job, backend, kept, o["resume1"], {**again, "load_step": 2})
                tp[backend] = {k: torch.load(v, weights_only=False) for k, v in o.items()}
            _compare("fsdp+tp 2x2", tp, ("first", "resume2", "resume1"), results)
        # The last step exported in Hugging Face's layout (a HuggingFaceStorageWriter, torch's
        # consolidation of the per-rank files), then the start of a new job from it.
        if not sys.argv[1:] or "hf" in sys.argv[1:]:
            hf: Dict[str, Any] = {}
            for backend in ("dcp", "tessera"):
                base = os.path.join(root, "hf", backend)
                export, fresh = os.path.join(base, "export"), os.path.join(base, "fresh")
                cfg = {"mode": "disabled", "resumed_at": 0, "until": 2, "last_save_model_only": True, "hf": True}
                run_ranks(2, _job, backend, export, os.path.join(base, "train.pt"), cfg)
                step = os.path.join(export, "step-2")
                index = json.load(open(os.path.join(step, "model.safetensors.index.json")))
                files = sorted(set(index["weight_map"].values()))
                from safetensors.torch import load_file

                tensors = {k: v for f in files for k, v in load_file(os.path.join(step, f)).items()}
                load = {**cfg, "until": 0, "initial_load_path": step}
                run_ranks(1, _job, backend, fresh, os.path.join(base, "fresh.pt"), load)
                hf[backend] = {"files": files, "tensors": tensors, "fresh": torch.load(os.path.join(base, "fresh.pt"), weights_only=False)}
                trained = torch.load(os.path.join(base, "train.pt"), weights_only=False)["model"]
                assert _equal(trained, tensors), "the export is the trained model"
                # transformers itself loads the export (given the model's config.json, which a
                # user keeps with the tokenizer in the HF assets).
                from transformers import LlamaForCausalLM

                _tiny_llama().config.save_pretrained(step)
                loaded = LlamaForCausalLM.from_pretrained(step, dtype=torch.float32).state_dict()
                assert _equal(trained, loaded), "transformers' from_pretrained gives the trained model"
            _compare("hf export", hf, ("files", "tensors", "fresh"), results)
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
