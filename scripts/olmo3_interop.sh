#!/usr/bin/env bash
# Checks with ai2-olmo-core 3.0.0 itself that a DCP checkpoint loads into OLMo-core 3.0
# (scripts/olmo3_interop.py): creates .venv-olmo3 (ai2-olmo-core 3.0.0, torch 2.13; no tessera
# needed) if missing, then runs the checks on CPU, some on 2 gloo ranks. Arguments go to the
# script: `CHECKPOINT EXPECTED.pt` (e.g. a `tessera convert --to dcp` copy of
# crates/tessera/tests/fixtures/olmo3/model_and_optim against its expected.pt), or `--fixture`
# (the fixture itself). Prints one PASS/FAIL line per check; exits non-zero if any fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/olmo3-env.sh
.venv-olmo3/bin/python scripts/olmo3_interop.py "$@"
