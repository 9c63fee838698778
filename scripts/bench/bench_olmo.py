"""tessera vs ai2-olmo-core 0.1.0 on OLMo-core's own checkpoint format: unshard and in-place load.

Run in .venv-olmo (torch 2.7.1 + ai2-olmo-core 0.1.0 + tessera built in; ``scripts/env/olmo_env.sh``),
on CPU with gloo ranks on 127.0.0.1; ``scripts/bench/bench_olmo.sh`` sets everything up and runs it.

1. Checkpoint (reused when ``--dir`` already holds one made with the same options). A model of
   ``L`` blocks, each one ``nn.Linear(H, H)`` with bias (``H = --hidden``, ``L`` the fewest
   blocks whose f32 parameters reach ``--size``), is wrapped in torch FSDP1
   (``use_orig_params=True``, one FSDP unit per block) on 2 gloo ranks; AdamW takes one step with
   random gradients (non-zero optimizer state) and ai2-olmo-core's own
   ``save_model_and_optim_state`` writes ``DIR/ckpt/{model,optim}/``.
2. Every file of the checkpoint is read once, untimed: the page cache is warm for every method.
3. Unshard of ``model/``, the methods alternating (order rotated each round):
     cli      ``tessera unshard DIR/ckpt/model --out DIR/out.safetensors``: a subprocess, timed
              from start to exit; its peak RSS (from zero) is measured by GNU ``/usr/bin/time``.
              It writes and fsyncs its output file, which the Python methods do not.
     tessera  ``tessera.olmo_core.unshard_model_state(DIR/ckpt)``
     olmo     ``olmo_core.distributed.checkpoint.Checkpointer().unshard(DIR/ckpt/model, no_dist=True)``
   Each Python method runs in a fresh subprocess; after its imports the peak-RSS mark is reset
   (``/proc/self/clear_refs`` ← 5), then the call alone is timed and its peak RSS growth is
   ``VmHWM`` after it minus ``VmRSS`` just before it (``ru_maxrss`` if the reset is refused; that
   also counts this script's RSS at the fork, so it overstates).
   RSS counts file pages mapped into the process too (OLMo-core reads through safetensors'
   mmap). In the first round every method's output is hashed tensor by tensor and the three
   are compared (names, dtypes, shapes, bytes); a difference stops the benchmark.
   References, in the same rotation: ``cat model/* > /dev/null``; a Python ``readinto`` of the
   model files into freshly allocated memory of their size (the least an in-memory unshard
   does); a write + fsync of the output's size into DIR (what the CLI adds).
4. In-place load, one gloo job of ``WORLD`` ranks (2, then ``--reshard-world``, default 3, 0 to
   skip): each rank builds the same FSDP1 model and an AdamW, initialises its state with
   ``init_optimizer_state`` (untimed, once: both methods fill existing state), then per round,
   methods alternating, zeroes parameters and state (untimed), and times
     tessera  ``tessera.olmo_core.load_model_and_optim_state(DIR/ckpt, model, optim)``
     olmo     ``olmo_core.distributed.checkpoint.load_model_and_optim_state(DIR/ckpt, model, optim)``
   (OLMo-core's default ``validate=True``: NaN prefill and check, its normal behaviour), between
   barriers; the time of a call is the slowest rank's. In the first round each rank hashes its
   parameters and optimizer state after each method and both must agree. Reference: one ``cat``
   per saving rank, in parallel, of that rank's model and optim files (what a same-layout load
   reads).
5. A table (median over ``--rounds``; ratio = OLMo-core time / tessera time; peak RSS growth and
   growth minus output size in MiB) and, with ``--json PATH``, the same as JSON. Goals set by the
   project: tessera ≥ 3× faster than OLMo-core; peak memory ≤ output size + 64 MiB.

Ranks use one intra-op thread each (``torch.set_num_threads(1)``, as torchrun's
``OMP_NUM_THREADS=1``); the unshard subprocesses keep torch's and OLMo-core's defaults.

Usage: .venv-olmo/bin/python scripts/bench/bench_olmo.py [--size 1GiB] [--dir target/bench-olmo]
       [--rounds 3] [--hidden 4096] [--reshard-world 3] [--json PATH] [--tessera BIN]
       [--remove-checkpoint]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import re
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parents[2]
WORLD = 2  # ranks that save the checkpoint
MiB, GiB = 1 << 20, 1 << 30
GOAL_SPEEDUP = 3.0
GOAL_MEMORY_SLACK = 64 * MiB
UNSHARD = ["cli", "tessera", "olmo", "cat", "read", "write"]
LOAD = ["tessera", "olmo"]
LABELS = {
    "cli": "tessera unshard (CLI; writes + fsyncs .safetensors)",
    "tessera": "tessera.olmo_core",
    "olmo": "ai2-olmo-core 0.1.0",
    "cat": "ref: cat model/* > /dev/null",
    "read": "ref: readinto fresh memory",
    "write": "ref: write + fsync of output size",
}
RESULT = "BENCH_OLMO_RESULT "  # prefix of a child's result line on stdout
TIME = "/usr/bin/time"  # GNU time: the CLI's peak RSS


# ---------------------------------------------------------------------------------------------
# Sizes, memory, hashing


def parse_size(text: str) -> int:
    """``1GiB``, ``512MiB``, ``1.5G``, ``1e9``: binary units whether or not spelt with ``i``."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 512MiB, 1e9)")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(unit or " "))


def proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Resets this process's peak RSS mark (VmHWM) to its current RSS; False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def tensor_digest(t: torch.Tensor) -> str:
    flat = t.detach().contiguous().reshape(-1)
    return hashlib.blake2b(flat.view(torch.uint8).numpy() if flat.numel() else b"", digest_size=16).hexdigest()


def dir_files(path: Path) -> List[Path]:
    return sorted(p for p in path.iterdir() if p.is_file())


def files_bytes(files: Sequence[Path]) -> int:
    return sum(p.stat().st_size for p in files)


# ---------------------------------------------------------------------------------------------
# The model and the gloo jobs


class Block(nn.Module):
    """One large linear layer: FSDP1 wraps each block as its own unit."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


class BenchModel(nn.Module):
    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def layers_for(size: int, hidden: int) -> int:
    return max(1, math.ceil(size / (hidden * hidden * 4)))


def model_tensor_bytes(layers: int, hidden: int) -> int:
    return layers * (hidden * hidden + hidden) * 4


def build_fsdp1(layers: int, hidden: int, initialise: bool) -> nn.Module:
    """The benchmark model under FSDP1 (``use_orig_params=True``, one unit per block). Without
    ``initialise`` the parameters are left uninitialised (a load overwrites them)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if initialise:
        torch.manual_seed(0)
        model = BenchModel(layers, hidden)
    else:
        with torch.device("meta"):
            model = BenchModel(layers, hidden)
        model = model.to_empty(device="cpu")
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))


