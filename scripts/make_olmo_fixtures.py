"""Writes real ai2-olmo-core 0.1.0 checkpoints (``olmo_core.distributed.checkpoint``) as test
fixtures for tessera's OLMo-core reader, into crates/tessera/tests/fixtures/olmo/.

Every checkpoint is written by OLMo-core 0.1.0 itself, on CPU, by gloo ranks this script
starts (``torch.multiprocessing``, spawn, a free TCP port on 127.0.0.1). Its format: each rank
writes ``rank_{r}.safetensors`` holding 1-D (flattened) pieces of its tensors, rank 0 writes
``metadata.json`` (``shard_spec_per_file``: ``flattened_offsets`` or
``local_shape``/``global_offset`` per file); ``save_model_and_optim_state(dir, model, optim)``
writes two such checkpoints, ``dir/model/`` and ``dir/optim/``.

  olmo_fsdp1_w2      torch FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True``,
                     ``ModuleWrapPolicy({Block})``: 3 FSDP units), 2 ranks, TinyLM, AdamW(lr=1e-2,
                     weight_decay=0.1) trained 2 steps, ``save_model_and_optim_state``.
  olmo_fsdp1_w3      the same at 3 ranks (other shard boundaries).
  olmo_fsdp2_w2      FSDP2 (``torch.distributed.fsdp.fully_shard`` per block, then the root),
                     2 ranks, TinyLM with odd row counts (uneven ``Shard(0)``) and a (1,)
                     ``logit_scale`` (rank 1 holds an empty shard), AdamW 2 steps,
                     ``save_model_and_optim_state``: DTensor specs (``local_shape`` +
                     ``global_offset``).
  olmo_ddp_w2        ``DistributedDataParallel``, 2 ranks, SGD(momentum=0.9) 2 steps,
                     ``save_model_and_optim_state``: ``module.`` keys, ``is_sharded: false``,
                     only rank 0 writes data.
  olmo_single        one process, no process group: ``Checkpointer().save(dir, flat dict)`` with
                     f32 2-D, bf16, f16, int64, 0-d f32, empty (0,) and (0, 4), bool, uint8.
  olmo_dtensor2d_w4  ``Checkpointer().save`` on 4 ranks of DTensors on a 2x2 DeviceMesh:
                     (7, 6) f32 (Shard(0), Shard(1)) uneven, (5, 4) bf16 (Shard(0), Replicate())
                     (each piece in two files), (3,) f32 fully replicated (in all four files),
                     (1, 5) f32 (Replicate(), Shard(0)) (empty pieces).
  olmo01_fsdp_w2     a copy of the shared real fixture ../shared/fixtures/olmo01_fsdp_w2
                     (FSDP1, 2 ranks); never regenerated, only copied (its expected files are
                     rebuilt here from the copy with OLMo-core's unshard and checked against
                     the shared fixture's own expected tensors).

Next to each ``NAME/`` the script writes:

  NAME.expected.safetensors  every full tensor, under the key a reader of the whole directory
                             uses: ``model/<key>`` and ``optim/<key>`` for a
                             save_model_and_optim_state directory, ``<key>`` for a plain
                             Checkpointer directory. Values = OLMo-core's own
                             ``Checkpointer().unshard(dir, no_dist=True)``, checked bit-exact
                             against truth gathered independently from the live objects in the
                             writer processes (FSDP1: ``summon_full_params`` and AdamW state
                             assembled by hand from ``flat_param._shard_param_infos``;
                             FSDP2/DTensor: ``full_tensor()``; DDP/plain: the tensors). The
                             pickled ``param_group{i}`` / ``state_keys`` are compared, unpickled,
                             with the live optimizer's. Any disagreement aborts the script.
  NAME.expected.json         writer, torch version, world size, keys, dtypes and shapes, the
                             unpickled param groups and state keys, a summary of every
                             metadata.json (spec kinds, ``[[0, 0]]`` ranges, keys listed for a
                             file that the file lacks, replicated pieces), and notes.

Generation is deterministic (fixed seeds; gloo sums of 2 or 3 ranks on CPU): a rerun writes the
same bytes. Needs .venv-olmo (torch 2.7.1, ai2-olmo-core 0.1.0, safetensors; see
scripts/olmo-env.sh). Only the fixtures named above are replaced in the output directory; each
is generated and verified in a temporary directory first.

Usage: .venv-olmo/bin/python scripts/make_olmo_fixtures.py [--out DIR] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import struct
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file, save_file

from tessera._launch import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests/python"))
import olmo_models  # noqa: E402  (the model and training the tests share)
from olmo_models import Block, TinyLM  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "crates/tessera/tests/fixtures/olmo"
# The project's shared fixture set sits beside the checkout (../shared); TESSERA_SHARED overrides.
SHARED_REAL = Path(os.environ.get("TESSERA_SHARED", REPO.parent / "shared")) / "fixtures/olmo01_fsdp_w2"
WRITER = "olmo_core.distributed.checkpoint (ai2-olmo-core==0.1.0)"

MODEL_SEED = 1234
DATA_SEED = 5678
LR = 1e-2
WEIGHT_DECAY = 0.1
STEPS = 2

# TinyLM sizes. FSDP1: each block's flat parameter holds norm (2*D), ff_in (H*D + H), ff_out
# (D*H), so with these sizes the shard boundaries fall inside ff_in.weight / ff_out.weight and
# some ranks hold none of the norms, ff_in.bias or ff_out.weight. FSDP2: every row count is odd.
FSDP1_SIZES = dict(vocab=19, dim=8, hidden=12)
FSDP2_SIZES = dict(vocab=13, dim=7, hidden=9)
DDP_SIZES = dict(vocab=11, dim=6, hidden=10)


# --------------------------------------------------------------------------- model and training


def make_model(sizes: Dict[str, int], **kw: Any) -> TinyLM:
    torch.manual_seed(MODEL_SEED)  # same initial weights on every rank
    model = TinyLM(**sizes, **kw)
    with torch.no_grad():  # LayerNorm starts at (1, 0); perturb it so its values are distinctive
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def train(model: nn.Module, optim: torch.optim.Optimizer, vocab: int, rank: int) -> None:
    olmo_models.train(model, optim, STEPS, DATA_SEED + rank, vocab)  # different data per rank


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


# --------------------------------------------------------------------------- live truth


def live_optim_objects(model: nn.Module, optim: torch.optim.Optimizer, strip: str = "") -> Dict[str, Any]:
    """What the pickled optimizer entries must decode to, taken from the live optimizer."""
    names = {p: n.replace(strip, "") for n, p in model.named_parameters()}
    sd = optim.state_dict()
    groups = []
    for group, sd_group in zip(optim.param_groups, sd["param_groups"]):
        g = {k: v for k, v in sd_group.items()}
        g["_param_names"] = [names[p] for p in group["params"]]
        groups.append(g)
    state_keys = sorted({k for s in optim.state.values() for k in s})
    return {"param_groups": groups, "state_keys": state_keys}


def fsdp1_truth(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """Full params via summon_full_params; full AdamW state assembled by hand from every rank's
    local (flattened) state at the intra-parameter offsets of FSDP's flat parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    prefix = "_fsdp_wrapped_module."
    truth: Dict[str, torch.Tensor] = {}
    with FSDP.summon_full_params(model, writeback=False):
        for name, p in model.named_parameters():
            truth[f"model/{name.replace(prefix, '')}"] = p.detach().clone()

    names = {p: n.replace(prefix, "") for n, p in model.named_parameters()}
    local: List[Tuple[str, Tuple[int, ...], int, int, Dict[str, torch.Tensor], torch.Tensor]] = []
    for module in FSDP.fsdp_modules(model):
        handle = module._handle
        if handle is None:
            continue
        flat = handle.flat_param
        for param, info, shape in zip(flat._params, flat._shard_param_infos, flat._shapes):
            if not info.in_shard:
                continue
            start, end = info.intra_param_start_idx, info.intra_param_end_idx + 1
            state = {k: v.detach().clone() for k, v in optim.state.get(param, {}).items()}
            local.append((names[param], tuple(shape), start, end, state, param.detach().clone()))
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)

    full: Dict[str, torch.Tensor] = {}
    hand_params: Dict[str, torch.Tensor] = {}
    for rank_pieces in gathered:
        for name, shape, start, end, state, param in rank_pieces:
            numel = int(torch.Size(shape).numel())
            assert param.numel() == end - start, (name, param.shape, start, end)
            hp = hand_params.setdefault(name, torch.full((numel,), float("nan")))
            hp[start:end] = param.reshape(-1)
            for key, value in state.items():
                k = f"optim/state.{name}.__{key}"
                if key == "step":  # a 0-d tensor, the same on every rank that holds a piece
                    if k in full and not same_bits(full[k], value):
                        raise AssertionError(f"{k}: ranks disagree ({full[k]} vs {value})")
                    full[k] = value
                    continue
                assert value.numel() == end - start, (k, value.shape, start, end)
                buf = full.setdefault(k, torch.full((numel,), float("nan"), dtype=value.dtype))
                buf[start:end] = value.reshape(-1)
    # The hand-assembled params must agree with summon_full_params (and cover every element).
    for name, flat_value in hand_params.items():
        if not same_bits(flat_value.reshape(truth[f"model/{name}"].shape), truth[f"model/{name}"]):
            raise AssertionError(f"FSDP1 hand-gathered {name} differs from summon_full_params")
    shapes = {n: truth[f"model/{n}"].shape for n in names.values()}
    for k, v in full.items():
        if not k.endswith(".__step"):
            name = k[len("optim/state.") : k.rindex(".__")]
            full[k] = v.reshape(shapes[name])
            assert not full[k].isnan().any(), f"{k}: not every element was gathered"
    truth.update(full)
    return truth


