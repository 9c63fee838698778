#!/usr/bin/env bash
# Runs every test of the project: the Rust workspace (unit, integration, CLI tests), then the
# Python package's tests (pytest, real torch on CPU, multi-process with gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
cargo test --workspace --all-targets
bash scripts/python-env.sh
.venv/bin/python -m pytest tests/python -q