def _generate_rank(rank: int, world: int, ckpt: str, layers: int, hidden: int) -> None:
    import olmo_core.distributed.checkpoint as olmo

    torch.set_num_threads(1)  # as torchrun does (OMP_NUM_THREADS=1) with several ranks per host
    model = build_fsdp1(layers, hidden, initialise=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    optim.step()  # one step with random gradients: the optimizer state is not all zeros
    optim.zero_grad(set_to_none=True)
    olmo.save_model_and_optim_state(ckpt, model, optim)


def generate(work: Path, layers: int, hidden: int) -> Dict[str, Any]:
    """The checkpoint at ``work/ckpt``, written by ai2-olmo-core (reused when made with the same
    options)."""
    ckpt, info_path = work / "ckpt", work / "generated.json"
    info = {"layers": layers, "hidden": hidden, "world": WORLD, "ai2-olmo-core": version("ai2-olmo-core"),
            "torch": torch.__version__}
    done = all((ckpt / part / "metadata.json").is_file() for part in ("model", "optim"))
    if done and info_path.is_file() and json.loads(info_path.read_text()).get("options") == info:
        print(f"reusing {ckpt}")
        return {**json.loads(info_path.read_text()), "reused": True}
    shutil.rmtree(ckpt, ignore_errors=True)
    info_path.unlink(missing_ok=True)
    print(f"generating with ai2-olmo-core: {layers} x Linear({hidden}, {hidden}) f32 + AdamW, FSDP1 on "
          f"{WORLD} ranks -> {ckpt}", flush=True)
    # Imported here, not at the top: the --child-unshard subprocesses import this module too,
    # and OLMo-core's should not load tessera's native library before its unshard is measured.
    from tessera._launch import run_ranks

    t0 = time.perf_counter()
    run_ranks(WORLD, _generate_rank, str(ckpt), layers, hidden)
    record = {"options": info, "seconds": round(time.perf_counter() - t0, 1)}
    info_path.write_text(json.dumps(record))
    print(f"  generated in {record['seconds']:.0f} s")
    return {**record, "reused": False}


# ---------------------------------------------------------------------------------------------
# Unshard: one subprocess per Python call, the CLI, the references


def child_unshard(method: str, ckpt: str, digest: bool) -> None:
    """Runs in a fresh interpreter: one unshard, timed and measured from inside."""
    if method == "tessera":
        from tessera.olmo_core import unshard_model_state

        def call() -> Dict[str, torch.Tensor]:
            return unshard_model_state(ckpt)
    else:
        from olmo_core.distributed.checkpoint import Checkpointer

        def call() -> Dict[str, torch.Tensor]:
            return Checkpointer().unshard(f"{ckpt}/model", no_dist=True)

    gc.collect()
    reset = reset_peak_rss()
    rss0 = proc_status_kib("VmRSS")
    t0 = time.perf_counter()
    out = call()
    seconds = time.perf_counter() - t0
    peak = proc_status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result: Dict[str, Any] = {
        "seconds": seconds,
        "peak_growth": (peak - rss0) * 1024,
        "peak_source": "VmHWM" if reset else "ru_maxrss",
        "output_bytes": sum(t.numel() * t.element_size() for t in out.values()),
    }
    if digest:
        result["digest"] = {k: [str(t.dtype).replace("torch.", ""), list(t.shape), tensor_digest(t)] for k, t in out.items()}
    print(RESULT + json.dumps(result), flush=True)


def run_python_unshard(method: str, ckpt: Path, digest: bool) -> Dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-unshard", method, str(ckpt)]
    proc = subprocess.run(cmd + (["--digest"] if digest else []), capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{method} unshard failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT):])


SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def safetensors_digest(path: Path) -> Tuple[int, Dict[str, List[Any]]]:
    """Tensor bytes and per-tensor (dtype, shape, hash) of a safetensors file, read directly."""
    out: Dict[str, List[Any]] = {}
    total = 0
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        for key, t in header.items():
            if key == "__metadata__":
                continue
            start, end = t["data_offsets"]
            total += end - start
            f.seek(8 + n + start)
            out[key] = [SAFETENSORS_DTYPES.get(t["dtype"], t["dtype"]), t["shape"],
                        hashlib.blake2b(f.read(end - start), digest_size=16).hexdigest()]
    return total, out


def run_cli(tessera: Path, ckpt: Path, out: Path, digest: bool) -> Dict[str, Any]:
    """The CLI under ``/usr/bin/time``: its own peak RSS. (A child forked directly from this
    process would not do: Linux carries the parent's RSS high-water mark at fork into the
    child's ``ru_maxrss`` across ``exec``.)"""
    out.unlink(missing_ok=True)
    cmd = [str(tessera), "unshard", str(ckpt / "model"), "--out", str(out)]
    with tempfile.NamedTemporaryFile("r") as maxrss, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.run([TIME, "-f", "%M", "-o", maxrss.name, *cmd], stdout=subprocess.DEVNULL, stderr=err)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err.read().decode()[-4000:]}")
        peak_kib = int(maxrss.read().split()[-1])
    result: Dict[str, Any] = {"seconds": seconds, "peak_growth": peak_kib * 1024, "peak_source": "ru_maxrss (/usr/bin/time)"}
    if digest:
        result["output_bytes"], result["digest"] = safetensors_digest(out)
    else:
        with open(out, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        result["output_bytes"] = sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items()
                                     if k != "__metadata__")
    out.unlink()
    return result