def dtensor_truth(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """FSDP2: full tensors via DTensor.full_tensor() (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor().detach().clone() if isinstance(t, DTensor) else t.detach().clone()

    truth = {f"model/{n}": full(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():  # same order on every rank: full_tensor() is collective
        state = optim.state[p]
        for key in sorted(state):
            truth[f"optim/state.{n}.__{key}"] = full(state[key])
    return truth


# --------------------------------------------------------------------------- rank programs


def _save_model_and_optim(ckpt: Path, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    from olmo_core.distributed.checkpoint import save_model_and_optim_state

    save_model_and_optim_state(str(ckpt), model, optim)


def rank_fsdp1(rank: int, world: int, staging: Path, name: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(
        make_model(FSDP1_SIZES),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True,
        device_id=torch.device("cpu"),
    )
    optim = adamw(model)
    train(model, optim, FSDP1_SIZES["vocab"], rank)
    _save_model_and_optim(staging / name, model, optim)
    truth = fsdp1_truth(model, optim)
    objects = live_optim_objects(model, optim, strip="_fsdp_wrapped_module.")
    if rank == 0:
        write_truth(staging, name, truth, objects)


def rank_fsdp2(rank: int, world: int, staging: Path, name: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(FSDP2_SIZES, logit_scale=True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = adamw(model)
    train(model, optim, FSDP2_SIZES["vocab"], rank)
    _save_model_and_optim(staging / name, model, optim)
    truth = dtensor_truth(model, optim)
    objects = live_optim_objects(model, optim)
    if rank == 0:
        write_truth(staging, name, truth, objects)


def rank_ddp(rank: int, world: int, staging: Path, name: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(DDP_SIZES))
    optim = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    train(model, optim, DDP_SIZES["vocab"], rank)
    _save_model_and_optim(staging / name, model, optim)
    truth = {f"model/{n}": p.detach().clone() for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    for p, state in optim.state.items():
        for key, value in state.items():
            truth[f"optim/state.{names[p]}.__{key}"] = value.detach().clone()
    # DDP keeps replicas identical; check that, since only rank 0's copy is saved.
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, truth)
    for other in gathered[1:]:
        for k, v in truth.items():
            if not same_bits(v, other[k]):
                raise AssertionError(f"DDP replicas differ at {k}")
    if rank == 0:
        write_truth(staging, name, truth, live_optim_objects(model, optim))


def dtensor2d_state() -> Dict[str, Tuple[torch.Tensor, Tuple[str, str]]]:
    gen = torch.Generator().manual_seed(MODEL_SEED)
    return {
        "block_2d": (torch.randn(7, 6, generator=gen), ("S0", "S1")),
        "rows_replicated": (torch.randn(5, 4, generator=gen).to(torch.bfloat16), ("S0", "R")),
        "replicated": (torch.randn(3, generator=gen), ("R", "R")),
        "one_row": (torch.randn(1, 5, generator=gen), ("R", "S0")),
    }


def rank_dtensor2d(rank: int, world: int, staging: Path, name: str) -> None:
    from olmo_core.distributed.checkpoint import Checkpointer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    kinds = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    mesh = init_device_mesh("cpu", (2, 2))
    state, truth = {}, {}
    for key, (full, placements) in dtensor2d_state().items():
        dt = distribute_tensor(full, mesh, [kinds[p] for p in placements])
        state[key] = dt
        truth[key] = dt.full_tensor().clone()
        if not same_bits(truth[key], full):
            raise AssertionError(f"{key}: full_tensor() differs from the tensor distributed")
    Checkpointer().save(str(staging / name), state)
    if rank == 0:
        write_truth(staging, name, truth, None)


RANK_PROGRAMS: Dict[str, Callable[[int, int, Path, str], None]] = {
    "fsdp1": rank_fsdp1,
    "fsdp2": rank_fsdp2,
    "ddp": rank_ddp,
    "dtensor2d": rank_dtensor2d,
}


def _rank_main(rank: int, world: int, program: str, staging: str, name: str) -> None:
    warnings.filterwarnings("ignore")  # as main() does: a spawned rank does not inherit its filters
    torch.set_num_threads(1)  # as torchrun does (OMP_NUM_THREADS=1) with several ranks per host
    RANK_PROGRAMS[program](rank, world, Path(staging), name)


# --------------------------------------------------------------------------- single process


def single_state() -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(MODEL_SEED)
    return {
        "f32_2d": torch.randn(3, 5, generator=gen),
        "bf16": torch.randn(6, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(2, 3, generator=gen).to(torch.float16),
        "i64": torch.tensor([-(2**40), -1, 0, 7, 2**62], dtype=torch.int64),
        "scalar_f32": torch.tensor(2.5),
        "empty": torch.empty(0),
        "empty_0x4": torch.empty(0, 4),
        "mask_bool": torch.tensor([True, False, False, True, True]),
        "bytes_u8": torch.arange(250, 256, dtype=torch.uint8),
    }


def write_single(staging: Path, name: str) -> None:
    from olmo_core.distributed.checkpoint import Checkpointer

    assert not dist.is_initialized()
    state = single_state()
    Checkpointer().save(str(staging / name), {k: v.clone() for k, v in state.items()})
    write_truth(staging, name, state, None)


# --------------------------------------------------------------------------- truth files, checks


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bytes(a), _bytes(b))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def write_truth(
    staging: Path, name: str, truth: Dict[str, torch.Tensor], objects: Optional[Dict[str, Any]]
) -> None:
    save_file({k: v.contiguous() for k, v in truth.items()}, str(staging / f"{name}.truth.safetensors"))
    (staging / f"{name}.truth.json").write_text(json.dumps(jsonable(objects)))


def jsonable(obj: Any) -> Any:
    """Tuples become lists, dict keys strings: how the objects appear in NAME.expected.json."""
    return json.loads(json.dumps(obj))


def olmo_unshard(ckpt: Path, two_part: bool) -> Dict[str, torch.Tensor]:
    from olmo_core.distributed.checkpoint import Checkpointer

    if not two_part:
        return Checkpointer().unshard(str(ckpt), no_dist=True)
    out: Dict[str, torch.Tensor] = {}
    for part in ("model", "optim"):
        for k, v in Checkpointer().unshard(str(ckpt / part), no_dist=True).items():
            out[f"{part}/{k}"] = v
    return out


def decoded_optim_objects(full: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """Unpickle OLMo's param_group{i} / state_keys (our own fixture, written by this script)."""
    n = int(full["optim/num_param_groups"].item())
    groups = [pickle.loads(full[f"optim/param_group{i}"].numpy().tobytes()) for i in range(n)]
    state_keys = pickle.loads(full["optim/state_keys"].numpy().tobytes())
    return {"param_groups": groups, "state_keys": state_keys}


def compare(name: str, got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], what: str) -> None:
    if set(got) != set(want):
        raise AssertionError(
            f"{name}: keys differ from {what}: only in unshard {sorted(set(got) - set(want))}, "
            f"only in {what} {sorted(set(want) - set(got))}"
        )
    bad = [k for k in sorted(got) if not same_bits(got[k], want[k])]
    if bad:
        k = bad[0]
        raise AssertionError(
            f"{name}: {len(bad)} tensors differ from {what}, e.g. {k}: {got[k].dtype}{tuple(got[k].shape)} "
            f"vs {want[k].dtype}{tuple(want[k].shape)}\n{got[k]}\n{want[k]}"
        )


