"""tessera vs torch.distributed.checkpoint (DCP) vs safetensors, from PyTorch, on CPU.

One state, one run. A GPT-like set of 2-D weights (bf16 model weights and their f32 "main"
copies, as mixed-precision training keeps them) of about ``--size`` bytes is tensor-parallel
over 2 ranks: half the tensors are split on dim 0 (embedding, QKV, MLP up; the embedding's odd
vocabulary gives uneven shards), half on dim 1 (attention output, MLP down), as DTensors on a
1-D device mesh of 2. Two gloo processes save it with

  (a) ``tessera.torch.save``;
  (b) DCP ``torch.distributed.checkpoint.save`` with ``FileSystemWriter`` (default options:
      one file per rank, ``thread_count=1``, ``sync_files=True``);
  (c) safetensors: each rank ``safetensors.torch.save_file`` of its local shards, then fsync
      of the file and its directory (tessera and DCP make their files durable too).

Then one process without a process group loads it into another layout, full tensors:

  (a) ``tessera.torch.unshard``;
  (b) DCP, two ways, both timed, the faster one is "DCP" in the ratios:
      ``dcp.load(full empty tensors, no_dist=True)`` (shapes read from DCP's metadata inside
      the timed region) and ``_load_state_dict_from_keys`` (DCP allocates the tensors).
      ``format_utils.dcp_to_torch_save`` is the same load plus a ``torch.save``, so slower;
  (c) safetensors: ``load_file`` of every rank's file and ``torch.cat`` of the shards along
      the split dim (the resharding a user writes by hand).

Save time is rank 0's wall time from a barrier before to a barrier after the save. Before each
load the page cache of the checkpoint's files is dropped (``os.sync()``, then
``posix_fadvise(DONTNEED)`` on every file); a sequential read of tessera's files, timed the
same way, gives the disk's reference speed. Each measurement is repeated ``--rounds`` times
(methods interleaved), medians reported. All loads are checked byte-identical to the truth.
Goals (issue 3): resharded load ≥ 3× DCP, save ≥ 1.0× DCP.

Usage: .venv/bin/python scripts/bench/bench_python.py [--size 512MiB] [--rounds 3] [--hidden 1024]
       [--dir DIR] [--keep] [--json PATH|-]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch

from bench_files import drop_cache, fsync_path
from tessera._launch import run_ranks

WORLD = 2
SAVES = ["tessera", "dcp", "safetensors"]
LOADS = ["tessera", "dcp_load", "dcp_from_keys", "safetensors", "raw"]


# ---------------------------------------------------------------------------------------------
# The state


def parse_size(text: str) -> int:
    """'512MiB', '1GiB', '300MB', '1048576' → bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    base = 1024 if m.group(3) or not m.group(2) else 1000
    power = " KMGT".index((m.group(2) or " ").upper())
    return int(float(m.group(1)) * base**power)


def make_spec(size: int, hidden: int) -> List[Tuple[str, Tuple[int, int], torch.dtype, int]]:
    """(key, global shape, dtype, split dim) of every tensor: per weight, a bf16 model copy and
    an f32 main copy (6 bytes per parameter); layers added until ``size`` is reached."""
    h = hidden
    vocab = 8 * h + 1  # odd: uneven shards on dim 0
    weights = [("embed.weight", (vocab, h), 0)]
    per_layer = 12 * h * h * 6
    layers = max(1, round((size - vocab * h * 6) / per_layer))
    for i in range(layers):
        p = f"layers.{i}"
        weights += [
            (f"{p}.attn.qkv.weight", (3 * h, h), 0),  # column parallel
            (f"{p}.attn.proj.weight", (h, h), 1),  # row parallel
            (f"{p}.mlp.fc1.weight", (4 * h, h), 0),
            (f"{p}.mlp.fc2.weight", (h, 4 * h), 1),
        ]
    spec = []
    for name, shape, dim in weights:
        spec.append((f"model.{name}", shape, torch.bfloat16, dim))
        spec.append((f"optim.main.{name}", shape, torch.float32, dim))
    return spec


