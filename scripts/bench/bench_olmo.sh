#!/usr/bin/env bash
# tessera vs ai2-olmo-core 0.1.0 on OLMo-core's own checkpoint format (scripts/bench/bench_olmo.py):
# creates or refreshes .venv-olmo (torch 2.7.1 + ai2-olmo-core 0.1.0, tessera built into it),
# builds the release CLI, then runs the benchmark; arguments go to the Python script, e.g.
#   bash scripts/bench/bench_olmo.sh --size 1GiB --rounds 3 --json target/bench-olmo/results.json
# The checkpoint stays in target/bench-olmo/ckpt (or --dir) and is reused by the next run.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/env/olmo_env.sh
CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}" cargo build --release -p tessera-cli
exec .venv-olmo/bin/python scripts/bench/bench_olmo.py "$@"
