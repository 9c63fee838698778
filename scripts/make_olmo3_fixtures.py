"""Writes a real ai2-olmo-core 3.0.0 checkpoint (``olmo_core.distributed.checkpoint``, a torch
DCP directory) as a test fixture for tessera, into crates/tessera/tests/fixtures/olmo3/.

  model_and_optim/  written by OLMo-core 3.0.0's own ``save_model_and_optim_state(dir, model,
                    optim)`` with its default options (unflattened optimizer state), on 2 gloo
                    ranks on CPU, the model under FSDP2 (``fully_shard`` on ``proj``, ``out``,
                    then the root, on a 1-D CPU DeviceMesh): ``.metadata`` (a pickled DCP
                    ``Metadata`` whose ``storage_data`` entries are OLMo-core's own
                    ``_StorageInfo``) and ``__{rank}_{n}.distcp`` files, each item one
                    ``torch.save`` record.
  expected.pt       ``torch.save({"model": ..., "optim": ...})``: the full model state dict and
                    the full unflattened optimizer state dict (``state`` keyed by parameter
                    FQN, ``param_groups`` with ``params`` as FQNs), gathered from the live
                    objects with torch's ``get_model_state_dict`` / ``get_optimizer_state_dict``
                    (``full_state_dict=True``), independently of what OLMo-core wrote.
  README.md         what wrote it, the versions, the key layout of ``.metadata``, the command.

The model (``TinyOlmo3``): an 11 x 8 embedding, ``proj`` Linear(8, 12) with bias, ``out``
Linear(12, 8) without bias, ``head`` Linear(8, 11) without bias whose weight is tied to the
embedding's (as OLMo-core's ``tie_word_embeddings``: one parameter, two state dict keys), and a
(1,) ``logit_scale`` (rank 1 holds an empty shard of it); odd row counts, so ``Shard(0)`` is
uneven. AdamW with two param groups (different lr, betas, eps, weight_decay), one
optimizer step on per-rank token batches from fixed seeds. ``OLMO_NUM_THREADS`` is set to 2
so that each rank writes 2 data files on any machine (OLMo-core's default is
``min(16, cpu_count + 4)`` files per rank).

Before replacing the fixture the script checks, in this process (no process group), that
OLMo-core's own ``unshard_checkpoint`` and ``load_keys`` give back exactly ``expected.pt``, and
that ``load_model_and_optim_state`` into a fresh model and optimizer does; it aborts on any
difference. Generation is deterministic except ``.metadata``'s ``storage_meta`` (a random
``save_id`` and the temporary directory it was written to).

Usage: .venv-olmo3/bin/python scripts/make_olmo3_fixtures.py [--out DIR]
(.venv-olmo3: bash scripts/olmo3-env.sh; tessera itself is not needed.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

os.environ.setdefault("OLMO_NUM_THREADS", "2")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "crates/tessera/tests/fixtures/olmo3"


def _launcher() -> Any:
    """tessera's one launcher (``tessera._launch.run_ranks``); read from the source tree when
    tessera is not built into this venv (the module needs only torch)."""
    try:
        from tessera._launch import run_ranks

        return run_ranks
    except ImportError:
        name = "tessera_launch_src"
        if name not in sys.modules:  # spawned ranks re-run this at import, before unpickling
            spec = importlib.util.spec_from_file_location(name, REPO / "python/tessera/_launch.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return sys.modules[name].run_ranks


run_ranks = _launcher()
warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # loads in one process

VOCAB, DIM, HIDDEN = 11, 8, 12
WORLD = 2
MODEL_SEED = 3030
DATA_SEED = 4040
# Two param groups; every hyperparameter differs between them.
GROUPS: Tuple[Dict[str, Any], ...] = (
    dict(names=("proj.weight", "out.weight"), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
    dict(names=("embed.weight", "proj.bias", "logit_scale"), lr=5e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
)
# What a loader builds its fresh optimizer with: unlike both groups, so a value that is not
# loaded shows.
FRESH = dict(lr=0.5, betas=(0.5, 0.5), eps=0.25, weight_decay=0.75)


# --------------------------------------------------------------------------- model


class TinyOlmo3(nn.Module):
    """embed -> proj (GELU) -> out (residual) -> head (tied to embed), times a (1,) logit
    scale."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, HIDDEN)
        self.out = nn.Linear(HIDDEN, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: named_parameters() lists embed.weight only
        self.logit_scale = nn.Parameter(torch.ones(1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.out(F.gelu(self.proj(x)))
        return self.head(x) * self.logit_scale


def make_model(seed: int = MODEL_SEED) -> TinyOlmo3:
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = TinyOlmo3()
    with torch.no_grad():
        model.logit_scale.fill_(1.25)
    return model


def shard(model: TinyOlmo3, world: int) -> nn.Module:
    """FSDP2 on a 1-D CPU mesh: ``proj`` and ``out`` their own groups, the rest (the tied
    embedding / head weight among them) the root's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.proj, mesh=mesh)
    fully_shard(model.out, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_optimizer(model: nn.Module, fresh: bool = False) -> torch.optim.Optimizer:
    params = dict(model.named_parameters())
    groups: List[Dict[str, Any]] = []
    for g in GROUPS:
        hyper = FRESH if fresh else {k: v for k, v in g.items() if k != "names"}
        groups.append(dict(params=[params[n] for n in g["names"]], **hyper))
    assert sum(len(g["params"]) for g in groups) == len(params)
    return torch.optim.AdamW(groups)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, rank: int) -> None:
    gen = torch.Generator().manual_seed(DATA_SEED + rank)  # each rank its own batch
    tokens = torch.randint(0, VOCAB, (3, 5), generator=gen)
    targets = torch.randint(0, VOCAB, (3, 5), generator=gen)
    loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
    optim.zero_grad()
    loss.backward()
    optim.step()


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """The full model and unflattened optimizer state dicts, by torch's state_dict API (a
    collective under FSDP2; with ``cpu_offload`` only rank 0 gets them)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, optim, options=opts),
    }