def verify(staging: Path, name: str, two_part: bool) -> Dict[str, torch.Tensor]:
    """OLMo-core's unshard of the checkpoint must equal the live truth, bit for bit."""
    full = olmo_unshard(staging / name, two_part)
    truth = load_file(str(staging / f"{name}.truth.safetensors"))
    objects = json.loads((staging / f"{name}.truth.json").read_text())
    if two_part:
        tensors = {k: v for k, v in full.items() if not _is_pickle_entry(k)}
        compare(name, tensors, truth, "live truth")
        if jsonable(decoded_optim_objects(full)) != objects:
            raise AssertionError(f"{name}: pickled optimizer entries differ from the live optimizer")
        if int(full["optim/num_param_groups"].item()) != len(objects["param_groups"]):
            raise AssertionError(f"{name}: num_param_groups")
    else:
        compare(name, full, truth, "live truth")
    return full


def _is_pickle_entry(key: str) -> bool:
    return key in ("optim/num_param_groups", "optim/state_keys") or key.startswith("optim/param_group")


# --------------------------------------------------------------------------- expected.json


def _safetensors_header(path: Path) -> Dict[str, Any]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _spec_is_empty(spec: Dict[str, Any]) -> bool:
    if spec["flattened_offsets"] is not None:
        return all(a == b for a, b in spec["flattened_offsets"])
    return 0 in spec["local_shape"]


