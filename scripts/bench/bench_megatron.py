#!/usr/bin/env python
"""tessera.dist_checkpointing vs Megatron-Core's own torch_dist: Megatron-style save and resharded load.

Issue 16, point 5: a drop-in for ``megatron.core.dist_checkpointing`` must not be slower than
the backend it replaces. One run, one state, both libraries imported in the same process
(``megatron.core.dist_checkpointing`` is Megatron-Core's module, ``tessera.dist_checkpointing``
tessera's; needs a venv holding megatron-core 0.16.1, torch and tessera).

The state: a GPT-like set of weights of about ``--size`` bytes, bf16 model weights plus their
f32 "main" copies (6 bytes per parameter), tensor-parallel TP=2 over 2 gloo ranks as Megatron
ShardedTensors: embedding, QKV and MLP fc1 split on dim 0 (column parallel), attention
projection and fc2 split on dim 1 (row parallel), layer norms replicated over TP
(``replica_id`` says which copy is the main one); two ShardedObjects per rank (an RNG-state-like
dict with a small tensor, a data-loader position) and common state (iteration, args, optimizer
param groups). Every method saves the SAME sharded state dict:

  (a) tessera native: ``tessera.dist_checkpointing.save`` (default backend);
  (b) tessera writing torch_dist: the same call with ``sharded_strategy=('torch_dist', 1)``
      (the core plans, megatron's writer workers write each file, the core commits);
  (c) megatron-core: ``megatron.core.dist_checkpointing.save(..., sharded_strategy=('torch_dist',
      1))`` (its default ``TorchDistSaveShardedStrategy``: 2 writer processes per rank, fsync).

and then loads it resharded, on both ranks, into ``--load-layout``: ``tp1`` (default; TP=1 x
DP=2: every rank loads every tensor whole, the main replica being DP rank 0's) or ``swap``
(TP=2 with the split dims exchanged: dim-0 tensors load split on dim 1 and vice versa). Loads:

  (a) tessera loading (a); (b) tessera loading (b);
  (c) megatron-core's ``load`` of (c);
  (c') tessera loading (c), megatron-core's torch_dist checkpoint (the drop-in's read path);
  (d) interop, not timed: megatron-core loading (b), reported ok / failed / n/a.

References, measured in the same rounds: "dd write", each rank writing as many bytes as it saves
to one file in 16 MiB blocks, then fsync (file and directory); "dd read", the same files read
back sequentially, each rank reading as many bytes as its load (tp1: all files; swap: its own);
"memcpy", each rank copying its save share (save) or its load share (load) between tensors.

Timing: rank 0's wall time from a barrier before to a barrier after the call (the slowest rank).
Cold loads drop the page cache of the checkpoint's files first (``os.sync()``, then
``posix_fadvise(DONTNEED)`` on every file); warm loads read every file once first. Every method
runs ``--rounds`` times, methods interleaved and rotated each round, medians reported. Every
load (tensors, objects, common state) is checked against the truth on every rank; a wrong
load stops the benchmark. Ratios: "speed vs (c)" = time of (c) / time of the method (> 1:
faster than megatron-core); "x dd" = time of the method / time of the reference.

Megatron-Core 0.16.1's torch_dist save assumes CUDA: its writer stages tensors with
``tensor.to('cpu', non_blocking=True)`` then calls ``torch.cuda.synchronize()``, and its finalize
broadcasts a failure flag held in ``torch.tensor(..., device=torch.cuda.current_device())``; both
raise "Found no NVIDIA driver" on a CPU-only host. When ``torch.cuda.is_available()`` is false
this script makes ``torch.cuda.synchronize`` a no-op (nothing to synchronize) and
``torch.cuda.current_device()`` return "cpu" (the 1-element flag then goes through gloo), in
the spawned ranks only, and says so in the report.

Usage: <venv with megatron-core + tessera>/bin/python scripts/bench/bench_megatron.py
       [--size 512MiB] [--rounds 5] [--hidden 1024] [--load-layout tp1|swap]
       [--dir DIR] [--keep] [--json PATH|-]
The venv's tessera must be this checkout's (the ranks start through ``tessera._launch``): a wheel
built from it, as scripts/ci/megatron_suite.sh installs into .venv-megatron, or ``PYTHONPATH=python``
(the checkout's package and its built extension) ahead of an older installed copy.
The default run takes about 1.5 min on 2 cores. A bigger one (about 4 GiB of free disk and 8 GiB of
memory): --size 1GiB --hidden 2048 --rounds 5
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
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from bench_files import drop_cache, files_under, fsync_path
from tessera._launch import run_ranks

WORLD = 2
BLOCK = 16 << 20
SAVES = ["native", "tessera_td", "mcore_td", "dd", "memcpy"]
LOADS = ["native", "tessera_td", "tessera_of_mcore", "mcore_td", "dd", "memcpy"]
SAVE_LABELS = {
    "native": "(a) tessera native",
    "tessera_td": "(b) tessera writing torch_dist",
    "mcore_td": "(c) megatron-core torch_dist",
    "dd": "reference: dd-like write + fsync",
    "memcpy": "reference: memcpy of each rank's share",
}
LOAD_LABELS = {
    "native": "(a) tessera, native checkpoint",
    "tessera_td": "(b) tessera, its torch_dist checkpoint",
    "tessera_of_mcore": "(c') tessera, megatron's torch_dist checkpoint",
    "mcore_td": "(c) megatron-core, its torch_dist checkpoint",
    "dd": "reference: dd-like sequential read",
    "memcpy": "reference: memcpy of each rank's share",
}
CKPT_OF_LOAD = {"native": "native", "tessera_td": "tessera_td", "tessera_of_mcore": "mcore_td", "mcore_td": "mcore_td",
                "dd": "dd", "memcpy": None}

Spec = List[Tuple[str, Tuple[int, ...], torch.dtype, Optional[int]]]


# ---------------------------------------------------------------------------------------------
# The state


def parse_size(text: str) -> int:
    """'256MiB', '1GiB', '300MB', '1048576' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    base = 1024 if m.group(3) or not m.group(2) else 1000
    power = " KMGT".index((m.group(2) or " ").upper())
    return int(float(m.group(1)) * base**power)


