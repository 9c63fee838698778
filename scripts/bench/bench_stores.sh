#!/usr/bin/env bash
# The object-store comparison (`tessera-bench --s3`) for every store in one run: S3 on moto,
# Azure on Azurite, GCS on fake-gcs-server, each against a local directory, as ratios (the
# emulators run on this machine, in memory: they show each store's request pattern and the
# client's overhead against local files, not cloud speed). Installs what it needs (.venv with
# moto and fake-gcs-server, Azurite), builds the benchmark, and passes its arguments on
# (default: --size 256MiB --ranks 4 --rounds 3).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/env/python_env.sh
bash scripts/env/azurite_env.sh
cargo build --release -q -p tessera-bench
dir="$(mktemp -d "${TMPDIR:-/tmp}/tessera-bench-stores.XXXXXX")"
trap 'rm -rf "$dir"' EXIT
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  args=(--size 256MiB --ranks 4 --rounds 3)
fi
target/release/tessera-bench --dir "$dir/local" --emulators "${args[@]}"
