"""Writes the real Megatron-Core 0.19 fixture crates/tessera/tests/fixtures/foreign/megatron_core019.

Megatron-Core 0.19 is not on the package index here, so its source is taken from a clone of
NVIDIA/Megatron-LM at tag ``core_v0.19.0`` (``git archive`` of ``megatron/core`` into a
temporary folder put first on ``sys.path``); nothing is installed. The checkpoint is written by
``megatron.core.dist_checkpointing.save(..., verify_integrity=True)`` itself from 2 gloo ranks on
the CPU: 0.19's torch_dist layout with the common state inside the DCP data (the byte item
``common_state/shard_0_1``, no ``common.pt``) and ``integrity.json`` (SHA-256 of every file).

Two shims, both for running on a machine without CUDA or NVRx, neither touching the bytes:
``torch.cuda.synchronize`` / ``torch.cuda.current_device`` (the writer synchronizes after its
host copies and reduces a failure flag on the current device: nothing to wait for on the CPU,
the flag lives there), and ``nvidia_resiliency_ext`` hidden when the one installed has no
``__version__`` (0.19's optional async probe asserts on it; async save is not used here).
0.19's async writer needs ``psutil``: pass ``--extra-path`` to a folder holding it if the
interpreter lacks it.

Usage: .venv/bin/python scripts/make_megatron019_fixture.py --megatron-lm /path/to/Megatron-LM
       [--out DIR] [--extra-path DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "crates" / "tessera" / "tests" / "fixtures" / "foreign"
NAME = "megatron_core019"
TAG = "core_v0.19.0"
WORLD = 2
SIZE_LIMIT = 100 * 1024

COMMON = {"iteration": 100, "checkpoint_version": 3.0, "args": {"lr": 0.5, "name": "mc019"}}


def full_tensors():
    import torch

    g = torch.Generator().manual_seed(19)
    return {
        "decoder.layers.fc1.weight": torch.randn(4, 3, generator=g),  # split on axis 0
        "decoder.layers.fc2.weight": torch.randn(2, 6, generator=g).to(torch.bfloat16),  # axis 1
        "decoder.final_norm.weight": torch.arange(5, dtype=torch.float32),  # replicated
    }


def objects():
    return {f"rng_state/shard_{r}_{WORLD}": {"rank": r, "seed": 1900 + r} for r in range(WORLD)}


def _rank(rank: int, port: int, src: str, extra: list, out: str) -> None:
    sys.path[:0] = [src, *extra]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    try:
        import nvidia_resiliency_ext as nvrx

        if not hasattr(nvrx, "__version__"):
            sys.modules["nvidia_resiliency_ext"] = None  # type: ignore[assignment]
    except ImportError:
        pass
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import megatron.core as mc
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    assert mc.__version__.startswith("0.19"), mc.__version__
    t = full_tensors()
    fc1, fc2, norm = t["decoder.layers.fc1.weight"], t["decoder.layers.fc2.weight"], t["decoder.final_norm.weight"]
    half1, half2 = fc1.shape[0] // WORLD, fc2.shape[1] // WORLD
    sd = {
        "fc1": ShardedTensor.from_rank_offsets(
            "decoder.layers.fc1.weight", fc1[rank * half1 : (rank + 1) * half1].clone(), (0, rank, WORLD)
        ),
        "fc2": ShardedTensor.from_rank_offsets(
            "decoder.layers.fc2.weight", fc2[:, rank * half2 : (rank + 1) * half2].clone(), (1, rank, WORLD)
        ),
        "norm": ShardedTensor.from_rank_offsets("decoder.final_norm.weight", norm.clone(), replica_id=rank),
        "rng": ShardedObject("rng_state", objects()[f"rng_state/shard_{rank}_{WORLD}"], (WORLD,), (rank,), replica_id=0),
        **json.loads(json.dumps(COMMON)),
    }
    dist_checkpointing.save(sd, out, verify_integrity=True)
    dist.barrier()
    # Read back with Megatron itself: the integrity check (collective), the common state.
    dist_checkpointing.serialization.verify_integrity_manifest(out)
    if rank == 0:
        assert dist_checkpointing.load_common_state_dict(out) == COMMON
        print(f"megatron-core {mc.__version__}, torch {torch.__version__}: {sorted(os.listdir(out))}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatron-lm", required=True, help="a clone of NVIDIA/Megatron-LM with tag " + TAG)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--extra-path", action="append", default=[])
    a = ap.parse_args()
    out = Path(a.out)
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", a.megatron_lm, "archive", TAG, "megatron/core"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "x", "-C", tmp], input=archive, check=True)
        ckpt = Path(tmp) / NAME
        ckpt.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        ps = [ctx.Process(target=_rank, args=(r, port, tmp, a.extra_path, str(ckpt))) for r in range(WORLD)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        if any(p.exitcode for p in ps):
            sys.exit("a rank failed")
        size = sum(f.stat().st_size for f in ckpt.iterdir())
        assert size < SIZE_LIMIT, size
        shutil.rmtree(out / NAME, ignore_errors=True)
        shutil.copytree(ckpt, out / NAME)

    import torch
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in full_tensors().items()}, str(out / f"{NAME}.expected.safetensors"))
    expected = {"common": COMMON, "sharded_objects": objects()}
    (out / f"{NAME}.expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True))
    print("wrote", out / NAME, torch.__version__)


if __name__ == "__main__":
    main()
