"""Unsharding a PyTorch DCP checkpoint into one file: ``tessera unshard`` vs torch's
``dcp_to_torch_save``, against the time to copy the checkpoint's bytes once.

1. Generation (skipped when ``--dir`` already holds a checkpoint made with the same options):
   two gloo ranks save, with ``torch.distributed.checkpoint.save`` (default ``FileSystemWriter``:
   one file per rank), the DTensor ``Shard(0)`` pieces of a small-transformer-like state of at
   least ``--gib`` GiB: per weight (embedding, per layer QKV, attention output, MLP up and
   down, 2 norms) a bf16 model copy ``model.<name>`` and an f32 main copy
   ``optim.main.<name>``. Keys are flat, so torch's ``.pt`` and tessera's safetensors output
   use the same names.
2. Timing, ``--rounds`` rounds, the three methods alternating (order rotated each round),
   every one a fresh process so that both conversions include process start; the page cache
   is left as it is (the checkpoint was just written or read, so it is warm for every method):
     (a) tessera: ``TESSERA unshard SRC --out OUT.safetensors`` (``--tessera``, default
         ``target/release/tessera``);
     (b) torch:   ``python -c "...dcp_to_torch_save(SRC, OUT.pt)"``;
     (c) copy:    ``cat SRC/* SRC/.metadata > OUT.copy && sync OUT.copy`` (every checkpoint byte
         read once and written once into the output directory, flushed to disk like
         tessera's output; the least work any unshard does).
   Outputs are deleted before each run. After the first round both outputs are compared, all
   tensors (``torch.load`` of the .pt, ``safetensors.torch.load_file`` of the .safetensors).
3. Report: median seconds of each, torch / tessera and tessera / copy, and (informational)
   throughput = checkpoint tensor bytes / time, then one markdown table row.

If the tessera binary is missing or has no ``unshard`` subcommand yet, (a) is skipped (and so
are the ratios that need it): generation, the torch path and the copy reference still run.

Usage: .venv/bin/python scripts/bench/bench_unshard.py [--gib 1.0] [--rounds 3] [--hidden 1024]
       [--dir DIR] [--keep] [--tessera PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from tessera._launch import run_ranks

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
GIB = 1024**3
INFO = "bench_unshard.json"  # generation options and sizes, next to the checkpoint
METHODS = ["tessera", "torch", "copy"]

Spec = List[Tuple[str, Tuple[int, ...], torch.dtype]]


# ---------------------------------------------------------------------------------------------
# The state


def make_spec(target_bytes: int, hidden: int) -> Spec:
    """(key, global shape, dtype) of every tensor; layers are added until ``target_bytes``."""
    h = hidden
    vocab = 8 * h
    weights: List[Tuple[str, Tuple[int, ...]]] = [("embedding.weight", (vocab, h))]
    per_layer_params = 12 * h * h + 2 * h
    layers = max(1, math.ceil((target_bytes - vocab * h * 6) / (per_layer_params * 6)))
    for i in range(layers):
        p = f"layers.{i}"
        weights += [
            (f"{p}.input_norm.weight", (h,)),
            (f"{p}.attn.qkv.weight", (3 * h, h)),
            (f"{p}.attn.proj.weight", (h, h)),
            (f"{p}.mlp_norm.weight", (h,)),
            (f"{p}.mlp.fc1.weight", (4 * h, h)),
            (f"{p}.mlp.fc2.weight", (h, 4 * h)),
        ]
    weights.append(("final_norm.weight", (h,)))
    spec: Spec = []
    for name, shape in weights:
        spec.append((f"model.{name}", shape, torch.bfloat16))
        spec.append((f"optim.main.{name}", shape, torch.float32))
    return spec


def spec_bytes(spec: Spec) -> int:
    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in spec)


def _local_piece(index: int, shape: Tuple[int, ...], dtype: torch.dtype, rank: int) -> torch.Tensor:
    """This rank's Shard(0) piece (torch.chunk sizes, as DTensor lays it out), deterministic."""
    rows = shape[0]
    size = -(-rows // WORLD)
    start = min(rank * size, rows)
    local_rows = max(0, min(rows, start + size) - start)
    g = torch.Generator().manual_seed(10_000 * index + rank)
    return torch.randn((local_rows,) + tuple(shape[1:]), generator=g).to(dtype)


def _gen_rank(rank: int, world: int, ckpt: str, gib: float, hidden: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (WORLD,))
    sd: Dict[str, Any] = {}
    for i, (key, shape, dtype) in enumerate(make_spec(int(gib * GIB), hidden)):
        local = _local_piece(i, shape, dtype, rank)
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        sd[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(ckpt))


def generate(ckpt: Path, gib: float, hidden: int) -> Dict[str, Any]:
    """The checkpoint at ``ckpt`` (reused when made with the same options)."""
    spec = make_spec(int(gib * GIB), hidden)
    info = {"gib": gib, "hidden": hidden, "tensors": len(spec), "tensor_bytes": spec_bytes(spec), "world": WORLD}
    info_path = ckpt.parent / INFO
    if (ckpt / ".metadata").is_file() and info_path.is_file():
        if json.loads(info_path.read_text()) == info:
            print(f"reusing {ckpt} ({info['tensor_bytes'] / GIB:.2f} GiB of tensors)")
            return info
    shutil.rmtree(ckpt, ignore_errors=True)
    info_path.unlink(missing_ok=True)
    print(f"generating {info['tensors']} tensors, {info['tensor_bytes'] / GIB:.2f} GiB, {WORLD} ranks -> {ckpt}")
    t0 = time.perf_counter()
    run_ranks(WORLD, _gen_rank, str(ckpt), gib, hidden)
    print(f"  generated in {time.perf_counter() - t0:.1f} s ({dir_bytes(ckpt) / GIB:.2f} GiB on disk)")
    info_path.write_text(json.dumps(info))
    return info


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


# ---------------------------------------------------------------------------------------------
# The methods


def has_unshard(tessera: Path) -> bool:
    if not tessera.is_file():
        return False
    try:
        out = subprocess.run([str(tessera), "--help"], capture_output=True, text=True, timeout=60)
    except OSError:
        return False
    return any(line.split()[:1] == ["unshard"] for line in out.stdout.splitlines())


TORCH_CONVERT = (
    "import sys, warnings\n"
    "warnings.simplefilter('ignore')\n"
    "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
)


def command(method: str, ckpt: Path, out_dir: Path, tessera: Path) -> List[str]:
    if method == "tessera":
        return [str(tessera), "unshard", str(ckpt), "--out", str(out_dir / "out.safetensors")]
    if method == "torch":
        return [sys.executable, "-c", TORCH_CONVERT, str(ckpt), str(out_dir / "out.pt")]
    if method == "copy":
        return ["sh", "-c", 'cat "$1"/* "$1"/.metadata > "$2" && sync "$2"', "sh", str(ckpt), str(out_dir / "out.copy")]
    raise ValueError(method)


def run_timed(method: str, ckpt: Path, out_dir: Path, tessera: Path) -> float:
    for name in ("out.safetensors", "out.pt", "out.copy"):
        (out_dir / name).unlink(missing_ok=True)
    cmd = command(method, ckpt, out_dir, tessera)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{method} failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.decode()[-4000:]}")
    return elapsed


