#!/usr/bin/env python
"""Benchmark: saving distributed-optimizer state as model-space flat ranges vs raw buckets.

Spawns ``tp * dp`` gloo ranks (default TP=2 x DP=2) holding a GPT-like model's f32 Adam state
(``exp_avg``, ``exp_avg_sq``) in Megatron-style flat buffers, DP-sharded, about 256 MiB in
total. Each repetition times, between barriers, on every rank at once:

  (a) tessera, model space: ``dist_optimizer_state_dict`` -> ``dc.save`` (fully reshardable);
  (b) tessera, raw buckets: one plain 1-D tensor per rank and state, keyed by rank
      (Megatron's ``dp_reshardable`` style: cannot change TP/PP);
  (c) ``torch.save`` of the raw buckets, one file per rank;
  (c+fsync) the same followed by ``fsync`` -- tessera fsyncs its data files, torch.save does not.

All runs write under the same directory (removed between runs, outside the timing). Prints the
median and minimum per method and the ratios of the medians.

Usage: ``.venv/bin/python scripts/bench/bench_dist_optimizer.py [--reps 5] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from tessera import dist_checkpointing as dc
from tessera._launch import run_ranks
from tessera.dist_checkpointing import ParamRange, ShardedTensor

STATES = ("exp_avg", "exp_avg_sq")
METHODS = ("a", "b", "c", "c+fsync")
LABELS = {
    "a": "(a) tessera, model-space flat ranges",
    "b": "(b) tessera, raw bucket per rank",
    "c": "(c) torch.save, file per rank",
    "c+fsync": "(c) torch.save + fsync",
}


def model_params(args: argparse.Namespace, tp_rank: int, dp_rank: int) -> List[ShardedTensor]:
    """Model-space descriptions (no data) of one TP rank's parameters, Megatron replica ids."""
    h, layers, tp = args.hidden, args.layers, args.tp

    def param(key: str, shape: Tuple[int, ...], split: Any, layer: Any = None) -> ShardedTensor:
        prepend = 1 if layer is not None else 0
        local = list(shape[prepend:])
        offset, frag = [0] * len(shape), [1] * len(shape)
        if layer is not None:
            offset[0], frag[0] = layer, shape[0]
        if split is not None:
            local[split - prepend] //= tp
            offset[split], frag[split] = local[split - prepend] * tp_rank, tp
        replica = (0, 0 if split is not None else tp_rank, dp_rank)
        return ShardedTensor(key, None, torch.bfloat16, tuple(local), shape, tuple(offset), tuple(frag), replica, prepend)

    out = [param("embedding.weight", (args.vocab, h), 0)]
    for i in range(layers):
        out += [
            param("layers.ln1", (layers, h), None, i),
            param("layers.qkv", (layers, 3 * h, h), 1, i),
            param("layers.proj", (layers, h, h), 2, i),
            param("layers.ln2", (layers, h), None, i),
            param("layers.fc1", (layers, 4 * h, h), 1, i),
            param("layers.fc2", (layers, h, 4 * h), 2, i),
        ]
    out.append(param("final_norm", (h,), None))
    return out[::-1]  # Megatron packs buckets in reverse order


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _torch_save(path: str, shards: Dict[str, torch.Tensor], fsync: bool) -> None:
    with open(path, "wb") as f:
        torch.save(shards, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def _bench(rank: int, world: int, args: argparse.Namespace, base: str) -> None:
    tp_rank, dp_rank = rank % args.tp, rank // args.tp
    params = model_params(args, tp_rank, dp_rank)
    layout = dc.param_buffer_layout(params, args.dp)
    ranges: List[ParamRange] = layout.param_ranges(params)
    g = torch.Generator().manual_seed(rank)
    shards = {s: torch.randn(layout.shard_size, generator=g) for s in STATES}
    local_bytes = sum(t.numel() * t.element_size() for t in shards.values())
    sizes: List[Any] = [None] * args.tp * args.dp
    dist.all_gather_object(sizes, local_bytes)
    total_bytes = sum(sizes)

    def run(method: str, path: str) -> None:
        if method == "a":
            dc.save({"optimizer": dc.dist_optimizer_state_dict(shards, dp_rank, args.dp, ranges)}, path)
        elif method == "b":
            sd = {
                s: ShardedTensor.from_rank_offsets(f"optimizer.dp_reshardable.{s}.rank{rank}", t)
                for s, t in shards.items()
            }
            dc.save(sd, path)
        else:
            if rank == 0:
                os.makedirs(path)
            dist.barrier()
            _torch_save(os.path.join(path, f"rank{rank}.pt"), shards, fsync=method == "c+fsync")

    times: Dict[str, List[float]] = {m: [] for m in METHODS}
    for rep in range(args.warmup + args.reps):
        order = METHODS[rep % len(METHODS) :] + METHODS[: rep % len(METHODS)]  # rotate: no fixed position bias
        for method in order:
            path = os.path.join(base, "run")
            dt = _timed(lambda: run(method, path))
            if rep >= args.warmup:
                times[method].append(dt)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
            dist.barrier()

    if rank == 0:
        pieces = len(dc.dist_optimizer_sharded_tensors(shards["exp_avg"], dp_rank, args.dp, ranges, ""))
        _report(args, layout.total, total_bytes, pieces, times)


def _report(args: argparse.Namespace, buffer_numel: int, total_bytes: int, pieces: int, times: Dict[str, List[float]]) -> None:
    mib = total_bytes / 2**20
    print(
        f"TP={args.tp} x DP={args.dp} ({args.tp * args.dp} gloo ranks), hidden={args.hidden}, layers={args.layers}, "
        f"vocab={args.vocab}; states {', '.join(STATES)} (f32)"
    )
    print(
        f"flat buffer per TP rank {buffer_numel} elements; {mib:.1f} MiB of optimizer state in total; "
        f"rank 0 saves {pieces} flat-range tensors per state; {args.reps} reps (+{args.warmup} warm-up), median"
    )
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"{'method':<40} {'median s':>9} {'min s':>8} {'GiB/s':>7}")
    for m in METHODS:
        print(f"{LABELS[m]:<40} {med[m]:>9.3f} {min(times[m]):>8.3f} {total_bytes / 2**30 / med[m]:>7.2f}")
    print(f"ratio a/b       = {med['a'] / med['b']:.2f}  (time of model-space save / raw-bucket save)")
    print(f"ratio a/c       = {med['a'] / med['c']:.2f}")
    print(f"ratio a/c+fsync = {med['a'] / med['c+fsync']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dir", default=None, help="directory to write under (default: a new temporary one)")
    args = parser.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="tessera-bench-distopt-")
    os.makedirs(base, exist_ok=True)
    try:
        run_ranks(args.tp * args.dp, _bench, args, base)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
