#!/usr/bin/env python3
"""Does megatron-core itself load the torch_dist checkpoints tessera's Rust writer makes?

Run by hand (not CI) with megatron-core 0.16.1 and a tessera build on the path, e.g.:

    PYTHONPATH=/work/pyr /work/main/.venv-megatron/bin/torchrun --nproc_per_node=4 \\
        scripts/interop/check_torch_dist_interop.py /tmp/td-interop

On N gloo ranks (TP=2 x DP=N/2) it builds a Megatron sharded state dict (tensors split on
axis 0 and axis 1, stacked layers with a prepended axis, replicated tensors, a ShardedObject
per rank holding a tensor, common values) and

1. saves it with megatron's own ``dist_checkpointing.save`` (backend torch_dist) to ``ref/``
   and with ``tessera._native.save_torch_dist`` to ``tessera/``, and compares the two
   ``.metadata`` files: the same keys, dtypes, global shapes, chunks and byte items;
2. loads ``tessera/`` with megatron's ``dist_checkpointing.load`` under another sharding
   (TP=N, and TP=1 where every rank reads everything) and checks every value exactly, the
   objects and ``load_common_state_dict`` too, and ``load_tensors_metadata``.

Prints one line per check on rank 0 and exits non-zero on the first difference.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing as mdc
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

from tessera import _native
from tessera._core.comm import TorchComm

DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int64: "i64"}
LAYERS = 4


def truth() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "decoder.qkv.weight": torch.randn(8, 6, generator=g),
        "embedding.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "decoder.layers.mlp.weight": torch.randn(LAYERS, 6, 4, generator=g),
        "decoder.norm.weight": torch.randn(5, generator=g).to(torch.float16),
        "step_counts": torch.arange(12, dtype=torch.int64).reshape(3, 4),
    }


def rng_state(rank: int) -> Dict[str, Any]:
    return {"rank": rank, "generator": torch.arange(4, dtype=torch.uint8) + rank}


COMMON = {"iteration": 5, "args": {"lr": 0.25, "name": "tiny"}, "checkpoint_version": 3.0}


def sharded_state(rank: int, world: int, tp: int, empty: bool) -> Dict[str, Any]:
    """Megatron's view on `rank` with tensor parallelism `tp` (the rest data parallel)."""
    t = truth()
    tp_rank, dp_rank = rank % tp, rank // tp
    fill = (lambda x: torch.empty_like(x)) if empty else (lambda x: x.clone())

    def split(x: torch.Tensor, axis: int) -> torch.Tensor:
        n = x.shape[axis] // tp
        return fill(x.narrow(axis, tp_rank * n, n).contiguous())

    sd: Dict[str, Any] = {}
    sd["qkv"] = ShardedTensor.from_rank_offsets(
        "decoder.qkv.weight", split(t["decoder.qkv.weight"], 0), (0, tp_rank, tp), replica_id=(0, 0, dp_rank)
    )
    sd["emb"] = ShardedTensor.from_rank_offsets(
        "embedding.weight", split(t["embedding.weight"], 1), (1, tp_rank, tp), replica_id=(0, 0, dp_rank)
    )
    # Stacked layers: one ShardedTensor per layer, the layer index as a prepended axis.
    layers = []
    for layer in range(LAYERS):
        local = split(t["decoder.layers.mlp.weight"][layer], 1)
        layers.append(
            ShardedTensor.from_rank_offsets(
                "decoder.layers.mlp.weight",
                local,
                (0, layer, LAYERS),
                (2, tp_rank, tp),
                replica_id=(0, 0, dp_rank),
                prepend_axis_num=1,
            )
        )
    sd["layers"] = layers
    for name, key in (("norm", "decoder.norm.weight"), ("steps", "step_counts")):
        sd[name] = ShardedTensor.from_rank_offsets(key, fill(t[key]), replica_id=(0, tp_rank, dp_rank))
    sd["rng"] = ShardedObject("rng_state", rng_state(rank) if not empty else None, (world,), (rank,), replica_id=0)
    return sd


def leaves(sd: Dict[str, Any]) -> Tuple[List[ShardedTensor], List[ShardedObject]]:
    tensors, objects = [], []
    for v in sd.values():
        for x in v if isinstance(v, list) else [v]:
            (tensors if isinstance(x, ShardedTensor) else objects).append(x)
    return tensors, objects


def replica(r: Any) -> Tuple[int, ...]:
    return (r,) if isinstance(r, int) else tuple(int(x) for x in r)


def object_payload(value: Any) -> bytes:
    try:
        return b"TSV1" + _native.encode_value(value)
    except TypeError:
        buf = io.BytesIO()
        torch.save(value, buf)
        return b"TPT1" + buf.getvalue()


