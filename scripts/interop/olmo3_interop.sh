#!/usr/bin/env bash
# Checks with ai2-olmo-core 3.0.0 itself that a DCP checkpoint loads into OLMo-core 3.0
# (scripts/interop/olmo3_interop.py): creates .venv-olmo3 (ai2-olmo-core 3.0.0, torch 2.13; no tessera
# needed) if missing, then runs the checks on CPU, some on 2 gloo ranks. Arguments go to the
# script: `CHECKPOINT EXPECTED.pt` (e.g. a `tessera convert --to dcp` copy of
# crates/tessera/tests/fixtures/olmo3/model_and_optim against its expected.pt), or `--fixture`
# (the fixture itself), or `--tessera-copy` (the fixture converted by tessera to its format and
# back to DCP: what CI runs), or `--tessera-v3` (the fixture loaded and saved again by
# tessera.olmo_core.v3, OLMo-core 3.x's API over tessera: CI runs it too). Prints one PASS/FAIL line per check; exits non-zero if any fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/env/olmo3_env.sh
if [ "${1:-}" = --tessera-copy ]; then
  # The fixture OLMo-core 3.0 wrote, through tessera (to its own format, then `convert --to dcp`),
  # must load back into OLMo-core 3.0 whole: every tensor and every optimizer value.
  tessera="${TESSERA_CLI:-.venv/bin/tessera}"
  fixture=crates/tessera/tests/fixtures/olmo3
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  "$tessera" convert "$fixture/model_and_optim" "$work/native" >/dev/null
  "$tessera" convert "$work/native" "$work/copy" --to dcp >/dev/null
  .venv-olmo3/bin/python scripts/interop/olmo3_interop.py "$work/copy" "$fixture/expected.pt"
elif [ "${1:-}" = --tessera-v3 ]; then
  # tessera.olmo_core.v3 (OLMo-core 3.x's API over tessera, in .venv) loads the fixture
  # OLMo-core 3.0 wrote into a fresh model and optimizer and saves them again with
  # save_model_and_optim_state; OLMo-core 3.0 itself must load that back whole.
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  .venv/bin/python - "$work/v3" <<'PY'
import sys
from pathlib import Path

sys.path.insert(0, str(Path("tests/python").resolve()))
import tessera.olmo_core.v3 as v3
from test_olmo3 import FIXTURE, _fresh

model, optim = _fresh()
v3.load_model_and_optim_state(str(FIXTURE / "model_and_optim"), model, optim)
v3.save_model_and_optim_state(sys.argv[1], model, optim)
PY
  .venv-olmo3/bin/python scripts/interop/olmo3_interop.py "$work/v3" crates/tessera/tests/fixtures/olmo3/expected.pt
else
  .venv-olmo3/bin/python scripts/interop/olmo3_interop.py "$@"
fi
