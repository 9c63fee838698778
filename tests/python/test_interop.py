"""Interop oracle: torch.distributed.checkpoint (DCP) and tessera agree.

One sharded state — DTensors on a 2-rank CPU mesh with ``Shard(0)``, ``Shard(1)`` and
``Replicate`` placements, bf16 and f32, uneven and empty shards, plus plain tensors — is saved
from 2 gloo ranks twice: once with ``torch.distributed.checkpoint.save`` (FileSystemWriter) and
once with ``tessera.torch.save``. Then, in the test process and without a process group, both
checkpoints are unsharded to full tensors (DCP's own no-dist load vs ``tessera.torch.unshard``)
and every tensor must be identical: same keys, dtype, shape and bytes (NaN payloads, infinities
and signed zeros included, so the comparison is on raw bytes, not values).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch

from tessera._launch import run_ranks
import tessera.torch as tt

WORLD = 2


def _special(t: torch.Tensor) -> torch.Tensor:
    """Plants values a value-based comparison would miss: NaN, ±inf, -0.0."""
    flat = t.view(-1)
    specials = [float("nan"), float("inf"), float("-inf"), -0.0]
    for i, v in enumerate(specials[: flat.numel()]):
        flat[(i * 7) % flat.numel()] = v
    return t


def spec() -> List[Tuple[str, Tuple[int, ...], torch.dtype, str]]:
    """(key, global shape, dtype, placement) of every tensor: ``s0``/``s1`` shard a dim,
    ``rep`` replicates, ``plain`` is an ordinary tensor (identical on every rank)."""
    return [
        ("model.embed", (9, 6), torch.float32, "s0"),  # 9 rows over 2 ranks: 5 + 4
        ("model.qkv", (7, 5), torch.bfloat16, "s1"),  # 5 cols: 3 + 2
        ("model.proj", (4, 8), torch.bfloat16, "s0"),  # even
        ("model.norm", (11,), torch.float32, "s0"),  # 1-D, uneven
        ("model.tiny", (1, 3), torch.float32, "s0"),  # rank 1 holds an empty shard
        ("model.cube", (2, 3, 5), torch.bfloat16, "s1"),  # 3-D, sharded in the middle
        ("model.rep_bf16", (3, 4), torch.bfloat16, "rep"),
        ("model.rep_f32", (5,), torch.float32, "rep"),
        ("extra.plain", (6, 2), torch.float32, "plain"),
        ("extra.scalar", (), torch.float32, "plain"),
        ("extra.empty", (0, 4), torch.bfloat16, "plain"),
    ]


def full_tensors() -> Dict[str, torch.Tensor]:
    """The unsharded truth, deterministic on every process."""
    g = torch.Generator().manual_seed(1234)
    out = {}
    for key, shape, dtype, _ in spec():
        t = torch.randn(shape, generator=g).to(dtype)
        out[key] = _special(t) if t.numel() >= 4 else t
    return out


def sharded_state() -> Dict[str, Any]:
    """The nested state dict of DTensors and plain tensors (call under a 2-rank group).
    ``distribute_tensor`` lays the shards out as DTensor does: ceil-sized chunks, so trailing
    ranks get fewer rows, or none."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    kinds = {key: kind for key, _, _, kind in spec()}
    sd: Dict[str, Any] = {}
    for key, t in full_tensors().items():
        kind = kinds[key]
        if kind == "plain":
            value: Any = t
        else:
            placement = Replicate() if kind == "rep" else Shard(int(kind[1]))
            value = distribute_tensor(t, mesh, [placement])
        prefix, name = key.split(".")
        sd.setdefault(prefix, {})[name] = value
    return sd


def _save_both(rank: int, world: int, dcp_dir: str, tessera_dir: str) -> None:
    """Per rank: the same state dict, saved by DCP and by tessera."""
    import torch.distributed.checkpoint as dcp

    sd = sharded_state()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(dcp_dir))
    tt.save(sd, tessera_dir)


def _flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def dcp_unshard(dcp_dir: str) -> Dict[str, torch.Tensor]:
    """Full tensors of a DCP checkpoint, read in this process without a process group."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        return _flatten(_load_state_dict_from_keys(checkpoint_id=dcp_dir))


def assert_identical(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], what: str) -> None:
    """Same keys; per tensor same dtype, shape and raw bytes."""
    assert set(got) == set(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype, f"{what} {k}: dtype {g.dtype} != {w.dtype}"
        assert tuple(g.shape) == tuple(w.shape), f"{what} {k}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        gb = g.contiguous().reshape(-1).view(torch.uint8)
        wb = w.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(gb, wb), f"{what} {k}: bytes differ"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: Any) -> Tuple[str, str]:
    """(DCP dir, tessera dir) of the same state, saved once from 2 gloo ranks."""
    root = tmp_path_factory.mktemp("interop")
    dcp_dir, tessera_dir = str(root / "dcp"), str(root / "tessera")
    run_ranks(WORLD, _save_both, dcp_dir, tessera_dir)
    return dcp_dir, tessera_dir


def test_dcp_and_tessera_unshard_to_identical_tensors(checkpoints: Tuple[str, str]) -> None:
    dcp_dir, tessera_dir = checkpoints
    from_dcp = dcp_unshard(dcp_dir)
    from_tessera = tt.unshard(tessera_dir)
    assert_identical(from_tessera, from_dcp, "tessera vs DCP")
    # Both also equal the truth the ranks sharded (guards against a shared mistake).
    assert_identical(from_dcp, full_tensors(), "DCP vs truth")


def test_metadata_agrees_with_dcp(checkpoints: Tuple[str, str]) -> None:
    """tessera's key → (dtype, shape) index matches DCP's metadata file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dcp_dir, tessera_dir = checkpoints
    dcp_meta = {
        k: {"dtype": m.properties.dtype, "shape": tuple(m.size)}
        for k, m in FileSystemReader(dcp_dir).read_metadata().state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    assert tt.get_metadata(tessera_dir) == dcp_meta


def test_selected_keys_and_in_place_load_match_dcp(checkpoints: Tuple[str, str]) -> None:
    """``unshard(keys=...)`` and an in-place ``load`` into full plain tensors (a resharded load,
    1 process) give DCP's tensors too."""
    dcp_dir, tessera_dir = checkpoints
    from_dcp = dcp_unshard(dcp_dir)
    keys = ["model.qkv", "model.tiny", "extra.scalar"]
    assert_identical(tt.unshard(tessera_dir, keys), {k: from_dcp[k] for k in keys}, "unshard(keys)")

    target: Dict[str, Any] = {}
    for key, t in from_dcp.items():
        prefix, name = key.split(".")
        target.setdefault(prefix, {})[name] = torch.full_like(t, 7)
    tt.load(target, tessera_dir)
    assert_identical(_flatten(target), from_dcp, "load vs DCP")
