#!/usr/bin/env bash
# Produces the headline figures: the demo, the IO benchmark against raw disk (5 rounds,
# medians), and the planning simulation at 10,000 ranks. Output goes to target/figures.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

# Release build of the CLI (2 jobs: small machine).
cargo build --release -j2 -p tessera-cli
bin="${CARGO_TARGET_DIR:-target}/release/tessera"
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
} 2>&1 | tee "$out"
