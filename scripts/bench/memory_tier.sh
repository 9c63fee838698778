#!/usr/bin/env bash
# The memory tier's figures (BENCHMARKS.md, "Memory tier"): tessera-bench --memory-tier, 8
# in-process ranks on 4 simulated nodes with RS(2, 2), 1 GiB of state, 3 rounds, the restore
# also against a load from S3 on loopback (moto, started by the test kit from .venv); then the
# memory held with RS(8, 2) on 16 nodes; then one rank per core (2 ranks on 2 nodes, RS(1, 1)),
# where simulated ranks do not outnumber the cores. Memory roots on /dev/shm, the persistent tier under
# DIR (default target/bench-memtier, on disk). Output: target/memory_tier.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="${1:-target/bench-memtier}"
mkdir -p "$dir"
bash scripts/env/python_env.sh >/dev/null
export PATH="$PWD/.venv/bin:$PATH"
cargo build --release -p tessera-bench
bin=target/release/tessera-bench
{
  echo "== RS(2, 2) on 4 nodes, 8 ranks, 1 GiB, 3 rounds, with S3 (moto) on loopback"
  "$bin" --memory-tier --dir "$dir" --size 1GiB --rounds 3 --emulators
  echo "== RS(8, 2) on 16 nodes, 16 ranks, 512 MiB, 3 rounds"
  "$bin" --memory-tier --dir "$dir" --ranks 16 --nodes 16 --redundancy 8,2 --size 512MiB --rounds 3
  echo "== RS(1, 1) on 2 nodes, 2 ranks (one per core), 1 GiB, 3 rounds"
  "$bin" --memory-tier --dir "$dir" --ranks 2 --nodes 2 --redundancy 1,1 --size 1GiB --rounds 3
} 2>&1 | tee target/memory_tier.txt
rm -rf "$dir"