def make_spec(size: int, hidden: int) -> Spec:
    """(key, global shape, dtype, TP split dim or None) of every tensor: per weight a bf16 model
    copy and an f32 main copy; layers added until ``size`` is reached."""
    h = hidden
    vocab = 8 * h  # Megatron pads the vocabulary to a multiple of TP
    weights: List[Tuple[str, Tuple[int, ...], Optional[int]]] = [("embedding.word_embeddings.weight", (vocab, h), 0)]
    per_layer = (12 * h * h + 2 * h) * 6
    layers = max(1, round((size - vocab * h * 6) / per_layer))
    for i in range(layers):
        p = f"decoder.layers.{i}"
        weights += [
            (f"{p}.input_layernorm.weight", (h,), None),  # replicated over TP
            (f"{p}.self_attention.linear_qkv.weight", (3 * h, h), 0),  # column parallel
            (f"{p}.self_attention.linear_proj.weight", (h, h), 1),  # row parallel
            (f"{p}.pre_mlp_layernorm.weight", (h,), None),
            (f"{p}.mlp.linear_fc1.weight", (4 * h, h), 0),
            (f"{p}.mlp.linear_fc2.weight", (h, 4 * h), 1),
        ]
    spec: Spec = []
    for name, shape, dim in weights:
        spec.append((f"model.{name}", shape, torch.bfloat16, dim))
        spec.append((f"optimizer.main.{name}", shape, torch.float32, dim))
    return spec