def full_tensor(index: int, shape: Tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The deterministic full value of tensor ``index`` (same on every process)."""
    g = torch.Generator().manual_seed(1000 + index // 2)  # bf16 weight = rounded f32 main
    return torch.randn(shape, generator=g).to(dtype)


def local_shard(t: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    """This rank's shard as DTensor's ``Shard(dim)`` lays it out (torch.chunk: ceil-sized)."""
    chunks = t.chunk(WORLD, dim=dim)
    return chunks[rank].contiguous() if rank < len(chunks) else t.narrow(dim, 0, 0).contiguous()


def nbytes(spec: List[Tuple[str, Tuple[int, int], torch.dtype, int]]) -> int:
    """Total bytes of the state."""
    return sum(s[0] * s[1] * torch.empty((), dtype=d).element_size() for _, s, d, _ in spec)


# ---------------------------------------------------------------------------------------------
# Saving, at 2 ranks


def save_method(method: str, sd: Dict[str, Any], path: str, rank: int) -> None:
    """Saves the DTensor state dict ``sd`` to ``path`` the way ``method`` does (every rank)."""
    if method == "tessera":
        import tessera.torch as tt

        tt.save(sd, path)
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))
    elif method == "safetensors":
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        file = os.path.join(path, f"rank{rank}.safetensors")
        save_file({k: v.to_local() for k, v in sd.items()}, file)
        fsync_path(file)
        fsync_path(path)
    else:
        raise ValueError(method)


def _save_rank(rank: int, world: int, opts: Dict[str, Any]) -> None:
    """One rank: build the local shards, warm up, then time the saves; rank 0 writes results."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)  # as torchrun does (OMP_NUM_THREADS=1) with several ranks per host
    mesh = init_device_mesh("cpu", (WORLD,))
    spec = make_spec(opts["size"], opts["hidden"])
    sd = {}
    for i, (key, shape, dtype, dim) in enumerate(spec):
        local = local_shard(full_tensor(i, shape, dtype), dim, rank)
        sd[key] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=shape,
                                     stride=(shape[1], 1))
    root = opts["dir"]
    warm = {k: sd[k] for k in list(sd)[:2]}  # first use of each library, untimed
    for method in SAVES:
        save_method(method, warm, os.path.join(root, f"warmup-{method}"), rank)
    times: Dict[str, List[float]] = {m: [] for m in SAVES}
    for r in range(opts["rounds"]):
        order = SAVES[r % len(SAVES):] + SAVES[: r % len(SAVES)]
        for method in order:
            path = os.path.join(root, method)
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                os.sync()
            dist.barrier()
            t0 = time.perf_counter()
            save_method(method, sd, path, rank)
            dist.barrier()
            times[method].append(time.perf_counter() - t0)
    if rank == 0:
        for method in SAVES:
            shutil.rmtree(os.path.join(root, f"warmup-{method}"), ignore_errors=True)
        with open(os.path.join(root, "save-times.json"), "w") as f:
            json.dump(times, f)


def run_saves(opts: Dict[str, Any]) -> Dict[str, List[float]]:
    """Spawns the 2 ranks and returns rank 0's save times per method."""
    run_ranks(WORLD, _save_rank, opts)
    with open(os.path.join(opts["dir"], "save-times.json")) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# Loading, 1 process, full tensors


def load_tessera(path: str, spec: list) -> Dict[str, torch.Tensor]:
    """Full tensors through ``tessera.torch.unshard``."""
    import tessera.torch as tt

    return tt.unshard(path)