# --------------------------------------------------------------------------- comparing


def differences(got: Any, want: Any, path: str = "") -> List[str]:
    """Every difference between two state dicts: keys, tensor dtype/shape/bits, and the exact
    type and value of every other object (a list where a tuple was saved is a difference)."""
    out: List[str] = []
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{path}: {type(got).__name__}, want a tensor"]
        if got.dtype != want.dtype or got.shape != want.shape:
            return [f"{path}: {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"]
        if not torch.equal(got.reshape(-1).view(torch.uint8) if got.numel() else got, want.reshape(-1).view(torch.uint8) if want.numel() else want):
            out.append(f"{path}: values differ")
        return out
    if type(got) is not type(want):
        return [f"{path}: {type(got).__name__} {got!r}, want {type(want).__name__} {want!r}"]
    if isinstance(want, dict):
        for k in sorted(set(got) | set(want), key=str):
            if k not in got:
                out.append(f"{path}.{k}: missing")
            elif k not in want:
                out.append(f"{path}.{k}: unexpected")
            else:
                out += differences(got[k], want[k], f"{path}.{k}" if path else str(k))
        return out
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{path}: {len(got)} items, want {len(want)}"]
        for i, (a, b) in enumerate(zip(got, want)):
            out += differences(a, b, f"{path}.{i}")
        return out
    if got != want:
        out.append(f"{path}: {got!r}, want {want!r}")
    return out


# --------------------------------------------------------------------------- writing


def write_rank(rank: int, world: int, staging: str) -> None:
    import olmo_core.distributed.checkpoint as olmo

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # Linear's 3-D output is a view

    model = shard(make_model(), world)
    optim = make_optimizer(model)
    train_step(model, optim, rank)
    olmo.save_model_and_optim_state(f"{staging}/model_and_optim", model, optim)
    truth = full_state(model, optim)
    if rank == 0:
        torch.save(truth, f"{staging}/expected.pt")


def metadata_layout(ckpt: Path) -> Dict[str, Any]:
    """The key layout of a DCP ``.metadata``: tensor keys (shape, dtype, chunks), byte-item keys
    with the Python type of their value, and ``planner_data``."""
    from olmo_core.distributed.checkpoint import get_checkpoint_metadata, load_keys
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    md = get_checkpoint_metadata(ckpt)
    tensors: Dict[str, Any] = {}
    values: Dict[str, Any] = {}
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks]
            tensors[key] = (tuple(item.size), str(item.properties.dtype).replace("torch.", ""), chunks)
        else:
            assert isinstance(item, BytesStorageMetadata), (key, item)
            values[key] = None
    # By top-level prefix and planner_data path: load_keys of a key under a list
    # ("optim.param_groups.0.lr") raises KeyError '0' in OLMo-core 3.0 itself.
    roots = sorted({md.planner_data[k][0] for k in values})
    loaded = dict(zip(roots, load_keys(ckpt, roots)))
    for key in values:
        obj: Any = loaded
        for part in md.planner_data[key]:
            obj = obj[part]
        values[key] = obj
    files: Dict[str, List[str]] = {}
    for index, info in md.storage_data.items():
        files.setdefault(info.relative_path, []).append(index.fqn)
    return {
        "tensors": tensors,
        "values": values,
        "planner_data": dict(md.planner_data or {}),
        "files": files,
        "storage_info_class": {f"{type(i).__module__}.{type(i).__qualname__}" for i in md.storage_data.values()},
        "version": getattr(md, "version", None),
    }