def tessera_save(sd: Dict[str, Any], path: str, rank: int) -> Dict[str, Any]:
    tensors, objects = leaves(sd)
    keep = []
    native = []
    for sh in tensors:
        data = sh.data.contiguous()
        keep.append(data)
        native.append(
            (
                sh.key,
                DTYPES[data.dtype],
                tuple(sh.local_shape),
                tuple(sh.global_shape),
                tuple(sh.global_offset),
                int(sh.prepend_axis_num),
                replica(sh.replica_id),
                None,
                tuple(sh.axis_fragmentations) if sh.axis_fragmentations is not None else None,
                data.data_ptr(),
                data.numel() * data.element_size(),
            )
        )
    native_objects = [
        (o.key, object_payload(o.data), tuple(o.global_shape), tuple(o.global_offset), replica(o.replica_id))
        for o in objects
    ]
    common_pt = None
    if rank == 0:
        buf = io.BytesIO()
        torch.save(COMMON, buf)
        common_pt = buf.getvalue()
    return _native.save_torch_dist(native, native_objects, common_pt, path, TorchComm(), overwrite=True)


def summary(path: str) -> Dict[str, Any]:
    meta = torch.distributed.checkpoint.FileSystemReader(path).read_metadata()
    out = {}
    for k, m in meta.state_dict_metadata.items():
        if hasattr(m, "chunks"):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks)
            out[k] = ("tensor", m.properties.dtype, tuple(m.size), chunks)
        else:
            out[k] = ("bytes",)
    return out


def say(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def fail(msg: str) -> None:
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def check_loaded(rank: int, world: int, tp: int, loaded: Dict[str, Any]) -> None:
    want = sharded_state(rank, world, tp, empty=False)
    w_tensors, _ = leaves(want)
    got_flat: List[torch.Tensor] = []
    for name in ("qkv", "emb", "layers", "norm", "steps"):
        v = loaded[name]
        got_flat.extend(v if isinstance(v, list) else [v])
    for sh, g in zip(w_tensors, got_flat):
        if g.dtype != sh.data.dtype or not torch.equal(g, sh.data):
            fail(f"rank {rank} tp {tp}: {sh.key} at {sh.global_offset} differs")
    obj = loaded["rng"]
    want_obj = rng_state(rank)
    if obj.keys() != want_obj.keys() or obj["rank"] != rank or not torch.equal(obj["generator"], want_obj["generator"]):
        fail(f"rank {rank}: rng_state {obj} != {want_obj}")


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tessera-torch-dist-interop"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world % 2 == 0, "run on an even number of ranks (TP=2 x DP)"
    ref, ours = os.path.join(out, "ref"), os.path.join(out, "tessera")
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(ref)
    dist.barrier()
    say(rank, f"torch {torch.__version__}, megatron-core {__import__('megatron.core').core.__version__}, {world} ranks")

    # 1. The same state saved by megatron and by tessera: the same DCP structure.
    # megatron's writer synchronizes CUDA and reduces its failure flag on the current CUDA
    # device unconditionally; without a GPU (every tensor here is on the CPU) the flag lives
    # on the CPU, where gloo reduces it, and there is nothing to wait for.
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
    sd = sharded_state(rank, world, 2, empty=False)
    mdc.save(dict(sd, **COMMON), ref)
    report = tessera_save(sharded_state(rank, world, 2, empty=False), ours, rank)
    dist.barrier()
    if rank == 0:
        a, b = summary(ref), summary(ours)
        if a != b:
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    print(f"  {k}: megatron {a.get(k)} / tessera {b.get(k)}")
            fail("the .metadata structures differ")
        say(rank, f"ok  .metadata matches megatron's own save: {len(a)} entries ({report['chunks']} chunks)")
        if sorted(os.listdir(ours)) != sorted(
            [".metadata", "common.pt", "metadata.json"] + [f"__{r}_0.distcp" for r in range(world)]
        ):
            fail(f"files: {sorted(os.listdir(ours))}")
        with open(os.path.join(ref, "metadata.json")) as f, open(os.path.join(ours, "metadata.json")) as g:
            if f.read() != g.read():
                fail("metadata.json differs from megatron's")
        say(rank, "ok  metadata.json is byte-identical to megatron's")

    # 2. megatron loads tessera's checkpoint under other shardings.
    for tp in (world, 1):
        loaded = mdc.load(sharded_state(rank, world, tp, empty=True), ours)
        check_loaded(rank, world, tp, loaded)
        dist.barrier()
        say(rank, f"ok  megatron load with TP={tp}: every tensor and object exact on every rank")
    common = mdc.load_common_state_dict(ours)
    if common != COMMON:
        fail(f"common {common}")
    say(rank, "ok  load_common_state_dict")
    metas = mdc.load_tensors_metadata(ours)
    shapes = {k: tuple(v.global_shape) for k, v in metas.items()}
    if shapes != {k: tuple(v.shape) for k, v in truth().items()}:
        fail(f"tensors metadata {shapes}")
    say(rank, "ok  load_tensors_metadata")
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "PASS")


if __name__ == "__main__":
    main()
