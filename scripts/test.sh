#!/usr/bin/env bash
# Runs every test of the project: the Rust workspace (unit, integration, CLI tests).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
cargo test --workspace --all-targets