def verify(staging: Path) -> Tuple[Dict[str, Any], List[str]]:
    """OLMo-core's unshard, load_keys and load of the new checkpoint against expected.pt."""
    import olmo_core.distributed.checkpoint as olmo

    ckpt = staging / "model_and_optim"
    expected = torch.load(staging / "expected.pt", weights_only=False)
    problems: List[str] = []
    with tempfile.TemporaryDirectory() as unsharded:
        with contextlib.redirect_stdout(io.StringIO()):  # quiet=True still prints blank lines
            model_pt, optim_pt = olmo.unshard_checkpoint(ckpt, unsharded, optim=True, quiet=True)
        assert optim_pt is not None
        problems += [f"unshard model: {d}" for d in differences(torch.load(model_pt, weights_only=False), expected["model"])]
        problems += [f"unshard optim: {d}" for d in differences(torch.load(optim_pt, weights_only=False), expected["optim"])]
    (model_keys,) = olmo.load_keys(ckpt, ["model"])
    problems += [f"load_keys model: {d}" for d in differences(model_keys, expected["model"])]
    model = make_model(seed=1)
    optim = make_optimizer(model, fresh=True)
    olmo.load_model_and_optim_state(ckpt, model, optim)
    problems += [f"load: {d}" for d in differences(full_state(model, optim), expected)]
    if model.head.weight is not model.embed.weight:
        problems.append("load: head.weight is no longer tied to embed.weight")
    return expected, problems


