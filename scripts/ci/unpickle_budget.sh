#!/usr/bin/env bash
# Which memory budget (UnpickleLimits::output_per_input_byte, the default is 32) real DCP
# metadata needs: writes the .metadata pickle of 256 ranks x 300 tensors (76,800 chunks) with
# torch's own classes (.venv) and unpickles it under ratios 8..48. See SECURITY.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="$PWD/target/dcp_metadata_256x300.pkl"
mkdir -p target
.venv/bin/python scripts/fixtures/make_dcp_metadata.py 256 300 "$out"
TESSERA_BUDGET_PICKLE="$out" cargo test --release -p tessera --test integration \
    hostile_memory::unpickler_budget_of_real_metadata -- --ignored --nocapture 2>&1 | grep -E '^ratio|test result'