def summarize_checkpointer_dir(ckpt: Path) -> Dict[str, Any]:
    """What metadata.json and the rank files contain, for NAME.expected.json and the notes."""
    meta = json.loads((ckpt / "metadata.json").read_text())["tensors"]
    headers = {p.name: _safetensors_header(p) for p in sorted(ckpt.glob("rank_*.safetensors"))}
    kinds: Dict[str, int] = {}
    zero_ranges, listed_missing, empty_pieces, replicated, unlisted = [], [], [], [], []
    unsharded_elsewhere: List[str] = []
    for key, tm in meta.items():
        seen: Dict[str, List[str]] = {}
        for fname, spec in tm["shard_spec_per_file"].items():
            flat = spec["flattened_offsets"] is not None
            kind = "flattened_offsets" if flat else "local_shape/global_offset"
            kinds[kind] = kinds.get(kind, 0) + 1
            if spec["flattened_offsets"] is not None and _spec_is_empty(spec):
                zero_ranges.append(f"{fname}:{key}")
            if key not in headers.get(fname, {}):
                listed_missing.append(f"{fname}:{key}")
            elif headers[fname][key]["shape"] in ([0],):
                empty_pieces.append(f"{fname}:{key}")
            if not _spec_is_empty(spec):
                seen.setdefault(json.dumps(spec, sort_keys=True), []).append(fname)
        for files in seen.values():
            if len(files) > 1:
                replicated.append(f"{key}: {', '.join(files)}")
        for fname, header in headers.items():
            if key in header and fname not in tm["shard_spec_per_file"]:
                unlisted.append(f"{fname}:{key}")
        if not tm["is_sharded"] and list(tm["shard_spec_per_file"]) != ["rank_0.safetensors"]:
            unsharded_elsewhere.append(f"{key}: {', '.join(tm['shard_spec_per_file'])}")
    return {
        "files": {f: sorted(h) for f, h in headers.items()},
        "spec_kinds": kinds,
        "is_sharded": sorted({str(tm["is_sharded"]).lower() for tm in meta.values()}),
        "dtypes": sorted({tm["dtype"] for tm in meta.values()}),
        "zero_ranges": zero_ranges,
        "listed_but_missing_from_file": listed_missing,
        "empty_pieces_in_file": empty_pieces,
        "same_piece_in_several_files": replicated,
        "in_file_but_not_listed": unlisted,
        "unsharded_not_from_rank_0": unsharded_elsewhere,
    }