def _flat(tree: Any, prefix: str = "") -> Dict[str, torch.Tensor]:
    if isinstance(tree, dict):
        out: Dict[str, torch.Tensor] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def compare_outputs(out_dir: Path, expected_keys: List[str]) -> None:
    """Both conversions hold the same tensors (names, dtypes, shapes, bytes)."""
    from safetensors.torch import load_file

    pt = _flat(torch.load(out_dir / "out.pt", weights_only=True, mmap=True))
    st = load_file(str(out_dir / "out.safetensors"))
    if sorted(pt) != sorted(st) or sorted(st) != sorted(expected_keys):
        raise SystemExit(f"outputs hold different keys: torch {len(pt)}, tessera {len(st)}, checkpoint {len(expected_keys)}")
    for key in expected_keys:
        a, b = pt[key], st[key]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            raise SystemExit(f"{key}: torch {a.dtype}{tuple(a.shape)} and tessera {b.dtype}{tuple(b.shape)} differ")
    print(f"  outputs match: {len(st)} tensors")


def check_torch_output(out_dir: Path, expected_keys: List[str]) -> None:
    pt = _flat(torch.load(out_dir / "out.pt", weights_only=True, mmap=True))
    if sorted(pt) != sorted(expected_keys):
        raise SystemExit(f"torch output holds {len(pt)} tensors, the checkpoint {len(expected_keys)}")
    print(f"  torch output holds the {len(pt)} tensors (tessera not run: nothing to compare with)")