def write_readme(out: Path, layout: Dict[str, Any]) -> None:
    from importlib.metadata import version

    def fmt(v: Any) -> str:
        return f"`{v!r}` ({type(v).__name__})"

    sizes = {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file() and p.name != "README.md"}
    lines = [
        "# OLMo-core 3.0 checkpoint (`olmo_core.distributed.checkpoint`, torch DCP)",
        "",
        f"Written by ai2-olmo-core {version('ai2-olmo-core')} itself (torch {torch.__version__}, CPU, "
        f"{WORLD} gloo ranks) with `scripts/make_olmo3_fixtures.py`, for tessera's reading and writing of",
        "OLMo-core 3.0 / DCP checkpoints (issue 30, points 4 and 6).",
        "",
        "- `model_and_optim/`: `save_model_and_optim_state(dir, model, optim)` with its default options",
        "  (`flatten_optimizer_state=False`: the optimizer state is saved unflattened, as",
        "  `get_optimizer_state_dict` returns it, then DCP flattens the whole `{\"model\", \"optim\"}` dict",
        "  into dotted keys). FSDP2 (`fully_shard` on `proj`, `out`, then the root; 1-D CPU mesh of 2).",
        "  `.metadata` is a pickled DCP `Metadata`; its `storage_data` values are",
        f"  `{', '.join(sorted(layout['storage_info_class']))}` (fields `relative_path`, `offset`,",
        "  `length`), so unpickling it with Python needs olmo_core importable. Every item in a",
        "  `__{rank}_{n}.distcp` file is one `torch.save` record (tensors: the local shard).",
        "  `OLMO_NUM_THREADS=2`: 2 data files per rank. `storage_meta` holds a random `save_id` and the",
        "  temporary path it was written to. torch's own `FileSystemReader` (`dcp.load(sd, checkpoint_id=",
        "  dir)`) cannot read this directory (`'_StorageInfo' object has no attribute",
        "  'transform_descriptors'`); OLMo-core's reader reads torch's `_StorageInfo` (the 3 fields) fine.",
        "- `expected.pt`: `torch.save({\"model\": full model state dict, \"optim\": full unflattened optimizer",
        "  state dict})`, from torch's `get_model_state_dict` / `get_optimizer_state_dict`",
        "  (`full_state_dict=True`) on the live objects. OLMo-core's `unshard_checkpoint`, `load_keys`",
        "  and `load_model_and_optim_state` (fresh model and optimizer, one process) give it back exactly",
        "  (checked by the script before it writes, and by `scripts/olmo3_interop.sh --fixture`).",
        "",
        f"Model `TinyOlmo3` (vocab {VOCAB}, dim {DIM}, hidden {HIDDEN}): `embed` Embedding, `proj` Linear with",
        "bias, `out` and `head` Linear without bias, `logit_scale` (1,) (rank 1 holds an empty shard).",
        "`head.weight` is tied to `embed.weight` (one parameter: OLMo-core's `tie_word_embeddings`), so the",
        "model state has both keys (the same values stored twice) and the optimizer state only",
        "`embed.weight`. AdamW, two param groups:",
        "",
    ]
    for i, g in enumerate(GROUPS):
        lines.append(f"- group {i}: {', '.join(g['names'])}: lr {g['lr']}, betas {g['betas']}, eps {g['eps']}, weight_decay {g['weight_decay']}")
    lines += [
        "",
        "one optimizer step (per-rank batches, fixed seeds).",
        "",
        "## `.metadata`",
        "",
        f"`Metadata.version` is {layout['version']!r} (OLMo-core's writer does not set it; torch's `FileSystemWriter`",
        "writes its `CURRENT_DCP_VERSION`, \"1.0.0\" in torch 2.13).",
        "",
        "Tensor keys (`TensorStorageMetadata`; shape, dtype, chunks as (offsets, sizes)):",
        "",
    ]
    for key, (size, dtype, chunks) in layout["tensors"].items():
        lines.append(f"- `{key}` {list(size)} {dtype}: {', '.join(f'{list(o)}+{list(s)}' for o, s in chunks)}")
    lines += ["", "Byte items (`BytesStorageMetadata`, one Python object each; value and type):", ""]
    for key, value in layout["values"].items():
        lines.append(f"- `{key}` = {fmt(value)}")
    lines += [
        "",
        "Each byte item is stored as DCP's `DefaultSavePlanner` writes one: a whole `torch.save`",
        "archive (zip, `archive/data.pkl`) of the object, which `DefaultLoadPlanner.load_bytes`",
        "reads with `torch.load(weights_only=False)`.",
    ]
    lines += [
        "",
        "`planner_data` maps every key above (tensor or byte item) to its path in the nested state",
        "dict; string path elements are dict keys, integers list indices, e.g.:",
        "",
    ]
    examples = [k for k in layout["planner_data"] if k.startswith("model.")][:1]
    examples += [k for k in layout["planner_data"] if k.startswith("optim.state.")][:2]
    examples += [k for k in layout["planner_data"] if k.startswith("optim.param_groups.")][:2]
    for k in examples:
        lines.append(f"- `{k}` -> `{layout['planner_data'][k]!r}`")
    lines += ["", "Files (bytes) and what each holds:", ""]
    for name, size in sizes.items():
        held = layout["files"].get(name[len("model_and_optim/") :], [])
        lines.append(f"- `{name}` {size}" + (f": {', '.join(sorted(set(held)))}" if held else ""))
    lines += [
        "",
        "## Regenerating",
        "",
        "```sh",
        "bash scripts/olmo3-env.sh                # once: .venv-olmo3 with ai2-olmo-core 3.0.0 (torch 2.13)",
        ".venv-olmo3/bin/python scripts/make_olmo3_fixtures.py",
        "bash scripts/olmo3_interop.sh --fixture  # OLMo-core 3.0 loads it back",
        "```",
        "",
        "Under a minute on 2 CPU cores. A rerun writes the same bytes for every file but `.metadata`",
        "(its `storage_meta`: a random `save_id` and the temporary directory the script wrote into).",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def main() -> None:
    from importlib.metadata import version

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, ai2-olmo-core {version('ai2-olmo-core')}, OLMO_NUM_THREADS={os.environ['OLMO_NUM_THREADS']}")
    started = time.monotonic()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".olmo3-staging-", dir=args.out.parent))
    try:
        run_ranks(WORLD, write_rank, str(staging))
        _, problems = verify(staging)
        if problems:
            raise SystemExit("OLMo-core 3.0 does not give back what was saved:\n  " + "\n  ".join(problems))
        layout = metadata_layout(staging / "model_and_optim")
        args.out.mkdir(exist_ok=True)
        for name in ("model_and_optim", "expected.pt"):
            target = args.out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
            shutil.move(str(staging / name), str(target))
        elapsed = time.monotonic() - started
        write_readme(args.out, layout)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.out} ({total} bytes) in {elapsed:.1f} s; unshard, load_keys and load give back expected.pt exactly")


if __name__ == "__main__":
    main()
