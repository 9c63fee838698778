"""Generates the synthetic foreign-format checkpoints of crates/tessera/tests/fixtures/foreign/.

The real checkpoints there (dcp_single, dcp_fsdp2, dcp_mesh2d, megatron_tp2_dp2) were written
by torch / Megatron-Core themselves and are copied, never regenerated; this script writes only
the variants below, each as ``NAME/`` (the checkpoint), ``NAME.expected.safetensors`` (every
full tensor under the checkpoint's flat key) and ``NAME.expected.json`` (the non-tensor values:
for plain DCP the byte items keyed by flat fqn, lists and dicts flattened with "." like
dcp_single's ``lrs.0``; for Megatron ``{"common": ..., "sharded_objects": {"key/shard_..": v}}``).

  dcp_zstd              torch DCP, 1 process, ``FileSystemWriter(_extensions=[ZStandard()])``:
                        every item zstd-compressed (``transform_descriptors=['stream.zstd/1']``).
  dcp_per_item          DCP, 2 gloo ranks, ``single_file_per_rank=False`` (one file per item):
                        DTensor Shard(0), uneven Shard(1), a replicated tensor, a byte item.
  olmo_core             OLMo-core layout: ``olmo_core/model_and_optim/`` is DCP (2 ranks, model
                        + flattened AdamW state) whose ``.metadata`` names
                        ``olmo_core.distributed.checkpoint.filesystem._StorageInfo``, plus
                        ``olmo_core/train/rank0.pt`` (ignored by readers). The expected files
                        describe ``model_and_optim``.
  dcp_legacy            DCP, 2 ranks, ``.metadata`` rewritten as an older torch wrote it: pickle
                        protocol 3 (GLOBAL opcodes, no FRAME), ``TensorProperties`` under
                        ``torch.distributed._shard.sharded_tensor.metadata`` with a 5-item state
                        (no strides), ``MEM_FORMAT_ENCODING`` (old name), and ``Metadata``
                        without ``storage_meta`` / ``version``.
  megatron_zarr         Megatron-Core legacy ``zarr`` backend written the way
                        ``ZarrSaveShardedStrategy`` did (zarr v2 arrays, chunks = local shard
                        shape, no compressor, bf16 as raw V2 with ``"dtype": "bfloat16"``),
                        ShardedObjects as ``key/shard_<off>_<shape>.pt``, ``common.pt``.
  megatron_common_item  Megatron ``torch_dist`` as newer Megatron writes it: DCP + metadata.json,
                        no ``common.pt``; the common state is the byte item
                        ``common_state/shard_0_1`` = ``torch.save([common_dict])`` (ShardedObjects
                        are ``torch.save([data])``, as in megatron_tp2_dp2).
  dcp_hf_sharded        DCP, 2 gloo ranks, ``HuggingFaceStorageWriter(save_distributed=True)``:
                        per-rank ``shard-0000{r+1}-model-00001-of-00001.safetensors`` whose
                        ``__metadata__`` ``DCP_SHARDING_INFO`` gives each piece's
                        ``saved_offsets``; no index, no global shape (same tensors as
                        dcp_per_item, no byte items: the writer stores tensors only).
  dcp_hf_consolidated   The same with ``enable_consolidation=True``: the pieces under
                        ``sharded/``, the full tensors in ``model-00001-of-00001.safetensors``
                        with ``model.safetensors.index.json`` (``c`` is f16 here: torch 2.15's
                        consolidation fails on integer dtypes).
  dcp_no_collectives    DCP, 2 gloo ranks, ``dcp.save(..., use_collectives=False)``: each rank
                        its own ``__{r}_0.distcp`` and ``__{r}.metadata``, no ``.metadata``
                        (the replicated tensor and the byte items are stored by both ranks).

Data is deterministic (fixed seeds); ``.metadata`` files still differ between runs (DCP puts
a random ``save_id`` in them). Checkpoints are written with relative paths from inside the
output directory, so no absolute path ends up in a pickle. Every generated checkpoint is read
back (torch DCP / a zarr chunk reader written here) and compared with its expected tensors.

Needs: torch with torch.distributed (gloo), safetensors, zstandard, ``zarr<3`` (see
requirements-dev.txt), and tessera (its launcher, ``tessera._launch``, starts the 2 ranks).

Usage: .venv/bin/python scripts/make_foreign_fixtures.py [--out DIR] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import pickle
import pickletools
import shutil
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from tessera._launch import run_ranks

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "crates" / "tessera" / "tests" / "fixtures" / "foreign"
GENERATED = [
    "dcp_zstd",
    "dcp_per_item",
    "olmo_core",
    "dcp_legacy",
    "megatron_zarr",
    "megatron_common_item",
    "dcp_large_item",
    "dcp_hf_sharded",
    "dcp_hf_consolidated",
    "dcp_no_collectives",
]
# Written by the 2-rank job; the others are written by this process.
DISTRIBUTED = [
    "dcp_per_item",
    "olmo_core",
    "dcp_legacy",
    "megatron_common_item",
    "dcp_hf_sharded",
    "dcp_hf_consolidated",
    "dcp_no_collectives",
]
WORLD = 2
SIZE_LIMIT = 100 * 1024
# dcp_large_item needs one item past the reader's 64 KiB head to show in-place ranged reads.
SIZE_LIMITS = {"dcp_large_item": 160 * 1024}


# ---------------------------------------------------------------------------------------------
# Deterministic values


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def randn(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float32).to(dtype)


def randint(seed: int, *shape: int, low: int = -(2**40), high: int = 2**40) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=_gen(seed), dtype=torch.int64)


def full_tensors(name: str) -> Dict[str, torch.Tensor]:
    """Every full tensor of fixture ``name`` under its flat checkpoint key."""
    if name == "dcp_zstd":
        return {
            "model.w_f32": randn(101, 6, 5),
            "model.w_bf16": randn(102, 8, 4, dtype=torch.bfloat16),
            "model.ids_i64": randint(103, 12),
            # Compresses well: the items' compressed length is much smaller than the raw one.
            "model.zeros_f32": torch.zeros(32, 32),
        }
    if name == "dcp_large_item":
        # 136 x 128 f32 = 68 KiB: the tensor's item is longer than the 64 KiB head a reader
        # reads to locate the data, so loading a few rows must not read the whole item.
        return {"w": randn(701, 136, 128), "b": randn(702, 4, 8, dtype=torch.bfloat16)}
    if name == "dcp_hf_consolidated":
        # torch 2.15's consolidation takes torch.finfo of every dtype, which fails for integer
        # ones: c is f16 here.
        return {**full_tensors("dcp_per_item"), "c": randn(205, 5, 3, dtype=torch.float16)}
    if name in ("dcp_per_item", "dcp_hf_sharded", "dcp_no_collectives"):
        return {
            "a": randn(201, 6, 4),  # Shard(0), even
            "b": randn(202, 3, 5, dtype=torch.bfloat16),  # Shard(1), uneven: 3 + 2 columns
            "c": randint(203, 5, 3),  # Shard(0), uneven: 3 + 2 rows
            "r": randn(204, 4),  # Replicate: stored once
        }
    if name == "olmo_core":
        out: Dict[str, torch.Tensor] = {}
        for i, (param, shape, dtype) in enumerate(OLMO_PARAMS):
            out[f"model.{param}"] = randn(300 + i, *shape, dtype=dtype)
            out[f"optim.state.{param}.exp_avg"] = randn(320 + i, *shape) * 0.01
            out[f"optim.state.{param}.exp_avg_sq"] = randn(340 + i, *shape).abs() * 0.001
            out[f"optim.state.{param}.step"] = torch.tensor(3.0)
        return out
    if name == "dcp_legacy":
        return {
            "model.w": randn(401, 6, 4),  # Shard(0)
            "model.emb": randn(402, 5, 3, dtype=torch.float16),  # Shard(0), uneven
            "model.ids": randint(403, 4),  # plain tensor on both ranks: stored once
        }
    if name == "megatron_zarr":
        return {
            # key with dots; bf16 split in 2 on axis 0
            "embedding.word_embeddings.weight": randn(501, 8, 6, dtype=torch.bfloat16),
            # key with a slash (nested directory); 10 rows in chunks of 4: padded edge chunk
            "decoder/layers.fc1.weight": randn(502, 10, 6),
            "decoder.final_norm.weight": randn(503, 6, dtype=torch.float16),
            "step_counts": randint(504, 3, 4),  # split in 2 on axis 1
        }
    if name == "megatron_common_item":
        return {
            "decoder.layers.mlp.weight": randn(601, 8, 6),  # split in 2 on axis 0
            "decoder.final_norm.weight": randn(602, 6, dtype=torch.bfloat16),  # rank 0 only
        }
    raise KeyError(name)


OLMO_PARAMS: List[Tuple[str, Tuple[int, ...], torch.dtype]] = [
    ("embeddings.weight", (10, 6), torch.float32),
    ("blocks.0.attention.w_q.weight", (6, 6), torch.float32),
    ("blocks.0.attention.w_q.bias", (6,), torch.float32),
    ("lm_head.w_out.weight", (10, 6), torch.bfloat16),
]
OLMO_GROUP = {"lr": 0.0004, "betas": (0.9, 0.95), "eps": 1e-08, "weight_decay": 0.1, "foreach": None}

ZSTD_VALUES = {"step": 11, "note": "zstd", "lrs": [0.5, 0.25]}
PER_ITEM_VALUES = {"epoch": 5}
LEGACY_VALUES = {"epoch": 2, "tag": "old-torch"}
ZARR_COMMON = {"iteration": 77, "args": {"lr": 0.5, "name": "zarr"}}
ZARR_OBJECTS = {f"rng_state/shard_{r}_4": {"rank": r, "seed": 5, "tracker": [r, r + 1]} for r in range(4)}
COMMON_ITEM_COMMON = {"iteration": 99, "args": {"lr": 0.25, "name": "common_item"}, "checkpoint_version": 3.0}
COMMON_ITEM_OBJECTS = {f"rng_state/shard_{r}_2": {"rank": r, "seed": 99} for r in range(WORLD)}
MEGATRON_TORCH_DIST_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
MEGATRON_ZARR_JSON = {
    "sharded_backend": "zarr",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def olmo_values() -> Dict[str, Any]:
    """OLMo-core's flattened optimizer param groups: ``param_groups.<param>.<hyperparameter>``."""
    out: Dict[str, Any] = {}
    for param, _, _ in OLMO_PARAMS:
        for k, v in OLMO_GROUP.items():
            out[f"optim.param_groups.{param}.{k}"] = v
    return out


