"""Resharded load and save speed, tessera vs torch DCP, next to memcpy, sequential-read and
raw-write references measured in the same run (issue 19, point 4).

The state: ``--size`` bytes (default 1 GiB) of f32 in ``--tensors`` (default 16) square 2-D
tensors (1 GiB / 16 = 4096 x 4096 each), deterministic random values. Two gloo ranks (CPU,
``torch.multiprocessing`` spawn) hold every tensor as a DTensor on a 1-D mesh of 2 with
placement ``Shard(0)``; every rank calls ``torch.set_num_threads(1)``, as torchrun does with
several ranks per host, so the 2 ranks use the machine's 2 cores and torch's own copies
(memcpy reference, DCP's copies) get no extra threads. tessera's IO threads are its own
(its default count), not torch's.

Two conditions, each with its own checkpoints:
  warm: checkpoint directories on tmpfs (``--warm-dir``, default /dev/shm), so the files are
        in the page cache;
  cold: checkpoint directories on disk (``--disk-dir``, default a new directory under the
        repository's ``target/``); before every measurement the page cache of those files
        is dropped (``os.sync()``, then ``posix_fadvise(DONTNEED)`` on every file).

Save (each round, order rotated): the Shard(0) state is saved by
  (a) ``tessera.torch.save(sd, checkpoint_id=DIR)`` (fsyncs each data file, commits its index
      by write-temp + fsync + rename + fsync of the directory);
  (b) ``torch.distributed.checkpoint.save(sd, checkpoint_id=DIR)``, i.e. ``FileSystemWriter``
      defaults (one file per rank, ``thread_count=1``, ``sync_files=True``);
  (c) raw write reference: each rank writes its share's bytes (its Shard(0) pieces, in order)
      to one file in a fresh directory with ``write``, then ``fsync`` of the file and of the
      directory, as tessera makes its files durable.
The directory is removed before each save; the last round's tessera and DCP checkpoints are the
ones loaded.

Load (each round, order rotated): the targets are DTensors with placement ``Shard(1)`` (a
resharded load, in place), allocated once and zero-filled (``fill_(0)``, so their pages are
faulted in) before every measurement. Each rank runs
  (a) ``tessera.torch.load(sd, checkpoint_id=DIR)``;
  (b) ``torch.distributed.checkpoint.load(sd, checkpoint_id=DIR)``;
  (c) memcpy reference: ``target_local.copy_(source)`` for every tensor, ``source`` being an
      in-memory tensor holding the rank's Shard(1) piece (the same bytes into the same
      targets);
  (d) sequential-read reference: every file of the tessera checkpoint read once, start to end,
      with ``readinto`` into a preallocated, already-faulted buffer; the files are split
      between the 2 ranks (largest first, each to the rank with fewer bytes so far), both
      ranks reading at the same time, as the loads do.
After every load the targets are compared with the truth, bit for bit (a failure aborts).

Timing: every measurement is rank 0's wall time from a barrier before to a barrier after (so
it includes the slower rank), the same for every method and reference. ``--rounds`` rounds
(default 3), methods interleaved; the table gives median times and the median over rounds of
each round's ratio (both sides of a ratio come from the same round). Ratios of times:
  load: tessera/memcpy, DCP/memcpy, DCP/tessera (warm); tessera/seq-read, DCP/tessera (cold);
  save: raw-write/tessera (= tessera throughput as a fraction of raw write, goal >= 0.95),
        DCP/tessera (goal >= 1.5).
bytes read / bytes needed of tessera's loads comes from the ``stats`` of the native load's
result, caught by a wrapper around ``tessera._native.load`` (``tessera.torch.load`` does not
return them); reported as n/a if the binding gives none. One small untimed save and load of
each library first (import and first-use costs).

Output: per round lines while running, then a Markdown table for BENCHMARKS.md with the
machine (cores, RAM, torch, tessera, file systems); ``--json PATH`` (or ``-``, table
omitted) writes everything, samples included. The checkpoints are removed at the end unless
``--keep``. ``--quick``: 32 MiB in 4 tensors, 1 round unless ``--rounds`` is given, for a
smoke test of a few seconds.

Usage: .venv/bin/python scripts/bench/bench_load_speed.py [--size 1GiB] [--tensors 16] [--rounds 3]
       [--warm-dir /dev/shm] [--disk-dir DIR] [--quick] [--keep] [--json PATH|-]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from bench_files import drop_cache, files_under, fsync_path, write_all
from tessera._launch import run_ranks

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
CONDITIONS = ["warm", "cold"]
SAVES = ["tessera", "dcp", "raw_write"]
LOADS = ["tessera", "dcp", "memcpy", "seq_read"]
RESULTS = "bench_load_speed.results.json"  # rank 0 → parent, in the cold scratch directory
LABELS = {
    ("load", "tessera"): "load: `tessera.torch.load`",
    ("load", "dcp"): "load: torch DCP `dcp.load`",
    ("load", "memcpy"): "reference: memcpy (`copy_` into the targets)",
    ("load", "seq_read"): "reference: sequential read of tessera's files",
    ("save", "tessera"): "save: `tessera.torch.save`",
    ("save", "dcp"): "save: torch DCP `dcp.save`",
    ("save", "raw_write"): "reference: raw write + fsync",
}


# ---------------------------------------------------------------------------------------------
# Sizes and the state


def size_arg(text: str) -> int:
    """Bytes from '1GiB', '32MiB', '500MB', '4096'."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([kKmMgGtT])(i?)[bB]?|[bB]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    scale = 1
    if m.group(2):
        scale = (1024 if m.group(3) else 1000) ** ("KMGT".index(m.group(2).upper()) + 1)
    return int(float(m.group(1)) * scale)