# ---------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size, GiB of tensors (at least)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size of the transformer-like state")
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a new one under /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (reused by the next run with the same --dir)")
    ap.add_argument("--tessera", type=Path, default=REPO / "target" / "release" / "tessera")
    args = ap.parse_args(argv)

    work = args.dir or Path(tempfile.mkdtemp(prefix="tessera-bench-unshard-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "dcp"
    out_dir = work / "out"
    out_dir.mkdir(exist_ok=True)
    try:
        info = generate(ckpt, args.gib, args.hidden)
        keys = [k for k, _, _ in make_spec(int(args.gib * GIB), args.hidden)]
        methods = list(METHODS)
        if not has_unshard(args.tessera):
            print(f"NOTE: {args.tessera} is missing or has no `unshard` subcommand: tessera not timed")
            methods.remove("tessera")
        times: Dict[str, List[float]] = {m: [] for m in methods}
        for r in range(args.rounds):
            order = methods[r % len(methods) :] + methods[: r % len(methods)]
            for method in order:
                t = run_timed(method, ckpt, out_dir, args.tessera)
                times[method].append(t)
                print(f"  round {r + 1} {method:8s} {t:7.2f} s")
                if r == 0 and method in ("tessera", "torch"):
                    # Keep the first outputs of both for the comparison.
                    (out_dir / ("out.safetensors" if method == "tessera" else "out.pt")).rename(
                        out_dir / ("first.safetensors" if method == "tessera" else "first.pt")
                    )
            if r == 0:
                for name in ("safetensors", "pt"):
                    first = out_dir / f"first.{name}"
                    if first.exists():
                        first.rename(out_dir / f"out.{name}")
                if "tessera" in methods:
                    compare_outputs(out_dir, keys)
                else:
                    check_torch_output(out_dir, keys)
        report(info, times, args.rounds)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        if args.keep:
            print(f"kept {ckpt}")
        elif args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
        else:  # only what this script made in a given directory
            shutil.rmtree(ckpt, ignore_errors=True)
            (work / INFO).unlink(missing_ok=True)


def report(info: Dict[str, Any], times: Dict[str, List[float]], rounds: int) -> None:
    size = info["tensor_bytes"]
    med = {m: statistics.median(ts) for m, ts in times.items()}

    def cell(x: Optional[float], fmt: str, unit: str = "") -> str:
        return "n/a" if x is None else format(x, fmt) + unit

    tessera, torch_t, read = med.get("tessera"), med.get("torch"), med.get("copy")
    torch_over_tessera = torch_t / tessera if tessera and torch_t else None
    tessera_over_read = tessera / read if tessera and read else None
    print()
    print(f"checkpoint: {size / GIB:.2f} GiB of tensors ({info['tensors']} tensors, {info['world']} ranks, DCP)")
    for m in METHODS:
        if m in med:
            print(f"  {m:8s} median {med[m]:7.2f} s  ({size / GIB / med[m]:5.2f} GiB/s)  all: "
                  + ", ".join(f"{t:.2f}" for t in times[m]))
    print(f"  torch / tessera: {cell(torch_over_tessera, '.2f', 'x')}   tessera / copy: {cell(tessera_over_read, '.2f', 'x')}")
    print()
    print("| checkpoint | rounds | tessera unshard | torch dcp_to_torch_save | copy once | torch / tessera | tessera / copy | tessera GiB/s | torch GiB/s | copy GiB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    gibs = {m: size / GIB / t for m, t in med.items()}
    print(
        f"| {size / GIB:.2f} GiB DCP, {info['world']} ranks | {rounds} | {cell(tessera, '.2f', ' s')} | "
        f"{cell(torch_t, '.2f', ' s')} | {cell(read, '.2f', ' s')} | {cell(torch_over_tessera, '.2f', '×')} | "
        f"{cell(tessera_over_read, '.2f', '×')} | {cell(gibs.get('tessera'), '.2f')} | {cell(gibs.get('torch'), '.2f')} | "
        f"{cell(gibs.get('copy'), '.2f')} |"
    )


if __name__ == "__main__":
    main()