def flatten_value(prefix: str, value: Any, out: Dict[str, Any]) -> None:
    """dcp_single's expected.json style: nested lists/tuples/dicts become ``prefix.i`` keys."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            flatten_value(f"{prefix}.{k}", v, out)
    elif isinstance(value, (list, tuple)) and value:
        for i, v in enumerate(value):
            flatten_value(f"{prefix}.{i}", v, out)
    else:
        out[prefix] = list(value) if isinstance(value, tuple) else value


def expected_json(name: str) -> Dict[str, Any]:
    flat: Dict[str, Any] = {}
    if name == "dcp_zstd":
        values = ZSTD_VALUES
    elif name in ("dcp_per_item", "dcp_no_collectives"):
        values = PER_ITEM_VALUES
    elif name in ("dcp_hf_sharded", "dcp_hf_consolidated"):
        values = {}
    elif name == "olmo_core":
        values = olmo_values()
    elif name == "dcp_legacy":
        values = LEGACY_VALUES
    elif name == "dcp_large_item":
        values = {}
    elif name == "megatron_zarr":
        return {"common": ZARR_COMMON, "sharded_objects": ZARR_OBJECTS}
    elif name == "megatron_common_item":
        return {"common": COMMON_ITEM_COMMON, "sharded_objects": COMMON_ITEM_OBJECTS}
    else:
        raise KeyError(name)
    for k, v in values.items():
        flatten_value(k, v, flat)
    return flat


def write_expected(out: Path, name: str) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in full_tensors(name).items()}
    save_file(tensors, str(out / f"{name}.expected.safetensors"))
    # Same style as the shared fixtures: indent 1, sorted keys, no trailing newline.
    (out / f"{name}.expected.json").write_text(json.dumps(expected_json(name), indent=1, sort_keys=True))


# ---------------------------------------------------------------------------------------------
# Single-process fixtures


def write_dcp_zstd(ckpt: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    if not ZStandard.is_available():
        raise SystemExit("dcp_zstd needs the zstandard (or pyzstd) module: pip install zstandard")
    t = full_tensors("dcp_zstd")
    state = {"model": {k.split(".", 1)[1]: v for k, v in t.items()}, **copy.deepcopy(ZSTD_VALUES)}
    writer = FileSystemWriter(ckpt, _extensions=[ZStandard()])
    dcp.save(state, storage_writer=writer, no_dist=True)


def write_dcp_large_item(ckpt: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(dict(full_tensors("dcp_large_item")), checkpoint_id=str(ckpt), no_dist=True)


def write_megatron_zarr(ckpt: Path) -> None:
    """As Megatron-Core's ZarrSaveShardedStrategy: one zarr v2 array per key, chunked by the
    local shard shape, every shard written into its region; objects and common via torch.save."""
    import zarr

    t = full_tensors("megatron_zarr")
    # key -> (chunk = local shard shape); shards tile the global shape in steps of the chunk.
    chunks = {
        "embedding.word_embeddings.weight": (4, 6),
        "decoder/layers.fc1.weight": (4, 6),  # 10 rows: shards 0:4, 4:8, 8:10
        "decoder.final_norm.weight": (6,),
        "step_counts": (3, 2),
    }
    ckpt.mkdir(parents=True)
    for key, full in t.items():
        chunk = chunks[key]
        bf16 = full.dtype == torch.bfloat16
        np_dtype = np.dtype("V2") if bf16 else _numpy_dtype(full.dtype)
        arr = zarr.create(
            tuple(full.shape),
            dtype=np_dtype,
            store=str(ckpt / key),
            chunks=chunk,
            compressor=None,
            fill_value=None,
            write_empty_chunks=True,
        )
        for region in _regions(tuple(full.shape), chunk):
            shard = full[region]
            data = shard.view(torch.int16).numpy().view("V2") if bf16 else shard.numpy()
            arr[region] = data
        if bf16:
            zarray_path = ckpt / key / ".zarray"
            raw = zarray_path.read_bytes()
            # Megatron replaced b'<V2' (ml_dtypes' bfloat16 has dtype.str '<V2'); plain numpy
            # 'V2' is written as '|V2'. Either way the file ends up saying "bfloat16".
            for old in (b'"<V2"', b'"|V2"'):
                raw = raw.replace(old, b'"bfloat16"')
            if b'"bfloat16"' not in raw:
                raise SystemExit(f"unexpected .zarray for {key}: {raw!r}")
            zarray_path.write_bytes(raw)
    for unique_key, value in ZARR_OBJECTS.items():
        path = ckpt / f"{unique_key}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(value, path)
    torch.save(ZARR_COMMON, ckpt / "common.pt")
    (ckpt / "metadata.json").write_text(json.dumps(MEGATRON_ZARR_JSON))


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return {torch.float32: np.dtype("<f4"), torch.float16: np.dtype("<f2"), torch.int64: np.dtype("<i8")}[dtype]


def _regions(shape: Tuple[int, ...], chunk: Tuple[int, ...]) -> Iterator[Tuple[slice, ...]]:
    import itertools

    ranges = [range(0, s, c) for s, c in zip(shape, chunk)]
    for starts in itertools.product(*ranges):
        yield tuple(slice(o, min(o + c, s)) for o, c, s in zip(starts, chunk, shape))


# ---------------------------------------------------------------------------------------------
# The 2-rank job


def _rank_main(rank: int, world: int, out: str, names: List[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.chdir(out)  # relative checkpoint paths: no absolute path in the pickles
    mesh = init_device_mesh("cpu", (world,))
    for name in names:
        {
            "dcp_per_item": _write_dcp_per_item,
            "olmo_core": _write_olmo_core,
            "dcp_legacy": _write_dcp_legacy_base,
            "megatron_common_item": _write_megatron_common_item,
            "dcp_hf_sharded": _write_dcp_hf_sharded,
            "dcp_hf_consolidated": _write_dcp_hf_consolidated,
            "dcp_no_collectives": _write_dcp_no_collectives,
        }[name](rank, mesh)
        dist.barrier()


def _dt(full: torch.Tensor, mesh: Any, placement: Any) -> Any:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, mesh, [placement])


def _write_dcp_per_item(rank: int, mesh: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.tensor import Replicate, Shard

    t = full_tensors("dcp_per_item")
    state = {
        "a": _dt(t["a"], mesh, Shard(0)),
        "b": _dt(t["b"], mesh, Shard(1)),
        "c": _dt(t["c"], mesh, Shard(0)),
        "r": _dt(t["r"], mesh, Replicate()),
        **copy.deepcopy(PER_ITEM_VALUES),
    }
    dcp.save(state, storage_writer=FileSystemWriter(Path("dcp_per_item"), single_file_per_rank=False))


def _sharded_state(name: str, mesh: Any) -> Dict[str, Any]:
    """dcp_per_item's tensors as DTensors: Shard(0), uneven Shard(1) bf16, uneven Shard(0) i64,
    Replicate."""
    from torch.distributed.tensor import Replicate, Shard

    t = full_tensors(name)
    return {
        "a": _dt(t["a"], mesh, Shard(0)),
        "b": _dt(t["b"], mesh, Shard(1)),
        "c": _dt(t["c"], mesh, Shard(0)),
        "r": _dt(t["r"], mesh, Replicate()),
    }


def _write_dcp_hf_sharded(rank: int, mesh: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = _sharded_state("dcp_hf_sharded", mesh)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter("dcp_hf_sharded", save_distributed=True))


def _write_dcp_hf_consolidated(rank: int, mesh: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = _sharded_state("dcp_hf_consolidated", mesh)
    writer = HuggingFaceStorageWriter("dcp_hf_consolidated", save_distributed=True, enable_consolidation=True)
    dcp.save(state, storage_writer=writer)


def _write_dcp_no_collectives(rank: int, mesh: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    state = {**_sharded_state("dcp_no_collectives", mesh), **copy.deepcopy(PER_ITEM_VALUES)}
    dcp.save(state, storage_writer=FileSystemWriter(Path("dcp_no_collectives")), use_collectives=False)


def _write_olmo_core(rank: int, mesh: Any) -> None:
    """What OLMo-core's save_model_and_optim_state writes: {"model": model state dict,
    "optim": flattened optimizer state dict} of FSDP2 (Shard(0)) parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.tensor import Shard

    t = full_tensors("olmo_core")
    model: Dict[str, Any] = {}
    optim: Dict[str, Any] = {}
    for param, _, _ in OLMO_PARAMS:
        model[param] = _dt(t[f"model.{param}"], mesh, Shard(0))
        optim[f"state.{param}.exp_avg"] = _dt(t[f"optim.state.{param}.exp_avg"], mesh, Shard(0))
        optim[f"state.{param}.exp_avg_sq"] = _dt(t[f"optim.state.{param}.exp_avg_sq"], mesh, Shard(0))
        optim[f"state.{param}.step"] = t[f"optim.state.{param}.step"].clone()  # 0-d, every rank
    for key, value in olmo_values().items():
        optim[key[len("optim.") :]] = copy.deepcopy(value)
    ckpt = Path("olmo_core") / "model_and_optim"
    dcp.save({"model": model, "optim": optim}, storage_writer=FileSystemWriter(ckpt))
    if rank == 0:
        (Path("olmo_core") / "train").mkdir(parents=True, exist_ok=True)
        torch.save({"global_step": 10}, Path("olmo_core") / "train" / "rank0.pt")