def load_dcp(path: str, spec: list) -> Dict[str, torch.Tensor]:
    """Full tensors through ``dcp.load(no_dist=True)`` into empties shaped from DCP's metadata."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def load_dcp_from_keys(path: str, spec: list) -> Dict[str, torch.Tensor]:
    """Full tensors through DCP's ``_load_state_dict_from_keys`` (no process group)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        return _load_state_dict_from_keys(checkpoint_id=path)


def load_safetensors(path: str, spec: list) -> Dict[str, torch.Tensor]:
    """Every rank's file, shards concatenated along each tensor's split dim."""
    from safetensors.torch import load_file

    parts = [load_file(os.path.join(path, f"rank{r}.safetensors")) for r in range(WORLD)]
    return {key: torch.cat([p[key] for p in parts], dim=dim) for key, _, _, dim in spec}


def read_files(path: str, spec: list) -> Dict[str, torch.Tensor]:
    """Reference, not a load: sequential reads of every file (16 MiB at a time, one buffer)."""
    buf = memoryview(bytearray(16 << 20))
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
    return {}


LOADERS: Dict[str, Tuple[str, Callable[[str, list], Dict[str, torch.Tensor]]]] = {
    "tessera": ("tessera", load_tessera),
    "dcp_load": ("dcp", load_dcp),
    "dcp_from_keys": ("dcp", load_dcp_from_keys),
    "safetensors": ("safetensors", load_safetensors),
    "raw": ("tessera", read_files),
}


def run_loads(root: str, spec: list, rounds: int) -> Tuple[Dict[str, List[float]], Dict[str, Dict[str, torch.Tensor]]]:
    """Times each loader ``rounds`` times from a cold cache; returns times and the last results."""
    os.sync()
    times: Dict[str, List[float]] = {m: [] for m in LOADS}
    last: Dict[str, Dict[str, torch.Tensor]] = {}
    for r in range(rounds):
        order = LOADS[r % len(LOADS):] + LOADS[: r % len(LOADS)]
        for method in order:
            subdir, fn = LOADERS[method]
            path = os.path.join(root, subdir)
            last.pop(method, None)  # free the previous round's tensors first
            drop_cache(path)
            t0 = time.perf_counter()
            out = fn(path, spec)
            times[method].append(time.perf_counter() - t0)
            last[method] = out
    return times, last


def verify(spec: list, results: Dict[str, Dict[str, torch.Tensor]]) -> None:
    """Every loader's tensors equal the truth: same keys, dtype, shape and bytes."""
    keys = {k for k, _, _, _ in spec}
    for method, out in results.items():
        if set(out) != keys:
            raise AssertionError(f"{method}: keys differ ({len(out)} vs {len(keys)})")
    for i, (key, shape, dtype, _) in enumerate(spec):
        want = full_tensor(i, shape, dtype).view(-1).view(torch.uint8)
        for method, out in results.items():
            got = out[key]
            if got.dtype != dtype or tuple(got.shape) != shape:
                raise AssertionError(f"{method} {key}: {got.dtype} {tuple(got.shape)} != {dtype} {shape}")
            if not torch.equal(got.contiguous().view(-1).view(torch.uint8), want):
                raise AssertionError(f"{method} {key}: bytes differ")


# ---------------------------------------------------------------------------------------------
# Report