def run_cat(files: Sequence[Path]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def run_read_fresh(files: Sequence[Path]) -> float:
    """Reads the files into one freshly allocated buffer of their total size."""
    t0 = time.perf_counter()
    buf = torch.empty(files_bytes(files), dtype=torch.uint8)
    view, at = memoryview(buf.numpy()), 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view[at:]):
                at += n
    seconds = time.perf_counter() - t0
    del view, buf
    return seconds


def run_write(path: Path, size: int) -> float:
    chunk = os.urandom(64 * MiB)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left > 0:
            left -= os.write(fd, memoryview(chunk)[: min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def bench_unshard(ckpt: Path, work: Path, tessera: Path, rounds: int) -> Dict[str, Any]:
    model_files = dir_files(ckpt / "model")
    runs: Dict[str, List[Dict[str, Any]]] = {m: [] for m in UNSHARD}
    digests: Dict[str, Dict[str, Any]] = {}
    output_bytes: Optional[int] = None
    for r in range(rounds):
        order = UNSHARD[r % len(UNSHARD):] + UNSHARD[: r % len(UNSHARD)]
        for m in order:
            check = r == 0
            if m == "cli":
                res = run_cli(tessera, ckpt, work / "out.safetensors", check)
            elif m in ("tessera", "olmo"):
                res = run_python_unshard(m, ckpt, check)
            elif m == "cat":
                res = {"seconds": run_cat(model_files)}
            elif m == "read":
                res = {"seconds": run_read_fresh(model_files)}
            else:
                res = {"seconds": run_write(work / "write-ref.bin", output_bytes or files_bytes(model_files))}
            if "digest" in res:
                digests[m] = res.pop("digest")
            if "output_bytes" in res:
                output_bytes = output_bytes or res["output_bytes"]
                if res["output_bytes"] != output_bytes:
                    raise SystemExit(f"{m}: {res['output_bytes']} bytes of tensors, another method {output_bytes}")
            runs[m].append(res)
            extra = f"  peak RSS growth {res['peak_growth'] / MiB:7.0f} MiB" if "peak_growth" in res else ""
            print(f"  unshard round {r + 1} {m:8s} {res['seconds']:7.2f} s{extra}", flush=True)
        if r == 0:
            ref = digests["olmo"]
            for m in ("cli", "tessera"):
                if digests[m] != ref:
                    diff = sorted(k for k in ref.keys() | digests[m].keys() if ref.get(k) != digests[m].get(k))
                    raise SystemExit(f"unshard outputs differ, {m} vs OLMo-core: {diff[:5]}")
            print(f"  outputs identical: {len(ref)} tensors (names, dtypes, shapes, bytes)", flush=True)
    return {"runs": runs, "output_bytes": output_bytes, "model_file_bytes": files_bytes(model_files),
            "tensors": len(digests.get("olmo", {}))}


# ---------------------------------------------------------------------------------------------
# In-place load: one gloo job, both methods alternating


def _local_digest(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, p in model.named_parameters():
        h.update(name.encode() + tensor_digest(p.data).encode())
        for k, v in sorted(optim.state.get(p, {}).items()):
            h.update(k.encode() + (tensor_digest(v) if isinstance(v, torch.Tensor) else repr(v)).encode())
    return h.hexdigest()


def _scrub(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.data.zero_()
        for state in optim.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    v.zero_()


def _load_rank(rank: int, world: int, ckpt: str, layers: int, hidden: int, rounds: int, result: str) -> None:
    import olmo_core.distributed.checkpoint as olmo
    import torch.distributed as dist

    import tessera.olmo_core as tess

    torch.set_num_threads(1)  # as torchrun does (OMP_NUM_THREADS=1) with several ranks per host
    model = build_fsdp1(layers, hidden, initialise=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    olmo.init_optimizer_state(optim)  # untimed: both methods fill existing state
    calls = {"tessera": tess.load_model_and_optim_state, "olmo": olmo.load_model_and_optim_state}
    times: Dict[str, List[float]] = {m: [] for m in LOAD}
    digests: Dict[str, str] = {}
    for r in range(rounds):
        for m in LOAD[r % len(LOAD):] + LOAD[: r % len(LOAD)]:
            _scrub(model, optim)
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            calls[m](ckpt, model, optim)
            times[m].append(time.perf_counter() - t0)
            dist.barrier()
            if r == 0:
                digests[m] = _local_digest(model, optim)
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, {"times": times, "digests": digests})
    if rank == 0:
        Path(result).write_text(json.dumps(gathered))


def bench_load(ckpt: Path, work: Path, layers: int, hidden: int, world: int, rounds: int) -> Dict[str, Any]:
    result = work / f"load-w{world}.json"
    result.unlink(missing_ok=True)
    from tessera._launch import run_ranks  # here, not at the top: see generate()

    t0 = time.perf_counter()
    run_ranks(world, _load_rank, str(ckpt), layers, hidden, rounds, str(result))
    job_seconds = time.perf_counter() - t0
    per_rank = json.loads(result.read_text())
    result.unlink()
    for rank, rr in enumerate(per_rank):
        if len(set(rr["digests"].values())) != 1:
            raise SystemExit(f"load at {world} ranks: rank {rank} holds different state after each method: {rr['digests']}")
    times = {m: [max(rr["times"][m][i] for rr in per_rank) for i in range(rounds)] for m in LOAD}
    for i in range(rounds):
        print(f"  load {WORLD}->{world} round {i + 1} " + "  ".join(f"{m} {times[m][i]:6.2f} s" for m in LOAD), flush=True)
    print(f"  loaded state identical on every rank after both methods ({world} ranks)", flush=True)
    return {"world": world, "times": times, "per_rank": [rr["times"] for rr in per_rank], "job_seconds": job_seconds}


def bench_parallel_cat(ckpt: Path, rounds: int) -> List[float]:
    """One ``cat`` per saving rank, in parallel, of that rank's model and optim files."""
    out = []
    for _ in range(rounds):
        groups = [[ckpt / part / f"rank_{r}.safetensors" for part in ("model", "optim")] for r in range(WORLD)]
        t0 = time.perf_counter()
        procs = [subprocess.Popen(["cat", *map(str, g)], stdout=subprocess.DEVNULL) for g in groups]
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("cat of the rank files failed")
        out.append(time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------------------------------------
# Report


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def summarise(ckpt_info: Dict[str, Any], unshard: Dict[str, Any], loads: List[Dict[str, Any]],
              cat_ranks: List[float], sizes: Dict[str, int], rounds: int) -> Dict[str, Any]:
    out_bytes = unshard["output_bytes"]
    methods: Dict[str, Any] = {}
    for m, runs in unshard["runs"].items():
        secs = [r["seconds"] for r in runs]
        entry: Dict[str, Any] = {"label": LABELS[m], "seconds": secs, "median_s": med(secs),
                                 "gib_per_s": out_bytes / GiB / med(secs)}
        if runs and "peak_growth" in runs[0]:
            growth = med([r["peak_growth"] for r in runs])
            entry.update({"peak_rss_growth_mib": [r["peak_growth"] / MiB for r in runs],
                          "median_peak_rss_growth_mib": growth / MiB,
                          "peak_growth_minus_output_mib": (growth - out_bytes) / MiB,
                          "peak_source": runs[0]["peak_source"],
                          "memory_goal_met": growth <= out_bytes + GOAL_MEMORY_SLACK})
        methods[m] = entry
    t = {m: methods[m]["median_s"] for m in methods}
    load_summaries = []
    for ld in loads:
        lt = {m: med(ld["times"][m]) for m in LOAD}
        load_summaries.append({"world_saved": WORLD, "world_loaded": ld["world"], "seconds": ld["times"],
                               "per_rank_seconds": ld["per_rank"], "median_s": lt,
                               "olmo_over_tessera": lt["olmo"] / lt["tessera"],
                               "goal_met": lt["olmo"] / lt["tessera"] >= GOAL_SPEEDUP,
                               "job_seconds": ld["job_seconds"]})
    return {
        "versions": {"torch": torch.__version__, "ai2-olmo-core": version("ai2-olmo-core"), "tessera": _tessera_version()},
        "machine": {"cpus": os.cpu_count(), "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1)},
        "rounds": rounds,
        "checkpoint": {**sizes, "generation": ckpt_info},
        "unshard": {
            "output_bytes": out_bytes, "tensors": unshard["tensors"], "methods": methods,
            "olmo_over_tessera_python": t["olmo"] / t["tessera"],
            "olmo_over_tessera_cli": t["olmo"] / t["cli"],
            "tessera_python_over_read": t["tessera"] / t["read"],
            "goal_speedup_met_python": t["olmo"] / t["tessera"] >= GOAL_SPEEDUP,
            "goal_speedup_met_cli": t["olmo"] / t["cli"] >= GOAL_SPEEDUP,
        },
        "load": load_summaries,
        "load_reference_parallel_cat_s": {"seconds": cat_ranks, "median_s": med(cat_ranks) if cat_ranks else None},
        "goals": {"speedup": GOAL_SPEEDUP, "memory_slack_mib": GOAL_MEMORY_SLACK / MiB},
    }


def _tessera_version() -> str:
    try:
        return version("tessera")
    except Exception:  # noqa: BLE001 - an editable build may carry no distribution metadata
        return "unknown"


def print_report(s: Dict[str, Any]) -> None:
    c, u = s["checkpoint"], s["unshard"]
    print()
    print(f"checkpoint {c['dir']}: written by ai2-olmo-core {s['versions']['ai2-olmo-core']} (torch "
          f"{s['versions']['torch']}), FSDP1 use_orig_params on {WORLD} gloo ranks; {c['layers']} x "
          f"Linear({c['hidden']}, {c['hidden']}) f32 + bias")
    print(f"  model/ {c['model_file_bytes'] / GiB:.3f} GiB on disk, optim/ {c['optim_file_bytes'] / GiB:.3f} GiB; "
          f"{s['machine']['cpus']} CPUs, {s['machine']['mem_gib']} GiB RAM, page cache warm; median of {s['rounds']}")
    print()
    print(f"unshard of model/ ({u['tensors']} tensors, output {u['output_bytes'] / MiB:.0f} MiB)")
    print(f"  {'method':54s} {'median':>8s} {'GiB/s':>6s} {'peak RSS +':>11s} {'+ - output':>11s}  all runs (s)")
    for m, e in u["methods"].items():
        mem = (f"{e['median_peak_rss_growth_mib']:8.0f} MiB {e['peak_growth_minus_output_mib']:7.0f} MiB"
               if "median_peak_rss_growth_mib" in e else f"{'':11s} {'':11s}")
        print(f"  {e['label']:54s} {e['median_s']:7.2f}s {e['gib_per_s']:6.2f} {mem}  "
              + ", ".join(f"{x:.2f}" for x in e["seconds"]))
    print(f"  OLMo-core / tessera: {u['olmo_over_tessera_python']:.2f}x (Python), {u['olmo_over_tessera_cli']:.2f}x (CLI)"
          f"   goal >= {GOAL_SPEEDUP:.0f}x: Python {'met' if u['goal_speedup_met_python'] else 'NOT met'}, "
          f"CLI {'met' if u['goal_speedup_met_cli'] else 'NOT met'}")
    print(f"  tessera (Python) / readinto fresh memory: {u['tessera_python_over_read']:.2f}x")
    mem = ", ".join(f"{m} {'met' if e['memory_goal_met'] else 'NOT met'}" for m, e in u["methods"].items()
                    if "memory_goal_met" in e)
    print(f"  peak RSS growth <= output + {GOAL_MEMORY_SLACK // MiB} MiB: {mem}")
    ref = s["load_reference_parallel_cat_s"]["median_s"]
    for ld in s["load"]:
        lt = ld["median_s"]
        print()
        print(f"in-place load into FSDP1 + AdamW, saved at {ld['world_saved']} ranks -> loaded at {ld['world_loaded']} "
              f"(model/ + optim/ {(c['model_file_bytes'] + c['optim_file_bytes']) / GiB:.2f} GiB; slowest rank)")
        for m in LOAD:
            print(f"  {LABELS[m] + ' load_model_and_optim_state':54s} {lt[m]:7.2f}s   all runs: "
                  + ", ".join(f"{x:.2f}" for x in ld["seconds"][m]))
        if ref is not None:
            print(f"  {'ref: ' + str(WORLD) + ' parallel cat, each rank_r of model/ + optim/':54s} {ref:7.2f}s")
        print(f"  OLMo-core / tessera: {ld['olmo_over_tessera']:.2f}x   goal >= {GOAL_SPEEDUP:.0f}x: "
              f"{'met' if ld['goal_met'] else 'NOT met'}")


# ---------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child-unshard"]:
        child_unshard(argv[1], argv[2], "--digest" in argv[3:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=GiB, help="f32 bytes of model parameters, at least (default 1GiB)")
    ap.add_argument("--dir", type=Path, default=REPO / "target" / "bench-olmo",
                    help="work directory; the checkpoint in DIR/ckpt is reused by later runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=4096, help="size of each square Linear (default 4096)")
    ap.add_argument("--reshard-world", type=int, default=3, help="also load at this many ranks (0: skip)")
    ap.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--tessera", type=Path, default=REPO / "target" / "release" / "tessera", help="the CLI binary")
    ap.add_argument("--remove-checkpoint", action="store_true", help="delete DIR/ckpt at the end")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if not args.tessera.is_file():
        ap.error(f"{args.tessera} not found: cargo build --release -p tessera-cli")
    if not Path(TIME).is_file():
        ap.error(f"{TIME} (GNU time) not found: it measures the CLI's peak RSS (apt-get install time)")

    started = time.perf_counter()
    work = args.dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt"
    layers = layers_for(args.size, args.hidden)
    try:
        info = generate(work, layers, args.hidden)
        model_files, optim_files = dir_files(ckpt / "model"), dir_files(ckpt / "optim")
        sizes = {"dir": str(ckpt), "layers": layers, "hidden": args.hidden,
                 "model_tensor_bytes": model_tensor_bytes(layers, args.hidden),
                 "model_file_bytes": files_bytes(model_files), "optim_file_bytes": files_bytes(optim_files)}
        print(f"warm-up: reading {(sizes['model_file_bytes'] + sizes['optim_file_bytes']) / GiB:.2f} GiB once "
              f"({run_cat(model_files + optim_files):.1f} s)", flush=True)
        unshard = bench_unshard(ckpt, work, args.tessera, args.rounds)
        loads = [bench_load(ckpt, work, layers, args.hidden, WORLD, args.rounds)]
        if args.reshard_world and args.reshard_world != WORLD:
            loads.append(bench_load(ckpt, work, layers, args.hidden, args.reshard_world, args.rounds))
        cat_ranks = bench_parallel_cat(ckpt, args.rounds)
        summary = summarise(info, unshard, loads, cat_ranks, sizes, args.rounds)
        summary["wall_seconds"] = time.perf_counter() - started
        print_report(summary)
        print(f"\nwhole run: {summary['wall_seconds']:.0f} s")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(summary, indent=2) + "\n")
            print(f"wrote {args.json}")
    finally:
        for leftover in ("out.safetensors", "write-ref.bin", f"load-w{WORLD}.json", f"load-w{args.reshard_world}.json"):
            (work / leftover).unlink(missing_ok=True)
        if args.remove_checkpoint:
            shutil.rmtree(ckpt, ignore_errors=True)
            (work / "generated.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