def tensor_side(size: int, tensors: int) -> int:
    """Side of each square f32 tensor: the largest even n with tensors * n * n * 4 <= size."""
    side = math.isqrt(size // (4 * tensors))
    side -= side % WORLD
    if side < WORLD:
        raise SystemExit(f"--size {size} is too small for {tensors} tensors")
    return side


def full_value(index: int, side: int) -> torch.Tensor:
    """Tensor ``index`` of the state, whole (the same on every process)."""
    g = torch.Generator().manual_seed(19_000 + index)
    return torch.randn((side, side), generator=g, dtype=torch.float32)


def gib(n: float) -> float:
    return n / 2**30


# ---------------------------------------------------------------------------------------------
# File helpers


def read_into(path: str, view: memoryview) -> int:
    """Reads the whole file ``path`` into the start of ``view``; returns its size."""
    with open(path, "rb", buffering=0) as f:
        done = 0
        while True:
            n = f.readinto(view[done:])
            if not n:
                return done
            done += n


def split_files(files: List[str]) -> List[List[str]]:
    """The files of a checkpoint shared between the ranks: largest first, each to the rank
    with the fewest bytes so far (deterministic, so every rank computes the same split)."""
    shares: List[List[str]] = [[] for _ in range(WORLD)]
    load = [0] * WORLD
    for f in sorted(files, key=lambda f: (-os.path.getsize(f), f)):
        r = load.index(min(load))
        shares[r].append(f)
        load[r] += os.path.getsize(f)
    return shares


def fs_type(path: str) -> str:
    """File system type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


# ---------------------------------------------------------------------------------------------
# The ranks


class Rank:
    """One rank's state, targets and the measured operations."""

    def __init__(self, rank: int, opts: Dict[str, Any]) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        self.dist = dist
        self.rank = rank
        self.opts = opts
        mesh = init_device_mesh("cpu", (WORLD,))
        side = opts["side"]
        half = side // WORLD
        rows = slice(rank * half, (rank + 1) * half)
        self.source: Dict[str, Any] = {}  # Shard(0): what is saved
        self.target: Dict[str, Any] = {}  # Shard(1): what is loaded into
        self.truth: Dict[str, torch.Tensor] = {}  # this rank's Shard(1) pieces, the memcpy source
        for i in range(opts["tensors"]):
            key = f"layers.{i}.weight"
            full = full_value(i, side)
            shape, stride = torch.Size((side, side)), (side, 1)
            self.source[key] = DTensor.from_local(full[rows].contiguous(), mesh, [Shard(0)], run_check=False,
                                                  shape=shape, stride=stride)
            self.truth[key] = full[:, rank * half:(rank + 1) * half].contiguous()
            self.target[key] = DTensor.from_local(torch.zeros(side, half), mesh, [Shard(1)], run_check=False,
                                                  shape=shape, stride=stride)
            del full
        self.share_bytes = sum(t.to_local().nbytes for t in self.source.values())
        self.read_buf: Optional[torch.Tensor] = None
        self.stats: List[Dict[str, int]] = []
        self._catch_stats()

    def _catch_stats(self) -> None:
        """Keeps the ``stats`` of every native load (tessera.torch.load drops them)."""
        import tessera._native as native

        real = native.load

        def load(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            stats = result.get("stats") if isinstance(result, dict) else None
            if isinstance(stats, dict):
                self.stats.append(dict(stats))
            return result

        native.load = load

    # -- saves --------------------------------------------------------------------------------

    def save(self, method: str, path: str, sd: Optional[Dict[str, Any]] = None) -> None:
        sd = self.source if sd is None else sd
        if method == "tessera":
            import tessera.torch as tt

            tt.save(sd, checkpoint_id=path)
        elif method == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.save(sd, checkpoint_id=path)
        elif method == "raw_write":
            os.makedirs(path, exist_ok=True)
            file = os.path.join(path, f"rank{self.rank}.bin")
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for t in sd.values():
                    write_all(fd, memoryview(t.to_local().numpy()).cast("B"))
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_path(path)
        else:
            raise ValueError(method)

    # -- loads --------------------------------------------------------------------------------

    def prepare_load(self, method: str, tessera_dir: str) -> None:
        """Untimed: targets zeroed (touched), the read buffer allocated and touched."""
        with torch.no_grad():
            for t in self.target.values():
                t.to_local().fill_(0)
        if method == "seq_read":
            mine = split_files(files_under(tessera_dir))[self.rank]
            need = max(1, sum(os.path.getsize(f) for f in mine))
            if self.read_buf is None or self.read_buf.numel() < need:
                self.read_buf = None
                self.read_buf = torch.empty(need, dtype=torch.uint8)
            self.read_buf.fill_(0)

    def load(self, method: str, path: str, sd: Optional[Dict[str, Any]] = None) -> None:
        sd = self.target if sd is None else sd
        if method == "tessera":
            import tessera.torch as tt

            tt.load(sd, checkpoint_id=path)
        elif method == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.load(sd, checkpoint_id=path)
        elif method == "memcpy":
            with torch.no_grad():
                for key, t in sd.items():
                    t.to_local().copy_(self.truth[key])
        elif method == "seq_read":
            assert self.read_buf is not None
            view = memoryview(self.read_buf.numpy()).cast("B")
            at = 0
            for f in split_files(files_under(path))[self.rank]:
                at += read_into(f, view[at:])
        else:
            raise ValueError(method)

    def check(self, what: str) -> None:
        """The targets hold the truth, bit for bit."""
        for key, t in self.target.items():
            got = t.to_local()
            want = self.truth[key]
            if got.shape != want.shape or not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                raise AssertionError(f"rank {self.rank}: {what}: {key} differs from the saved state")

    # -- timing -------------------------------------------------------------------------------

    def timed(self, fn: Any) -> float:
        self.dist.barrier()
        t0 = time.perf_counter()
        fn()
        self.dist.barrier()
        return time.perf_counter() - t0


def rotated(methods: List[str], r: int) -> List[str]:
    k = r % len(methods)
    return methods[k:] + methods[:k]


def say(rank: int, text: str, opts: Dict[str, Any]) -> None:
    """A progress line from rank 0 (on stderr when stdout is the JSON)."""
    if rank == 0:
        print(text, file=sys.stderr if opts["json_stdout"] else sys.stdout, flush=True)


def run_rank(rank: int, world: int, opts: Dict[str, Any]) -> None:
    torch.set_num_threads(1)  # as torchrun does (OMP_NUM_THREADS=1) with several ranks per host
    me = Rank(rank, opts)
    dist = me.dist
    roots = {"warm": opts["warm_root"], "cold": opts["cold_root"]}
    rounds = opts["rounds"]

    # First use of each library, untimed: one tensor, saved and loaded on tmpfs.
    first = next(iter(me.source))
    for method in ("tessera", "dcp"):
        path = os.path.join(roots["warm"], f"warmup-{method}")
        me.save(method, path, {first: me.source[first]})
        dist.barrier()
        me.load(method, path, {first: me.target[first]})
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    me.stats.clear()

    save_t: Dict[str, Dict[str, List[float]]] = {c: {m: [] for m in SAVES} for c in CONDITIONS}
    load_t: Dict[str, Dict[str, List[float]]] = {c: {m: [] for m in LOADS} for c in CONDITIONS}
    stats: Dict[str, List[Dict[str, int]]] = {c: [] for c in CONDITIONS}
    files: Dict[str, Dict[str, Any]] = {c: {} for c in CONDITIONS}
    for cond in CONDITIONS:
        root = roots[cond]
        ckpt = {m: os.path.join(root, m) for m in SAVES}
        for r in range(rounds):
            for method in rotated(SAVES, r):
                if rank == 0:
                    shutil.rmtree(ckpt[method], ignore_errors=True)
                    os.sync()
                t = me.timed(lambda: me.save(method, ckpt[method]))
                save_t[cond][method].append(t)
                say(rank, f"  {cond} round {r + 1} save {method:9s} {t:7.3f} s  "
                          f"{gib(opts['bytes']) / t:6.2f} GiB/s", opts)
                if method == "raw_write":
                    dist.barrier()
                    if rank == 0:
                        shutil.rmtree(ckpt[method], ignore_errors=True)
        dist.barrier()
        for m in ("tessera", "dcp"):
            fs = files_under(ckpt[m])
            files[cond][m] = {"files": len(fs), "bytes": sum(os.path.getsize(f) for f in fs)}
        for r in range(rounds):
            for method in rotated(LOADS, r):
                me.prepare_load(method, ckpt["tessera"])
                if cond == "cold" and rank == 0:
                    drop_cache(ckpt["tessera"], ckpt["dcp"])
                path = ckpt["tessera"] if method in ("tessera", "seq_read") else ckpt["dcp"]
                n_stats = len(me.stats)
                t = me.timed(lambda: me.load(method, path))
                load_t[cond][method].append(t)
                if method != "seq_read":
                    me.check(f"{cond} round {r + 1} {method}")
                if method == "tessera" and len(me.stats) > n_stats:
                    stats[cond].append(me.stats[-1])
                say(rank, f"  {cond} round {r + 1} load {method:9s} {t:7.3f} s  "
                          f"{gib(opts['bytes']) / t:6.2f} GiB/s", opts)

    # bytes read / needed, summed over both ranks, per tessera load.
    gathered: List[Any] = [None] * WORLD
    dist.all_gather_object(gathered, stats)
    if rank == 0:
        io = {}
        for cond in CONDITIONS:
            per_load = list(zip(*(g[cond] for g in gathered)))
            io[cond] = [
                {k: sum(s.get(k, 0) for s in loads) for k in ("bytes_needed", "bytes_read", "reads")}
                for loads in per_load
            ]
        out = {"save_s": save_t, "load_s": load_t, "tessera_io": io, "checkpoints": files}
        with open(os.path.join(roots["cold"], RESULTS), "w") as f:
            json.dump(out, f)
    dist.barrier()


def run_job(opts: Dict[str, Any]) -> Dict[str, Any]:
    """Runs the ranks; returns rank 0's results."""
    run_ranks(WORLD, run_rank, opts)
    with open(os.path.join(opts["cold_root"], RESULTS)) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# Report


def machine(opts: Dict[str, Any]) -> Dict[str, Any]:
    ram = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    import tessera

    tessera_version = getattr(tessera, "__version__", "?")
    return {
        "cores": os.cpu_count(),
        "ram_bytes": ram,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tessera": tessera_version,
        "warm_fs": fs_type(opts["warm_root"]),
        "cold_fs": fs_type(opts["cold_root"]),
    }


# (name, numerator (kind, method), denominator (kind, method), goal)
RATIOS = [
    ("load: tessera / memcpy", ("load", "tessera"), ("load", "memcpy"), None),
    ("load: DCP / memcpy", ("load", "dcp"), ("load", "memcpy"), None),
    ("load: DCP / tessera", ("load", "dcp"), ("load", "tessera"), None),
    ("load: tessera / sequential read", ("load", "tessera"), ("load", "seq_read"), None),
    ("save: raw write / tessera (tessera's share of raw write throughput)", ("save", "raw_write"),
     ("save", "tessera"), ">= 0.95"),
    ("save: DCP / tessera", ("save", "dcp"), ("save", "tessera"), ">= 1.5"),
]


def summarize(opts: Dict[str, Any], raw: Dict[str, Any]) -> Dict[str, Any]:
    med = statistics.median
    times = {"save": raw["save_s"], "load": raw["load_s"]}
    doc: Dict[str, Any] = {
        "bytes": opts["bytes"],
        "tensors": opts["tensors"],
        "shape": [opts["side"], opts["side"]],
        "ranks": WORLD,
        "rounds": opts["rounds"],
        "machine": machine(opts),
        "median_s": {k: {c: {m: med(v) for m, v in by_m.items()} for c, by_m in by_c.items()}
                     for k, by_c in times.items()},
        "samples_s": times,
        "ratios": {},
        "tessera_bytes_read_over_needed": {},
        "tessera_io": raw["tessera_io"],
        "checkpoints": raw["checkpoints"],
    }
    for name, (kn, mn), (kd, md), goal in RATIOS:
        doc["ratios"][name] = {"goal": goal}
        for c in CONDITIONS:
            per_round = [a / b for a, b in zip(times[kn][c][mn], times[kd][c][md])]
            doc["ratios"][name][c] = {"median": med(per_round), "rounds": per_round}
    for c in CONDITIONS:
        io = raw["tessera_io"][c]
        ok = io and all(x["bytes_needed"] for x in io)
        doc["tessera_bytes_read_over_needed"][c] = med(x["bytes_read"] / x["bytes_needed"] for x in io) if ok else None
    return doc


def print_report(doc: Dict[str, Any]) -> None:
    m = doc["machine"]
    size = doc["bytes"]
    side = doc["shape"][0]
    print()
    print(f"**Load and save speed** (`scripts/bench/bench_load_speed.py`): {gib(size):.2f} GiB of f32 in "
          f"{doc['tensors']} tensors of {side}×{side}, DTensors saved as `Shard(0)` from {doc['ranks']} gloo "
          f"ranks and loaded in place as `Shard(1)`; warm: on {m['warm_fs']} (in the page cache), cold: on "
          f"{m['cold_fs']} with the page cache dropped before each measurement; rank 0's wall time from "
          f"barrier to barrier; median of {doc['rounds']} rounds (all rounds in parentheses); every load "
          f"bit-identical to the saved state. Machine: {m['cores']} cores, {gib(m['ram_bytes']):.0f} GiB RAM, "
          f"torch {m['torch']}, tessera {m['tessera']}, Linux {m['kernel']}.")
    print()
    print("| | warm (tmpfs) | cold (disk, cache dropped) |")
    print("|---|---|---|")
    for kind, methods in (("load", LOADS), ("save", SAVES)):
        for method in methods:
            cells = []
            for c in CONDITIONS:
                t = doc["median_s"][kind][c][method]
                rounds = ", ".join(f"{x:.3f}" for x in doc["samples_s"][kind][c][method])
                cells.append(f"{t:.3f} s, {gib(size) / t:.2f} GiB/s ({rounds})")
            print(f"| {LABELS[(kind, method)]} | {cells[0]} | {cells[1]} |")
    print()
    print("| ratio of times (median of per-round ratios) | warm | cold | goal |")
    print("|---|---|---|---|")
    for name, _, _, goal in RATIOS:
        r = doc["ratios"][name]
        cells = [f"{r[c]['median']:.2f}× ({', '.join(f'{x:.2f}' for x in r[c]['rounds'])})" for c in CONDITIONS]
        print(f"| {name} | {cells[0]} | {cells[1]} | {goal or ''} |")
    rn = doc["tessera_bytes_read_over_needed"]
    cells = [f"{rn[c]:.3f}×" if rn[c] is not None else "n/a" for c in CONDITIONS]
    print(f"| tessera load: bytes read / bytes needed | {cells[0]} | {cells[1]} | |")
    print()
    ck = doc["checkpoints"]["cold"]
    print(f"Checkpoints: tessera {ck['tessera']['files']} files, {gib(ck['tessera']['bytes']):.3f} GiB; "
          f"DCP {ck['dcp']['files']} files, {gib(ck['dcp']['bytes']):.3f} GiB. "
          f"`torch.set_num_threads(1)` in each rank; the sequential read splits tessera's files between "
          f"the 2 ranks.")


# ---------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=size_arg, default=None, help="state size (default 1GiB; --quick: 32MiB)")
    ap.add_argument("--tensors", type=int, default=None, help="number of tensors (default 16; --quick: 4)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --quick: 1)")
    ap.add_argument("--warm-dir", default="/dev/shm", help="tmpfs directory for the warm condition")
    ap.add_argument("--disk-dir", default=None, help="disk directory for the cold condition (default: REPO/target)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 32MiB in 4 tensors, 1 round")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (their paths are printed)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': stdout, no table)")
    args = ap.parse_args(argv)
    size = args.size if args.size is not None else size_arg("32MiB" if args.quick else "1GiB")
    tensors = args.tensors if args.tensors is not None else (4 if args.quick else 16)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if rounds < 1 or tensors < 1:
        ap.error("--rounds and --tensors must be >= 1")
    side = tensor_side(size, tensors)
    if fs_type(args.warm_dir) != "tmpfs":
        print(f"WARNING: {args.warm_dir} is not tmpfs ({fs_type(args.warm_dir)}): 'warm' may not be all in memory",
              file=sys.stderr)
    disk_parent = Path(args.disk_dir) if args.disk_dir else REPO / "target"
    disk_parent.mkdir(parents=True, exist_ok=True)
    warm_root = tempfile.mkdtemp(prefix="tessera-bench-load.", dir=args.warm_dir)
    cold_root = tempfile.mkdtemp(prefix="tessera-bench-load.", dir=str(disk_parent))
    opts = {
        "bytes": tensors * side * side * 4,
        "tensors": tensors,
        "side": side,
        "rounds": rounds,
        "warm_root": warm_root,
        "cold_root": cold_root,
        "json_stdout": args.json == "-",
    }
    if args.json != "-":
        print(f"{gib(opts['bytes']):.3f} GiB in {tensors} f32 tensors of {side}x{side}, {WORLD} ranks, "
              f"{rounds} round(s); warm: {warm_root}, cold: {cold_root}", flush=True)
    try:
        doc = summarize(opts, run_job(opts))
    finally:
        if args.keep:
            print(f"kept {warm_root} and {cold_root}", file=sys.stderr)
        else:
            shutil.rmtree(warm_root, ignore_errors=True)
            shutil.rmtree(cold_root, ignore_errors=True)
    if args.json == "-":
        print(json.dumps(doc, indent=2))
    else:
        print_report(doc)
        if args.json:
            with open(args.json, "w") as f:
                f.write(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
