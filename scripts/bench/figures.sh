#!/usr/bin/env bash
# Produces the headline figures: the demo, the IO benchmark against raw disk (5 rounds,
# medians), the resharded load against a memcpy (tmpfs) and a sequential read (disk), the async save against a memcpy and a sync save (5 rounds), the fully-parallel save's
# bytes per rank (3 rounds), an object store (moto, started by scripts/env/s3_server.sh) against the
# local directory (5 rounds), the planning simulation at 10,000 ranks, and the Python package
# against torch DCP and safetensors (2 gloo ranks, 3 rounds, medians). Output goes to
# target/figures.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."

# Release build of the CLI and of the benchmarks (2 jobs: small machine).
cargo build --release -j2 -p tessera-cli -p tessera-bench
bin="${CARGO_TARGET_DIR:-target}/release/tessera"
bench_bin="${CARGO_TARGET_DIR:-target}/release/tessera-bench"
# The Python package (release build) in .venv, for the PyTorch comparison.
bash scripts/env/python_env.sh
out=target/figures.txt
mkdir -p target

# Scratch space for the benchmark, removed on exit.
bench_dir="$(mktemp -d "${TMPDIR:-/tmp}/tessera-figures.XXXXXX")"
trap 'rm -rf "$bench_dir"' EXIT

# Runs the tessera CLI, echoing the command line first.
run() {
  echo "\$ tessera $*"
  "$bin" "$@"
  echo
}

# Runs the benchmarks' binary, echoing the command line first.
bench() {
  echo "\$ tessera-bench $*"
  "$bench_bin" "$@"
  echo
}

{
  run demo --size 1GiB
  bench --dir "$bench_dir" --size 1GiB --ranks 4 --rounds 5
  # Memory speed (issue 19): 1 GiB of f32 in 16 tensors saved by rows from 2 ranks, loaded by
  # columns in place; warm on tmpfs against a memcpy, a raw write and the floor of reading
  # exactly the needed bytes; cold on disk with the page cache dropped. ~1 min.
  shm_dir="$(mktemp -d /dev/shm/tessera-figures.XXXXXX)"
  bench --reshard --dir "$shm_dir" --size 1GiB --rounds 5
  rm -rf "$shm_dir"
  bench --reshard --cold --dir "$bench_dir" --size 1GiB --rounds 5
  # Async save: blocking time over a memcpy, total over a sync save, peak RSS over the staging
  # budget; 64 MiB per rank (staged in waves) and a budget that holds each rank's share. ~1 min.
  bench --async --dir "$bench_dir" --size 1GiB --ranks 4 --budget 64MiB --rounds 5
  # The same with one rank per core (2 ranks), as a training process per GPU has its own cores.
  bench --async --dir "$bench_dir" --size 1GiB --ranks 2 --budget 1GiB --rounds 5
  # Fully-parallel save: bytes written per rank with and without distribute_replicas, 256 MiB of
  # parameters replicated over DP = 2, 4, 8, then TP=2 × DP=4. ~20 s.
  bench --fully-parallel --dir "$bench_dir" --size 256MiB --dp 2,4,8 --rounds 3
  bench --fully-parallel --dir "$bench_dir" --size 256MiB --tp 2 --dp 4 --rounds 3
  # Object store against the local directory: the same save (TP=4) and resharded load (TP=2) into
  # moto_server (S3 in the memory of one Python process, on this machine's cores; started on a
  # free port with a bucket by scripts/env/s3_server.sh, stopped afterwards) and into the directory;
  # GETs per chunk, bytes downloaded / needed, PUTs and parts. 256 MiB, ~2 min.
  echo "\$ scripts/env/s3_server.sh --bucket tessera-bench -- tessera-bench --dir $bench_dir --s3 s3://tessera-bench/figures --size 256MiB --ranks 4 --rounds 5"
  bash scripts/env/s3_server.sh --bucket tessera-bench -- \
    "$bench_bin" --dir "$bench_dir" --s3 s3://tessera-bench/figures --size 256MiB --ranks 4 --rounds 5
  echo
  bench --plan-only --ranks 10000 --tensors 1000
  # About 1,000,000 stored chunks: the index-open figure for the 1M-chunk goal.
  bench --plan-only --ranks 2000 --tensors 1000
  # PyTorch users' view: tessera.torch vs torch.distributed.checkpoint vs safetensors, 512MiB.
  echo "\$ .venv/bin/python scripts/bench/bench_python.py"
  .venv/bin/python scripts/bench/bench_python.py
  echo
  # The same state through tessera.torch against torch DCP, warm (tmpfs) and cold (disk). ~1 min.
  echo "\$ .venv/bin/python scripts/bench/bench_load_speed.py --rounds 3"
  .venv/bin/python scripts/bench/bench_load_speed.py --rounds 3
  echo
  # Distributed-optimizer state: model-space flat ranges vs raw per-rank buckets.
  echo "\$ .venv/bin/python scripts/bench/bench_dist_optimizer.py --reps 5"
  .venv/bin/python scripts/bench/bench_dist_optimizer.py --reps 5
  echo
  # Unsharding a 1 GiB PyTorch DCP checkpoint (2 ranks): tessera unshard vs torch's
  # dcp_to_torch_save vs a plain copy of the same bytes, alternating, 3 rounds.
  echo "\$ .venv/bin/python scripts/bench/bench_unshard.py --gib 1.0 --rounds 3 --tessera $bin"
  .venv/bin/python scripts/bench/bench_unshard.py --gib 1.0 --rounds 3 --tessera "$bin"
} 2>&1 | tee "$out"