def du(path: str) -> int:
    """Bytes of the files under ``path``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def report(opts: Dict[str, Any], spec: list, save_t: Dict[str, List[float]], load_t: Dict[str, List[float]],
           disk: Dict[str, int]) -> Dict[str, Any]:
    """The JSON document: medians, all samples, ratios."""
    med = lambda xs: statistics.median(xs)  # noqa: E731
    dcp_load = min(("dcp_load", "dcp_from_keys"), key=lambda m: med(load_t[m]))
    return {
        "bytes": nbytes(spec),
        "tensors": len(spec),
        "ranks_save": WORLD,
        "rounds": opts["rounds"],
        "save_s": {m: med(v) for m, v in save_t.items()},
        "load_s": {m: med(v) for m, v in load_t.items()},
        "save_samples_s": save_t,
        "load_samples_s": load_t,
        "disk_bytes": disk,
        "dcp_load_variant": dcp_load,
        "speedup_vs_dcp": {
            "save": med(save_t["dcp"]) / med(save_t["tessera"]),
            "load": med(load_t[dcp_load]) / med(load_t["tessera"]),
        },
        "speedup_vs_safetensors": {
            "save": med(save_t["safetensors"]) / med(save_t["tessera"]),
            "load": med(load_t["safetensors"]) / med(load_t["tessera"]),
        },
        "goals": {"load_vs_dcp": 3.0, "save_vs_dcp": 1.0},
    }


def print_table(doc: Dict[str, Any]) -> None:
    """Human-readable table of ``doc``."""
    mib = doc["bytes"] / 2**20
    print(f"tessera Python benchmark: {mib:.0f} MiB in {doc['tensors']} tensors (bf16 weights + f32 main "
          f"copies), median of {doc['rounds']} rounds")

    def row(label: str, t: float, disk: str = "") -> None:
        print(f"  {label:44} {t:8.2f} s {mib / t:8.0f} MiB/s {disk:>10}".rstrip())

    print(f"save: TP=2 DTensors from {doc['ranks_save']} gloo ranks {'time':>17} {'rate':>14} {'on disk':>10}")
    for m, label in (("tessera", "tessera.torch.save"), ("dcp", "torch DCP save (FileSystemWriter)"),
                     ("safetensors", "safetensors save_file per rank + fsync")):
        row(label, doc["save_s"][m], f"{doc['disk_bytes'][m] / 2**20:.0f} MiB")
    print("load: full tensors in 1 process, page cache dropped")
    for m, label in (("tessera", "tessera.torch.unshard"), ("dcp_load", "torch DCP load(no_dist=True)"),
                     ("dcp_from_keys", "torch DCP _load_state_dict_from_keys"),
                     ("safetensors", "safetensors load_file per rank + torch.cat"),
                     ("raw", "(disk: sequential read of tessera's files)")):
        row(label, doc["load_s"][m])
    sd, ss = doc["speedup_vs_dcp"], doc["speedup_vs_safetensors"]
    variant = "load(no_dist=True)" if doc["dcp_load_variant"] == "dcp_load" else "_load_state_dict_from_keys"
    print(f"tessera vs DCP (DCP time / tessera time): save {sd['save']:.2f}x (goal >= 1.0x), "
          f"resharded load {sd['load']:.2f}x (goal >= 3x; DCP's faster way: {variant})")
    print(f"tessera vs safetensors (same ratio): save {ss['save']:.2f}x, resharded load {ss['load']:.2f}x")
    print("all loads byte-identical to the saved state: yes")


def main(argv: List[str]) -> int:
    """Parses arguments, runs the saves (2 ranks) and loads (1 process), prints the report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("512MiB"), help="state size (default 512MiB)")
    ap.add_argument("--rounds", type=int, default=3, help="measurements per method (default 3)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size of the GPT-like weights (default 1024)")
    ap.add_argument("--dir", help="scratch directory (default: a new temporary one, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': stdout, no table)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    root = args.dir or tempfile.mkdtemp(prefix="tessera-bench-py.")
    os.makedirs(root, exist_ok=True)
    opts = {"size": args.size, "hidden": args.hidden, "rounds": args.rounds, "dir": root}
    spec = make_spec(args.size, args.hidden)
    try:
        save_t = run_saves(opts)
        disk = {m: du(os.path.join(root, m)) for m in SAVES}
        load_t, results = run_loads(root, spec, args.rounds)
        verify(spec, {m: out for m, out in results.items() if m != "raw"})
        doc = report(opts, spec, save_t, load_t, disk)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.json != "-":
        print_table(doc)
    if args.json == "-":
        print(json.dumps(doc, indent=2))
    elif args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