def _observed(parts: Dict[str, Dict[str, Any]]) -> str:
    out = []
    for part, s in parts.items():
        where = f"{part}/" if part else ""
        bits = [f"{where}metadata.json: spec kinds {s['spec_kinds']}, is_sharded {s['is_sharded']}"]
        if s["zero_ranges"]:
            bits.append(f"[[0,0]] for {len(s['zero_ranges'])} (file, key) pairs")
        if s["listed_but_missing_from_file"]:
            bits.append(
                "listed with a spec but absent from the file: " + ", ".join(s["listed_but_missing_from_file"])
            )
        if s["empty_pieces_in_file"]:
            bits.append("0-element pieces stored: " + ", ".join(s["empty_pieces_in_file"]))
        if s["unsharded_not_from_rank_0"]:
            elsewhere = "; ".join(s["unsharded_not_from_rank_0"])
            bits.append(f"unsharded tensors written by another rank than 0: {elsewhere}")
        if s["same_piece_in_several_files"]:
            bits.append("same piece in several files: " + "; ".join(s["same_piece_in_several_files"]))
        out.append("; ".join(bits))
    return ". ".join(out) + "."


def expected_json(
    out_ckpt: Path,
    world: int,
    two_part: bool,
    full: Dict[str, torch.Tensor],
    notes: str,
    extra: Dict[str, Any],
) -> Dict[str, Any]:
    parts = {p: summarize_checkpointer_dir(out_ckpt / p) for p in (("model", "optim") if two_part else ("",))}
    doc: Dict[str, Any] = {
        "writer": WRITER,
        "torch": torch.__version__,
        "world_size": world,
        "layout": "save_model_and_optim_state (model/ + optim/)" if two_part else "Checkpointer (top level)",
    }
    if two_part:
        doc["model_keys"] = sorted(k[len("model/") :] for k in full if k.startswith("model/"))
        doc["optim_keys"] = sorted(k[len("optim/") :] for k in full if k.startswith("optim/"))
        objs = jsonable(decoded_optim_objects(full))
        for i, g in enumerate(objs["param_groups"]):
            doc[f"param_group{i}"] = g
        doc["num_param_groups"] = len(objs["param_groups"])
        doc["state_keys"] = objs["state_keys"]
    else:
        doc["keys"] = sorted(full)
    doc["tensors"] = {
        k: {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
        for k, v in sorted(full.items())
    }
    doc["files"] = {
        str(p.relative_to(out_ckpt)): p.stat().st_size for p in sorted(out_ckpt.rglob("*")) if p.is_file()
    }
    doc["metadata_summary"] = parts
    doc.update(extra)
    doc["notes"] = notes + " Observed: " + _observed(parts)
    return doc


# --------------------------------------------------------------------------- fixtures

TRUTH_NOTE = {
    "fsdp1": "Truth = Checkpointer().unshard(dir/model|optim, no_dist=True), checked bit-exact against "
    "FSDP.summon_full_params (params) and the AdamW state assembled by hand from every rank's local "
    "tensors at flat_param._shard_param_infos offsets (params gathered that way too, and equal).",
    "fsdp2": "Truth = Checkpointer().unshard(dir/model|optim, no_dist=True), checked bit-exact against "
    "DTensor.full_tensor() of every parameter and AdamW state tensor in the writer processes.",
    "ddp": "Truth = Checkpointer().unshard(dir/model|optim, no_dist=True), checked bit-exact against the "
    "live parameters and momentum buffers (identical on both ranks, checked).",
}

PICKLE_NOTE = (
    " param_group{i} and state_keys are uint8 tensors holding a Python pickle (param_group: the torch "
    "param group plus _param_names; shown unpickled here), num_param_groups is a 0-d int64; all three "
    "unsharded (is_sharded false) and written by rank 0 only. The unpickled values were compared with "
    "the live optimizer."
)

FIXTURES: Dict[str, Dict[str, Any]] = {
    "olmo_fsdp1_w2": dict(
        program="fsdp1",
        world=2,
        two_part=True,
        setup="torch FSDP1, use_orig_params=True, ModuleWrapPolicy({Block}), 2 ranks; TinyLM V=19 D=8 H=12; "
        "AdamW(lr=1e-2, wd=0.1) 2 steps; save_model_and_optim_state",
        notes="torch FSDP1 (FullyShardedDataParallel, use_orig_params=True, CPU, gloo), world size 2, "
        "ModuleWrapPolicy({Block}) -> 3 FSDP units (root: embed, final_norm, lm_head; blocks.0; blocks.1). "
        "TinyLM vocab 19, dim 8, hidden 12 (embed, 2 x [LayerNorm, Linear with bias, Linear without bias], "
        "final LayerNorm, lm_head without bias). AdamW(lr=1e-2, weight_decay=0.1) trained 2 steps, then "
        "save_model_and_optim_state(dir, model, optim). Every parameter is a ShardedFlatTensor piece of "
        "FSDP's flat parameter: flattened_offsets, one range per file, [[0,0]] for a rank holding none "
        "of it (the model file then stores a 0-element tensor; the optim file has no key at all, since "
        "AdamW keeps no state for an empty shard). Optimizer keys: state.{fqn}.__{exp_avg,exp_avg_sq} "
        "(sharded like the parameter) and state.{fqn}.__step (0-d float32, unsharded, written by the "
        "first rank holding state for it). No buffers are saved (OLMo-core 0.1.0 'TODO: buffers').",
    ),
    "olmo_fsdp1_w3": dict(
        program="fsdp1",
        world=3,
        two_part=True,
        setup="as olmo_fsdp1_w2 at 3 ranks",
        notes="The same model, data seeds, optimizer and save as olmo_fsdp1_w2 but at world size 3: other "
        "shard boundaries (FSDP pads each flat parameter to a multiple of 3), pieces of a parameter split "
        "over three files, and [[0,0]] on other ranks. Data differs per rank, so the trained values differ "
        "from olmo_fsdp1_w2. state.{fqn}.__step is written by the lowest rank holding state for the "
        "parameter, which is not always rank 0.",
    ),
    "olmo_fsdp2_w2": dict(
        program="fsdp2",
        world=2,
        two_part=True,
        setup="FSDP2 fully_shard (each block, then root), 2 ranks, 1-D mesh; TinyLM V=13 D=7 H=9 + (1,) "
        "logit_scale; AdamW 2 steps; save_model_and_optim_state",
        notes="FSDP2 (torch.distributed.fsdp.fully_shard on each block, then on the root; CPU mesh of 2, "
        "gloo). TinyLM vocab 13, dim 7, hidden 9 plus a (1,) parameter logit_scale: every row count is "
        "odd, so Shard(0) is uneven (torch.chunk: rank 0 gets ceil(n/2) rows), and rank 1 holds an empty "
        "(0,) piece of logit_scale whose global_offset is [1] (= the dim size, torch's convention for an "
        "empty shard). Parameters and exp_avg/exp_avg_sq are DTensors: shard_spec_per_file has "
        "local_shape + global_offset (flattened_offsets null). state.{fqn}.__step is a plain 0-d tensor "
        "(unsharded, rank 0's). Keys have no FSDP prefix (FSDP2 does not rename parameters).",
    ),
    "olmo_ddp_w2": dict(
        program="ddp",
        world=2,
        two_part=True,
        setup="DistributedDataParallel, 2 ranks; TinyLM V=11 D=6 H=10; SGD(lr=1e-2, momentum=0.9) 2 steps; "
        "save_model_and_optim_state",
        notes="torch DistributedDataParallel (CPU, gloo), world size 2, SGD(lr=1e-2, momentum=0.9) trained "
        "2 steps, then save_model_and_optim_state. Keys carry DDP's 'module.' prefix (model and optimizer "
        "state names alike). Nothing is sharded: every tensor has is_sharded false and one spec, "
        "rank_0.safetensors with flattened_offsets [[0, numel]]; OLMo keeps the first rank's plan, so "
        "rank 0 writes every tensor and rank_1.safetensors is a safetensors file with no tensors, not "
        "listed in any spec. Optimizer state: state.{fqn}.__momentum_buffer only (SGD has no step).",
    ),
    "olmo_single": dict(
        program=None,
        world=1,
        two_part=False,
        setup="one process, no process group; Checkpointer().save(dir, flat dict)",
        notes="Checkpointer().save(dir, state_dict) in one process without torch.distributed: metadata.json "
        "+ rank_0.safetensors at the top level (no model/optim folders). Dtypes F32, BF16, F16, I64, BOOL, "
        "U8 (OLMo accepts bool). Every tensor is stored flattened to 1-D: the 0-d scalar_f32 as shape [1], "
        "f32_2d (3, 5) as [15], empty (0,) and empty_0x4 (0, 4) as [0]; the full shape is only in "
        "metadata.json. is_sharded false, flattened_offsets [[0, numel]] (so [[0,0]] for the two empty "
        "tensors, whose 0-element pieces are present in the file). Truth = the tensors saved.",
    ),
    "olmo_dtensor2d_w4": dict(
        program="dtensor2d",
        world=4,
        two_part=False,
        setup="Checkpointer().save, 4 ranks, 2x2 DeviceMesh of DTensors: (7,6) f32 (S0,S1), (5,4) bf16 "
        "(S0,R), (3,) f32 (R,R), (1,5) f32 (R,S0)",
        notes="Checkpointer().save(dir, {key: DTensor}) on 4 gloo ranks, DeviceMesh (2, 2) = [[0,1],[2,3]]. "
        "block_2d (7, 6) f32 with (Shard(0), Shard(1)): 2-D blocks, rows split 4/3 (uneven), columns 3/3, "
        "so each file's piece is a (rows, 3) block whose flattened ranges are one per row. rows_replicated "
        "(5, 4) bf16 with (Shard(0), Replicate()): rows 3/2, each piece written by two files (ranks 0,1 "
        "and 2,3) with identical local_shape/global_offset. replicated (3,) f32 with (Replicate(), "
        "Replicate()): the same full piece in all four files. one_row (1, 5) f32 with (Replicate(), "
        "Shard(0)): ranks 1 and 3 hold an empty (0, 5) piece with global_offset [1, 0] and store a "
        "0-element tensor. All specs are local_shape + global_offset. Truth = full_tensor() in the "
        "writers, equal to the tensors distributed.",
    ),
}

COPY_NOTES = (
    "Copy of the shared real fixture shared/fixtures/olmo01_fsdp_w2, written by a peer with "
    "ai2-olmo-core 0.1.0 on torch 2.7.1 (never regenerated by this script). torch FSDP1 "
    "(use_orig_params=True), 2 ranks, ModuleWrapPolicy({Block}) -> 3 FSDP units, TinyLM vocab 64/50, "
    "dim 32, hidden 33, AdamW(lr=1e-2, weight_decay=0.1) 2 steps, save_model_and_optim_state. Truth = "
    "Checkpointer().unshard(dir/model|optim, no_dist=True) of the copy, checked bit-exact against the "
    "shared fixture's own olmo01_fsdp_w2.model/.optim.expected.safetensors (the peer had checked those "
    "against summon_full_params and hand-gathered AdamW state). Note: the shared "
    "olmo01_fsdp_w2.expected.safetensors has unprefixed keys; this one uses model/ and optim/ like the "
    "other fixtures here."
)


def dumps(obj: Any, indent: int = 0) -> str:
    """JSON with one entry per line, but lists of scalars and small dicts kept on one line."""
    flat = json.dumps(obj)
    if not isinstance(obj, (dict, list)) or len(flat) <= 100 and not (isinstance(obj, dict) and indent == 0):
        return flat
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, list):
        if all(not isinstance(v, (dict, list)) for v in obj):
            return flat
        return "[\n" + ",\n".join(inner + dumps(v, indent + 1) for v in obj) + "\n" + pad + "]"
    items = [f"{inner}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in obj.items()]
    return "{\n" + ",\n".join(items) + "\n" + pad + "}"


def _replace(src: Path, dst: Path) -> None:
    if dst.is_dir():
        _make_writable(dst)
        shutil.rmtree(dst)
    elif dst.exists():
        dst.unlink()
    shutil.move(str(src), str(dst))
    for p in [dst, *dst.rglob("*")]:  # safetensors writes 0600 files; make the fixtures plain 0644/0755
        p.chmod(0o755 if p.is_dir() else 0o644)


def _make_writable(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)


def _copy_tree(src: Path, dst: Path) -> None:
    """Copy file contents only (the shared fixture is read-only; the copy must stay removable)."""
    dst.mkdir(parents=True)
    for p in sorted(src.rglob("*")):
        target = dst / p.relative_to(src)
        if p.is_dir():
            target.mkdir()
        else:
            shutil.copyfile(p, target)


def finish(
    staging: Path,
    out: Path,
    name: str,
    world: int,
    two_part: bool,
    full: Dict[str, torch.Tensor],
    notes: str,
    extra: Dict[str, Any],
) -> None:
    """Write NAME.expected.{safetensors,json} and move the fixture from staging into out."""
    tensors = {k: v.contiguous() for k, v in sorted(full.items())}
    save_file(tensors, str(staging / f"{name}.expected.safetensors"))
    doc = expected_json(staging / name, world, two_part, full, notes, extra)
    (staging / f"{name}.expected.json").write_text(dumps(doc) + "\n")
    for suffix in ("", ".expected.safetensors", ".expected.json"):
        _replace(staging / f"{name}{suffix}", out / f"{name}{suffix}")


def make_fixture(name: str, staging: Path, out: Path) -> None:
    spec = FIXTURES[name]
    if spec["program"] is None:
        write_single(staging, name)
    else:
        run_ranks(spec["world"], _rank_main, spec["program"], str(staging), name)
    full = verify(staging, name, spec["two_part"])
    truth = TRUTH_NOTE.get(spec["program"], "")
    notes = spec["notes"] + (" " + truth if truth else "") + (PICKLE_NOTE if spec["two_part"] else "")
    finish(staging, out, name, spec["world"], spec["two_part"], full, notes, {"setup": spec["setup"]})


def copy_real(staging: Path, out: Path, name: str = "olmo01_fsdp_w2") -> None:
    if not SHARED_REAL.is_dir():
        if (out / name).is_dir():
            print(f"  {SHARED_REAL} not found; keeping the existing copy {out / name}")
            return
        raise FileNotFoundError(f"{SHARED_REAL} not found; cannot copy {name}")
    _copy_tree(SHARED_REAL, staging / name)
    full = olmo_unshard(staging / name, two_part=True)
    want: Dict[str, torch.Tensor] = {}
    for part in ("model", "optim"):
        for k, v in load_file(str(SHARED_REAL.parent / f"{name}.{part}.expected.safetensors")).items():
            want[f"{part}/{k}"] = v
    compare(name, full, want, "the shared fixture's expected tensors")
    shared = json.loads((SHARED_REAL.parent / f"{name}.expected.json").read_text())
    extra = {
        "setup": "shared real fixture (FSDP1, 2 ranks, AdamW 2 steps); copied, never regenerated",
        "shared_notes": shared.get("notes"),
        "shared_verification_note": shared.get("verification_note"),
    }
    world = int(shared.get("world_size", 2))
    finish(staging, out, name, world, True, full, COPY_NOTES, extra)


ALL = [*FIXTURES, "olmo01_fsdp_w2"]


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory ({DEFAULT_OUT})")
    parser.add_argument("--only", nargs="+", choices=ALL, help="make only these fixtures")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = args.only or ALL
    t_all = time.monotonic()
    for name in names:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"olmo_fixture_{name}_") as tmp:
            staging = Path(tmp)
            if name == "olmo01_fsdp_w2":
                copy_real(staging, out)
            else:
                make_fixture(name, staging, out)
        made = (out / name, out / f"{name}.expected.safetensors", out / f"{name}.expected.json")
        sizes = ", ".join(f"{p.name} {_size(p)} B" for p in made if p.exists())
        print(f"{name}: {time.monotonic() - t0:.1f} s ({sizes})", flush=True)
    print(f"done in {time.monotonic() - t_all:.1f} s -> {out}")


if __name__ == "__main__":
    main()