def _write_dcp_legacy_base(rank: int, mesh: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.tensor import Shard

    t = full_tensors("dcp_legacy")
    state = {
        "model": {
            "w": _dt(t["model.w"], mesh, Shard(0)),
            "emb": _dt(t["model.emb"], mesh, Shard(0)),
            "ids": t["model.ids"].clone(),
        },
        **copy.deepcopy(LEGACY_VALUES),
    }
    dcp.save(state, storage_writer=FileSystemWriter(Path("dcp_legacy")))


def _write_megatron_common_item(rank: int, mesh: Any) -> None:
    """Megatron torch_dist: flat keys, no flattening by the planner (planner_data None), each
    ShardedObject as torch.save([data]) under its unique key, common state as the object
    ``common_state/shard_0_1`` from rank 0, metadata.json, no common.pt."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.tensor import Shard

    t = full_tensors("megatron_common_item")
    state: Dict[str, Any] = {"decoder.layers.mlp.weight": _dt(t["decoder.layers.mlp.weight"], mesh, Shard(0))}
    if rank == 0:
        state["decoder.final_norm.weight"] = t["decoder.final_norm.weight"].clone()  # main replica only
        state["common_state/shard_0_1"] = [copy.deepcopy(COMMON_ITEM_COMMON)]
    state[f"rng_state/shard_{rank}_2"] = [copy.deepcopy(COMMON_ITEM_OBJECTS[f"rng_state/shard_{rank}_2"])]
    ckpt = Path("megatron_common_item")
    dcp.save(
        state,
        storage_writer=FileSystemWriter(ckpt),
        planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
    )
    if rank == 0:
        (ckpt / "metadata.json").write_text(json.dumps(MEGATRON_TORCH_DIST_JSON))


def run_distributed(out: Path, names: List[str]) -> None:
    run_ranks(WORLD, _rank_main, str(out), names)


# ---------------------------------------------------------------------------------------------
# .metadata rewrites


@dataclass
class _OlmoStorageInfo:
    """Stand-in for olmo_core.distributed.checkpoint.filesystem._StorageInfo (same fields and
    pickled state as torch's)."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Optional[Sequence[str]] = None

    def __getstate__(self) -> Dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


OLMO_MODULE = "olmo_core.distributed.checkpoint.filesystem"


@contextmanager
def fake_olmo_module() -> Iterator[None]:
    """Registers olmo_core.distributed.checkpoint.filesystem (and its parents) with
    ``_StorageInfo`` so that pickle names (and can load) the OLMo class."""
    names = ["olmo_core", "olmo_core.distributed", "olmo_core.distributed.checkpoint", OLMO_MODULE]
    saved = {n: sys.modules.get(n) for n in names}
    try:
        for n in names:
            sys.modules[n] = types.ModuleType(n)
        _OlmoStorageInfo.__module__ = OLMO_MODULE
        _OlmoStorageInfo.__name__ = _OlmoStorageInfo.__qualname__ = "_StorageInfo"
        sys.modules[OLMO_MODULE]._StorageInfo = _OlmoStorageInfo  # type: ignore[attr-defined]
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def rewrite_olmo_metadata(ckpt: Path) -> None:
    path = ckpt / ".metadata"
    with open(path, "rb") as f:
        md = pickle.load(f)
    md.storage_data = {
        k: _OlmoStorageInfo(v.relative_path, v.offset, v.length, v.transform_descriptors)
        for k, v in md.storage_data.items()
    }
    with fake_olmo_module():
        data = pickle.dumps(md, protocol=4)
    path.write_bytes(data)
    names = _globals_named(data)
    assert (OLMO_MODULE, "_StorageInfo") in names, names
    assert ("torch.distributed.checkpoint.filesystem", "_StorageInfo") not in names, names


OLD_MODULE = "torch.distributed._shard.sharded_tensor.metadata"


class _OldTensorProperties:
    """Pickles as the pre-2.4 ``TensorProperties``: old module name, 5-item tuple state
    ``(dtype, layout, requires_grad, MEM_FORMAT_ENCODING member, pin_memory)``."""

    def __init__(self, props: Any) -> None:
        from torch.distributed._shard.sharded_tensor.metadata import MEM_FORMAT_ENCODING

        assert props.memory_format == torch.contiguous_format
        self.state = (
            props.dtype,
            props.layout,
            props.requires_grad,
            MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
            props.pin_memory,
        )

    def __getstate__(self) -> Tuple[Any, ...]:
        return self.state


@contextmanager
def old_tensor_properties_name() -> Iterator[None]:
    """pickle checks that module.qualname resolves to the class it saves, so the old module's
    ``TensorProperties`` attribute points at the stand-in while pickling."""
    import torch.distributed._shard.sharded_tensor.metadata as old

    real = old.TensorProperties
    _OldTensorProperties.__module__ = OLD_MODULE
    _OldTensorProperties.__name__ = _OldTensorProperties.__qualname__ = "TensorProperties"
    old.TensorProperties = _OldTensorProperties  # type: ignore[misc]
    try:
        yield
    finally:
        old.TensorProperties = real  # type: ignore[misc]


def rewrite_legacy_metadata(ckpt: Path) -> None:
    path = ckpt / ".metadata"
    with open(path, "rb") as f:
        md = pickle.load(f)
    for sm in md.state_dict_metadata.values():
        if hasattr(sm, "properties"):
            sm.properties = _OldTensorProperties(sm.properties)
    # Older Metadata had no storage_meta / version fields: drop them from the pickled state
    # (the class defaults keep attribute access working).
    md.__dict__.pop("storage_meta", None)
    md.__dict__.pop("version", None)
    with old_tensor_properties_name():
        # Protocol 3: the default of Python 3.7, which older torch releases supported.
        data = pickle.dumps(md, protocol=3)
    path.write_bytes(data)
    names = _globals_named(data)
    assert (OLD_MODULE, "TensorProperties") in names, names
    assert (OLD_MODULE, "MEM_FORMAT_ENCODING") in names, names
    assert ("torch.distributed.checkpoint.metadata", "TensorProperties") not in names, names
    assert ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING") not in names, names
    assert b"storage_meta" not in data and b"version" not in data


def _globals_named(data: bytes) -> set:
    """(module, name) of every GLOBAL / STACK_GLOBAL of a pickle (pickletools.dis parsed)."""
    out = io.StringIO()
    pickletools.dis(data, out=out)
    found = set()
    strings: List[str] = []
    for line in out.getvalue().splitlines():
        parts = line.split(None, 3)
        if len(parts) < 3:
            continue
        op = parts[2]
        arg = parts[3] if len(parts) > 3 else ""
        if op in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg.strip().strip("'"))
        elif op == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
        elif op == "GLOBAL":
            module, name = arg.strip().strip("'").split(" ", 1)
            found.add((module, name))
    return found


# ---------------------------------------------------------------------------------------------
# Read-back checks


def read_dcp(ckpt: Path) -> Dict[str, Any]:
    """Everything of a DCP checkpoint, loaded by torch itself: flat fqn -> tensor or value."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = FileSystemReader(ckpt)
    md = reader.read_metadata()
    sd: Dict[str, Any] = {}
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, TensorStorageMetadata):
            sd[fqn] = torch.full(tuple(sm.size), 7, dtype=sm.properties.dtype)
        else:
            sd[fqn] = None
    # (dcp.load would put byte items into a copy of sd)
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    _load_state_dict(sd, storage_reader=reader, planner=planner, no_dist=True)
    return sd


def read_zarr_array(array_dir: Path) -> Tuple[np.ndarray, Dict[str, Any]]:
    """A zarr v2 array (no compressor, C order, "." separator) assembled from its chunk files,
    bf16 ("bfloat16") as uint16 bit patterns: what a reader of this fixture has to do."""
    meta = json.loads((array_dir / ".zarray").read_text())
    assert meta["zarr_format"] == 2 and meta["compressor"] is None and meta["order"] == "C", meta
    assert meta["filters"] is None, meta
    dtype = np.dtype("<u2") if meta["dtype"] == "bfloat16" else np.dtype(meta["dtype"])
    shape, chunks = tuple(meta["shape"]), tuple(meta["chunks"])
    out = np.zeros(shape, dtype=dtype)
    sep = meta.get("dimension_separator", ".")
    for region in _regions(shape, chunks):
        idx = [r.start // c for r, c in zip(region, chunks)]
        name = sep.join(str(i) for i in idx) if idx else "0"
        raw = (array_dir / name).read_bytes()
        assert len(raw) == int(np.prod(chunks)) * dtype.itemsize, (array_dir, name, len(raw))
        chunk = np.frombuffer(raw, dtype=dtype).reshape(chunks)
        out[region] = chunk[tuple(slice(0, r.stop - r.start) for r in region)]
    return out, meta


def _same(name: str, key: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape) or not torch.equal(got, want):
        raise SystemExit(
            f"{name}: {key} read back differs: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
        )


def read_hf(ckpt: Path) -> Dict[str, torch.Tensor]:
    """A safetensors DCP checkpoint, loaded by torch's own HuggingFaceStorageReader (which
    assembles DCP_SHARDING_INFO pieces)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = HuggingFaceStorageReader(str(ckpt))
    md = reader.read_metadata()
    sd = {fqn: torch.full(tuple(sm.size), 7, dtype=sm.properties.dtype) for fqn, sm in md.state_dict_metadata.items()}
    _load_state_dict(sd, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    return sd


def read_dcp_rank(ckpt: Path, rank: int) -> Tuple[Any, Dict[str, Any]]:
    """What rank ``rank`` of a ``use_collectives=False`` save stored, read by torch from its
    ``__{rank}.metadata`` alone (what dcp.load falls back to without a ``.metadata``): the
    metadata, and flat fqn -> full-size tensor (7 where the rank stored nothing) or value."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class RankReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return super().read_metadata(rank=rank)

    reader = RankReader(ckpt)
    md = reader.read_metadata()
    sd: Dict[str, Any] = {}
    for fqn, sm in md.state_dict_metadata.items():
        sd[fqn] = torch.full(tuple(sm.size), 7, dtype=sm.properties.dtype) if isinstance(sm, TensorStorageMetadata) else None
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    _load_state_dict(sd, storage_reader=reader, planner=planner, no_dist=True)
    return md, sd


def check(out: Path, name: str) -> None:
    want = full_tensors(name)
    expected = expected_json(name)
    if name in ("dcp_hf_sharded", "dcp_hf_consolidated"):
        ckpt = out / name
        assert not (ckpt / "model.safetensors.index.json").exists() or name == "dcp_hf_consolidated"
        got = read_hf(ckpt)
        if name == "dcp_hf_consolidated":
            assert json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"], name
        for key, t in want.items():
            _same(name, key, got.pop(key), t)
        if got:
            raise SystemExit(f"{name}: unexpected entries {sorted(got)}")
        return
    if name == "dcp_no_collectives":
        ckpt = out / name
        assert not (ckpt / ".metadata").exists(), "use_collectives=False wrote a global .metadata"
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        covered: Dict[str, int] = {key: 0 for key in want}
        for rank in range(WORLD):
            md, got = read_dcp_rank(ckpt, rank)
            values: Dict[str, Any] = {}
            for fqn, sm in md.state_dict_metadata.items():
                if not isinstance(sm, TensorStorageMetadata):
                    flatten_value(fqn, got[fqn], values)
                    continue
                for chunk in sm.chunks:
                    box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
                    _same(name, f"{fqn} rank {rank} {box}", got[fqn][box], want[fqn][box])
                    covered[fqn] += int(torch.Size(chunk.sizes).numel())
            if values != expected:
                raise SystemExit(f"{name}: rank {rank}'s byte items {values} differ from {expected}")
        for key, t in want.items():
            if covered[key] < t.numel():
                raise SystemExit(f"{name}: {key} not covered by the ranks' pieces")
        return
    if name == "megatron_zarr":
        ckpt = out / name
        for key, t in want.items():
            arr, meta = read_zarr_array(ckpt / key)
            got = torch.from_numpy(arr.copy())
            got = got.view(torch.bfloat16) if meta["dtype"] == "bfloat16" else got
            _same(name, key, got, t)
        for unique_key, value in expected["sharded_objects"].items():
            assert torch.load(ckpt / f"{unique_key}.pt", weights_only=True) == value
        assert torch.load(ckpt / "common.pt", weights_only=True) == expected["common"]
        return
    ckpt = out / name / "model_and_optim" if name == "olmo_core" else out / name
    if name == "olmo_core":
        with fake_olmo_module():
            got = read_dcp(ckpt)
    else:
        got = read_dcp(ckpt)
    for key, t in want.items():
        _same(name, key, got.pop(key), t)
    if name == "megatron_common_item":
        assert got.pop("common_state/shard_0_1") == [expected["common"]], "common_state item"
        for unique_key, value in expected["sharded_objects"].items():
            assert got.pop(unique_key) == [value], unique_key
    else:
        values: Dict[str, Any] = {}
        for k, v in got.items():
            flatten_value(k, v, values)
        if values != expected:
            raise SystemExit(f"{name}: byte items read back {values} differ from {expected}")
        got = {}
    if got:
        raise SystemExit(f"{name}: unexpected entries {sorted(got)}")


# ---------------------------------------------------------------------------------------------


def _remove(out: Path, name: str) -> None:
    shutil.rmtree(out / name, ignore_errors=True)
    for suffix in (".expected.safetensors", ".expected.json"):
        (out / f"{name}{suffix}").unlink(missing_ok=True)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="+", choices=GENERATED, default=GENERATED)
    args = ap.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in GENERATED if n in args.only]
    for name in names:
        _remove(out, name)

    cwd = os.getcwd()
    os.chdir(out)  # relative checkpoint paths
    try:
        if "dcp_zstd" in names:
            write_dcp_zstd(Path("dcp_zstd"))
        if "megatron_zarr" in names:
            write_megatron_zarr(Path("megatron_zarr"))
        if "dcp_large_item" in names:
            write_dcp_large_item(Path("dcp_large_item"))
    finally:
        os.chdir(cwd)
    dist_names = [n for n in DISTRIBUTED if n in names]
    if dist_names:
        run_distributed(out, dist_names)
    if "olmo_core" in names:
        rewrite_olmo_metadata(out / "olmo_core" / "model_and_optim")
    if "dcp_legacy" in names:
        rewrite_legacy_metadata(out / "dcp_legacy")

    for name in names:
        write_expected(out, name)
        check(out, name)
        total = _size(out / name) + _size(out / f"{name}.expected.safetensors") + _size(out / f"{name}.expected.json")
        print(f"{name}: {total} bytes ({_size(out / name)} checkpoint)")
        limit = SIZE_LIMITS.get(name, SIZE_LIMIT)
        if total > limit:
            raise SystemExit(f"{name} is {total} bytes, over the {limit} limit")


if __name__ == "__main__":
    main()