def nbytes(spec: Spec) -> int:
    """Total bytes of the state's tensors."""
    total = 0
    for _, shape, dtype, _ in spec:
        n = 1
        for s in shape:
            n *= s
        total += n * torch.empty((), dtype=dtype).element_size()
    return total


def full_tensor(index: int, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The deterministic full value of tensor ``index`` (same on every process)."""
    g = torch.Generator().manual_seed(1000 + index // 2)  # bf16 weight = rounded f32 main
    return torch.randn(shape, generator=g).to(dtype)


def split(t: torch.Tensor, dim: Optional[int], rank: int) -> torch.Tensor:
    """Rank ``rank``'s TP=2 piece of ``t`` along ``dim`` (the whole tensor when ``dim`` is None)."""
    return t if dim is None else t.chunk(WORLD, dim=dim)[rank].contiguous()


def load_dim(dim: Optional[int], layout: str) -> Optional[int]:
    """The split dim of a tensor in the load layout."""
    if layout == "tp1" or dim is None:
        return None
    return 1 - dim


def objects_of(rank: int) -> Dict[str, Any]:
    """This rank's ShardedObject payloads (plain data and a small tensor, as Megatron's RNG state)."""
    return {
        "rng_state": {"random_rng_state": [3, rank, 17], "torch_rng_state": torch.arange(16, dtype=torch.uint8) + rank,
                      "seed": 1234 + rank},
        "dataloader_state": {"consumed_samples": 1_000_000 + rank, "epoch": 2},
    }


def common_state(spec: Spec, hidden: int) -> Dict[str, Any]:
    """Common (non-sharded) state, identical on every rank."""
    return {
        "iteration": 1000,
        "checkpoint_version": 3.0,
        "num_floating_point_operations_so_far": 123456789,
        "args": {"hidden_size": hidden, "num_tensors": len(spec), "tensor_model_parallel_size": WORLD},
        "optimizer_param_groups": [{"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
                                   {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.0}],
    }


def put(root: Dict[str, Any], dotted: str, value: Any) -> None:
    """root['model']['decoder.layers.0...'] = value for the key 'model.decoder...' (two levels,
    as Megatron nests model and optimizer state)."""
    head, rest = dotted.split(".", 1)
    root.setdefault(head, {})[rest] = value


def get(root: Dict[str, Any], dotted: str) -> Any:
    head, rest = dotted.split(".", 1)
    return root[head][rest]


def save_state_dict(mod: Any, spec: Spec, shards: Dict[str, torch.Tensor], common: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """The TP=2 sharded state dict of rank ``rank``, built with ``mod``'s ShardedTensor/Object."""
    sd: Dict[str, Any] = {k: v for k, v in common.items()}
    for key, _, _, dim in spec:
        if dim is None:
            st = mod.ShardedTensor.from_rank_offsets(key, shards[key], replica_id=(0, rank, 0))
        else:
            st = mod.ShardedTensor.from_rank_offsets(key, shards[key], (dim, rank, WORLD), replica_id=(0, 0, 0))
        put(sd, key, st)
    for name, data in objects_of(rank).items():
        sd[name] = mod.ShardedObject(name, data, (WORLD,), (rank,), replica_id=0)
    return sd


def load_state_dict(mod: Any, spec: Spec, dests: Dict[str, torch.Tensor], layout: str, rank: int) -> Dict[str, Any]:
    """The sharded state dict that loads into ``dests`` in ``layout`` (tp1: whole tensors, DP
    rank = rank; swap: TP=2 on the other dim)."""
    sd: Dict[str, Any] = {}
    for key, _, _, dim in spec:
        ldim = load_dim(dim, layout)
        if ldim is None:
            replica = (0, 0, rank) if layout == "tp1" else (0, rank, 0)
            st = mod.ShardedTensor.from_rank_offsets(key, dests[key], replica_id=replica)
        else:
            st = mod.ShardedTensor.from_rank_offsets(key, dests[key], (ldim, rank, WORLD), replica_id=(0, 0, 0))
        put(sd, key, st)
    for name in objects_of(rank):
        sd[name] = mod.ShardedObject(name, None, (WORLD,), (rank,), replica_id=0)
    return sd


def same(a: Any, b: Any) -> bool:
    """Deep equality of plain data and tensors (bytes, dtype, shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                                       b.contiguous().view(-1).view(torch.uint8)))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def check(loaded: Dict[str, Any], spec: Spec, truth: Dict[str, torch.Tensor], common: Dict[str, Any], rank: int) -> Optional[str]:
    """None when ``loaded`` holds the truth (tensors, objects, common state), else what differs."""
    for key, _, _, _ in spec:
        try:
            got = get(loaded, key)
        except KeyError:
            return f"{key}: missing"
        if not same(got, truth[key]):
            return f"{key}: differs ({getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))})"
    for name, data in objects_of(rank).items():
        if not same(loaded.get(name), data):
            return f"object {name}: differs ({loaded.get(name)!r:.80})"
    for name, value in common.items():
        if not same(loaded.get(name), value):
            return f"common {name}: differs ({loaded.get(name)!r:.80})"
    return None


# ---------------------------------------------------------------------------------------------
# Files


def read_all(names: List[str]) -> int:
    """Sequential reads of ``names`` (16 MiB at a time, one buffer); bytes read."""
    buf = memoryview(bytearray(BLOCK))
    total = 0
    for name in names:
        with open(name, "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                total += n
    return total


def dd_write(path: str, nbytes_: int) -> None:
    """Writes ``nbytes_`` bytes to ``path`` in 16 MiB blocks, then fsync of the file and its dir."""
    block = memoryview(bytearray(os.urandom(1 << 20)) * (BLOCK >> 20))
    with open(path, "wb", buffering=0) as f:
        left = nbytes_
        while left > 0:
            left -= f.write(block[: min(left, BLOCK)])
        os.fsync(f.fileno())
    fsync_path(os.path.dirname(path))


def du(path: str) -> int:
    return sum(os.path.getsize(n) for n in files_under(path))


# ---------------------------------------------------------------------------------------------
# The ranks


class Rank:
    """One gloo rank's state and its timed operations."""

    def __init__(self, rank: int, opts: Dict[str, Any]) -> None:
        import torch.distributed as dist
        from megatron.core import dist_checkpointing as mdc
        from tessera import dist_checkpointing as tdc

        self.dist, self.mdc, self.tdc = dist, mdc, tdc
        self.rank, self.opts, self.root = rank, opts, opts["dir"]
        self.spec = make_spec(opts["size"], opts["hidden"])
        self.common = common_state(self.spec, opts["hidden"])
        layout = opts["load_layout"]
        self.shards: Dict[str, torch.Tensor] = {}
        self.truth: Dict[str, torch.Tensor] = {}
        for i, (key, shape, dtype, dim) in enumerate(self.spec):
            full = full_tensor(i, shape, dtype)
            self.shards[key] = split(full, dim, rank)
            self.truth[key] = split(full, load_dim(dim, layout), rank)
        self.dests = {k: torch.empty_like(t) for k, t in self.truth.items()}
        self.save_copies = {k: torch.empty_like(t) for k, t in self.shards.items()}
        self.save_bytes = sum(t.numel() * t.element_size() for t in self.shards.values())
        self.load_bytes = sum(t.numel() * t.element_size() for t in self.truth.values())
        self.bytes_per_rank = self.gather((self.save_bytes, self.load_bytes))

    # -- collective helpers

    def gather(self, value: Any) -> List[Any]:
        out: List[Any] = [None] * WORLD
        self.dist.all_gather_object(out, value)
        return out

    def agree_ok(self, what: str, err: Optional[str]) -> None:
        """Raises on every rank when any rank reports an error."""
        errs = [e for e in self.gather(err) if e]
        if errs:
            raise AssertionError(f"{what}: {errs[0]}")

    def timed(self, fn: Callable[[], Any]) -> Tuple[float, Any]:
        self.dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        self.dist.barrier()
        return time.perf_counter() - t0, out

    def fresh_dir(self, path: str) -> None:
        """An empty ``path`` on every rank, synced (rank 0 makes it)."""
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
            os.sync()
        self.dist.barrier()

    # -- saves

    def save(self, method: str, path: str, spec: Optional[Spec] = None) -> None:
        spec = spec or self.spec
        if method == "native":
            self.tdc.save(save_state_dict(self.tdc, spec, self.shards, self.common, self.rank), path)
        elif method == "tessera_td":
            self.tdc.save(save_state_dict(self.tdc, spec, self.shards, self.common, self.rank), path,
                          sharded_strategy=("torch_dist", 1))
        elif method == "mcore_td":
            self.mdc.save(save_state_dict(self.mdc, spec, self.shards, self.common, self.rank), path,
                          sharded_strategy=("torch_dist", 1))
        elif method == "dd":
            dd_write(os.path.join(path, f"rank{self.rank}.bin"), self.save_bytes)
        elif method == "memcpy":
            for k, t in self.shards.items():
                self.save_copies[k].copy_(t)
        else:
            raise ValueError(method)

    def tessera_td_status(self) -> str:
        """'ok' or 'failed: ...' for (b), agreed by all ranks; probes with a small save (also
        the warm-up)."""
        status = "ok"
        path = os.path.join(self.root, "warmup-tessera_td")
        self.fresh_dir(path)
        try:
            self.save("tessera_td", path, self.spec[:4])
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            status = "failed: " + f"{type(e).__name__}: {e}".splitlines()[0][:200]
        statuses = self.gather(status)
        return next((s for s in statuses if s != "ok"), "ok")

    # -- loads

    def load(self, method: str, path: str, spec: Optional[Spec] = None) -> Optional[Dict[str, Any]]:
        spec = spec or self.spec
        layout = self.opts["load_layout"]
        if method in ("native", "tessera_td", "tessera_of_mcore"):
            return self.tdc.load(load_state_dict(self.tdc, spec, self.dests, layout, self.rank), path)
        if method == "mcore_td":
            return self.mdc.load(load_state_dict(self.mdc, spec, self.dests, layout, self.rank), path)
        if method == "dd":
            names = files_under(path) if layout == "tp1" else [os.path.join(path, f"rank{self.rank}.bin")]
            read_all(names)
            return None
        if method == "memcpy":
            for k, t in self.truth.items():
                self.dests[k].copy_(t)
            return None
        raise ValueError(method)

    def prepare_load(self, ckpt: Optional[str], cold: bool) -> None:
        """Untimed: destinations zeroed; the checkpoint's files evicted (cold) or read (warm)."""
        for t in self.dests.values():
            t.zero_()
        if ckpt is not None and self.rank == 0:
            path = os.path.join(self.root, ckpt)
            if cold:
                drop_cache(path)
            else:
                read_all(files_under(path))
        self.dist.barrier()

    def interop_mcore_reads_tessera_td(self) -> str:
        """(d): megatron-core loading tessera's torch_dist checkpoint, checked, untimed."""
        err: Optional[str] = None
        try:
            self.prepare_load(None, cold=False)
            out = self.load("mcore_td", os.path.join(self.root, "tessera_td"))
            err = check(out, self.spec, self.truth, self.common, self.rank)
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            err = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        errs = [e for e in self.gather(err) if e]
        return f"failed: {errs[0]}" if errs else "ok"

    # -- the run

    def run(self) -> Optional[Dict[str, Any]]:
        rounds = self.opts["rounds"]
        td = self.tessera_td_status()
        saves = [m for m in SAVES if m != "tessera_td" or td == "ok"]
        loads = [m for m in LOADS if m != "tessera_td" or td == "ok"]

        # Warm-up: first use of each library (imports, pools), small state, untimed but checked.
        small = self.spec[:4]
        for m in saves:
            if m in ("native", "mcore_td"):
                path = os.path.join(self.root, f"warmup-{m}")
                self.fresh_dir(path)
                self.save(m, path, small)
        for m in loads:
            if m in ("native", "tessera_td", "tessera_of_mcore", "mcore_td"):
                out = self.load(m, os.path.join(self.root, f"warmup-{CKPT_OF_LOAD[m]}"), small)
                self.agree_ok(f"warm-up load {m}", check(out, small, self.truth, self.common, self.rank))
        save_t: Dict[str, List[float]] = {m: [] for m in saves}
        for r in range(rounds):
            for m in saves[r % len(saves):] + saves[: r % len(saves)]:
                path = os.path.join(self.root, m)
                self.fresh_dir(path)
                dt, _ = self.timed(lambda: self.save(m, path))
                save_t[m].append(dt)
        if self.rank == 0:
            for m in ("native", "tessera_td", "mcore_td"):
                shutil.rmtree(os.path.join(self.root, f"warmup-{m}"), ignore_errors=True)

        interop = self.interop_mcore_reads_tessera_td() if td == "ok" else td
        load_t: Dict[str, Dict[str, List[float]]] = {"cold": {m: [] for m in loads}, "warm": {m: [] for m in loads}}
        for r in range(rounds):
            for m in loads[r % len(loads):] + loads[: r % len(loads)]:
                path = os.path.join(self.root, CKPT_OF_LOAD[m] or "")
                for state in ("cold", "warm"):
                    self.prepare_load(CKPT_OF_LOAD[m], cold=state == "cold")
                    dt, out = self.timed(lambda: self.load(m, path))
                    load_t[state][m].append(dt)
                    if out is not None:
                        self.agree_ok(f"load {m} ({state})", check(out, self.spec, self.truth, self.common, self.rank))
                    del out

        disk = {m: du(os.path.join(self.root, m)) for m in saves if m != "memcpy"} if self.rank == 0 else {}
        self.dist.barrier()
        if self.rank != 0:
            return None
        return {"save": save_t, "load": load_t, "tessera_td": td, "interop": interop, "disk": disk,
                "bytes_per_rank": self.bytes_per_rank}


def _rank_main(rank: int, world: int, opts: Dict[str, Any]) -> None:
    warnings.filterwarnings("ignore")  # Megatron's "Transformer Engine and Apex are not installed", etc.
    if not torch.cuda.is_available():  # Megatron-Core's torch_dist save on a CPU-only host: see the docstring
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
    torch.set_num_threads(1)  # as torchrun does (OMP_NUM_THREADS=1) with several ranks per host
    try:
        doc = Rank(rank, opts).run()
        if rank == 0:
            with open(os.path.join(opts["dir"], "results.json"), "w") as f:
                json.dump(doc, f)
    except Exception:
        traceback.print_exc()  # every rank's failure, as it happens: the launcher re-raises only the first
        raise


def run(opts: Dict[str, Any]) -> Dict[str, Any]:
    # The ranks' stdout goes to stderr, stdout being the report's (JSON with --json -): the
    # ranks inherit this process's descriptor 1 when spawned, so gloo's "connected to 1 peer
    # ranks", which torch 2.10 prints while the launcher creates the group, is caught too.
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        run_ranks(WORLD, _rank_main, opts)
    finally:
        os.dup2(stdout, 1)
        os.close(stdout)
    with open(os.path.join(opts["dir"], "results.json")) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# Report


def versions() -> Dict[str, str]:
    from importlib.metadata import version

    out = {}
    for pkg in ("megatron-core", "torch", "tessera"):
        try:
            out[pkg] = version(pkg)
        except Exception:  # noqa: BLE001
            out[pkg] = "?"
    return out


def summarize(opts: Dict[str, Any], spec: Spec, raw: Dict[str, Any]) -> Dict[str, Any]:
    """Medians and ratios (the JSON document)."""
    med = statistics.median
    save = {m: med(v) for m, v in raw["save"].items()}
    load = {s: {m: med(v) for m, v in d.items()} for s, d in raw["load"].items()}
    doc: Dict[str, Any] = {
        "bytes": nbytes(spec), "tensors": len(spec), "objects_per_rank": len(objects_of(0)),
        "ranks": WORLD, "save_layout": "TP=2", "load_layout": opts["load_layout"], "rounds": opts["rounds"],
        "hidden": opts["hidden"], "versions": versions(), "cuda_synchronize_shim": not torch.cuda.is_available(),
        "bytes_per_rank_save_load": raw["bytes_per_rank"],
        "tessera_torch_dist_writer": raw["tessera_td"], "interop_mcore_loads_tessera_torch_dist": raw["interop"],
        "save_s": save, "load_s": load, "samples": {"save": raw["save"], "load": raw["load"]}, "disk_bytes": raw["disk"],
        "speed_vs_mcore": {"save": {}, "load_cold": {}, "load_warm": {}},
        "time_vs_reference": {"save_dd": {}, "save_memcpy": {}, "load_cold_dd": {}, "load_warm_dd": {}, "load_memcpy": {}},
    }
    sv, tr = doc["speed_vs_mcore"], doc["time_vs_reference"]
    for m, t in save.items():
        if m not in ("dd", "memcpy"):
            sv["save"][m] = save["mcore_td"] / t
            tr["save_dd"][m] = t / save["dd"]
            tr["save_memcpy"][m] = t / save["memcpy"]
    for m in load["cold"]:
        if m not in ("dd", "memcpy"):
            sv["load_cold"][m] = load["cold"]["mcore_td"] / load["cold"][m]
            sv["load_warm"][m] = load["warm"]["mcore_td"] / load["warm"][m]
            tr["load_cold_dd"][m] = load["cold"][m] / load["cold"]["dd"]
            tr["load_warm_dd"][m] = load["warm"][m] / load["warm"]["dd"]
            tr["load_memcpy"][m] = load["warm"][m] / load["warm"]["memcpy"]
    return doc


def markdown(doc: Dict[str, Any]) -> str:
    """The human-readable report: two markdown tables and the interop lines."""
    mib = doc["bytes"] / 2**20
    v = doc["versions"]
    layout = "TP=1 x DP=2 (every rank loads whole tensors)" if doc["load_layout"] == "tp1" else \
        "TP=2 with the split dims exchanged"
    lines = [
        f"Megatron-style state: {mib:.0f} MiB in {doc['tensors']} tensors (bf16 weights + f32 main copies, "
        f"hidden {doc['hidden']}), {doc['objects_per_rank']} ShardedObjects per rank, common state; saved TP=2 "
        f"by {doc['ranks']} gloo ranks, loaded {layout}. megatron-core {v['megatron-core']}, torch {v['torch']}, "
        f"tessera {v['tessera']}. Median of {doc['rounds']} rounds, methods interleaved.",
        "",
        "| save | median | speed vs (c) | time / dd write | time / memcpy | on disk |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    sv, tr = doc["speed_vs_mcore"], doc["time_vs_reference"]
    na = doc["tessera_torch_dist_writer"] != "ok"
    for m in SAVES:
        label = SAVE_LABELS[m]
        if m not in doc["save_s"]:
            lines.append(f"| {label} | {doc['tessera_torch_dist_writer']} | | | | |")
            continue
        t = doc["save_s"][m]
        disk = doc["disk_bytes"].get(m)
        disk_s = f"{disk / 2**20:.0f} MiB" if disk is not None else ""
        if m in sv["save"]:
            lines.append(f"| {label} | {t:.2f} s | {sv['save'][m]:.2f}x | {tr['save_dd'][m]:.2f} | "
                         f"{tr['save_memcpy'][m]:.1f} | {disk_s} |")
        else:
            lines.append(f"| {label} | {t:.2f} s | | | | {disk_s} |")
    lines += [
        "",
        "| resharded load | cold | speed vs (c) | time / dd read | warm | speed vs (c) | time / cached read |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in LOADS:
        label = LOAD_LABELS[m]
        if m not in doc["load_s"]["cold"]:
            lines.append(f"| {label} | {doc['tessera_torch_dist_writer']} | | | | | |")
            continue
        c, w = doc["load_s"]["cold"][m], doc["load_s"]["warm"][m]
        if m in sv["load_cold"]:
            lines.append(f"| {label} | {c:.2f} s | {sv['load_cold'][m]:.2f}x | {tr['load_cold_dd'][m]:.2f} | "
                         f"{w:.2f} s | {sv['load_warm'][m]:.2f}x | {tr['load_warm_dd'][m]:.2f} |")
        else:
            lines.append(f"| {label} | {c:.2f} s | | | {w:.2f} s | | |")
    lines.append("")
    a_save, a_cold, a_warm = sv["save"]["native"], sv["load_cold"]["native"], sv["load_warm"]["native"]
    lines.append(f"(a) tessera native vs (c) megatron-core torch_dist: save {a_save:.2f}x, cold load {a_cold:.2f}x, "
                 f"warm load {a_warm:.2f}x (> 1: tessera faster).")
    if not na:
        lines.append(f"(b) tessera torch_dist vs (c): save {sv['save']['tessera_td']:.2f}x, cold load "
                     f"{sv['load_cold']['tessera_td']:.2f}x, warm load {sv['load_warm']['tessera_td']:.2f}x.")
    else:
        lines.append(f"(b) tessera writing torch_dist: {doc['tessera_torch_dist_writer']}.")
    lines.append(f"(c') tessera reading megatron's torch_dist vs megatron-core reading it: cold "
                 f"{sv['load_cold']['tessera_of_mcore']:.2f}x, warm {sv['load_warm']['tessera_of_mcore']:.2f}x.")
    lines.append(f"(d) megatron-core loads tessera's torch_dist checkpoint: {doc['interop_mcore_loads_tessera_torch_dist']}.")
    lines.append("Every load (tensors, ShardedObjects, common state) checked equal to the saved state on every rank: yes.")
    if doc["cuda_synchronize_shim"]:
        lines.append("No CUDA here: for megatron-core's torch_dist save, torch.cuda.synchronize was a no-op and "
                     "torch.cuda.current_device() returned 'cpu' (megatron-core 0.16.1 assumes CUDA there).")
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("512MiB"), help="state size (default 512MiB)")
    ap.add_argument("--rounds", type=int, default=5, help="measurements per method (default 5)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size of the GPT-like weights (default 1024)")
    ap.add_argument("--load-layout", choices=("tp1", "swap"), default="tp1",
                    help="tp1: whole tensors on every rank (default); swap: TP=2 on the other dim")
    ap.add_argument("--dir", help="scratch directory (default: a new temporary one, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': stdout, no table)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    root = args.dir or tempfile.mkdtemp(prefix="tessera-bench-mcore.")
    os.makedirs(root, exist_ok=True)
    opts = {"size": args.size, "hidden": args.hidden, "rounds": args.rounds, "dir": root,
            "load_layout": args.load_layout}
    spec = make_spec(args.size, args.hidden)
    try:
        doc = summarize(opts, spec, run(opts))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.json == "-":
        print(json.dumps(doc, indent=2))
    else:
        print(markdown(doc))
        if args.json:
            with open(args.json, "w") as f:
                f.write(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
