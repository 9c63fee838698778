#!/usr/bin/env bash
# Produces the headline figures: the demo, the IO benchmark against raw disk (5 rounds,
# medians), the planning simulation at 10,000 ranks, and the Python package against torch DCP
# and safetensors (2 gloo ranks, 3 rounds, medians). Output goes to target/figures.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

# Release build of the CLI (2 jobs: small machine).
cargo build --release -j2 -p tessera-cli
bin="${CARGO_TARGET_DIR:-target}/release/tessera"
# The Python package (release build) in .venv, for the PyTorch comparison.
bash scripts/python-env.sh
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

{
  run demo --size 1GiB
  run bench --dir "$bench_dir" --size 1GiB --ranks 4 --rounds 5
  run bench --plan-only --ranks 10000 --tensors 1000
  # About 1,000,000 stored chunks: the index-open figure for the 1M-chunk goal.
  run bench --plan-only --ranks 2000 --tensors 1000
  # PyTorch users' view: tessera.torch vs torch.distributed.checkpoint vs safetensors, 512MiB.
  echo "\$ .venv/bin/python scripts/bench_python.py"
  .venv/bin/python scripts/bench_python.py
  echo
  # Distributed-optimizer state: model-space flat ranges vs raw per-rank buckets.
  echo "\$ .venv/bin/python scripts/bench_dist_optimizer.py --reps 5"
  .venv/bin/python scripts/bench_dist_optimizer.py --reps 5
} 2>&1 | tee "$out"
