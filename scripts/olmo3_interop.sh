#!/usr/bin/env bash
# Checks with ai2-olmo-core 3.0.0 itself that a DCP checkpoint loads into OLMo-core 3.0
# (scripts/olmo3_interop.py): creates .venv-olmo3 (ai2-olmo-core 3.0.0, torch 2.13; no tessera
# needed) if missing, then runs the checks on CPU, some on 2 gloo ranks. Arguments go to the
# script: `CHECKPOINT EXPECTED.pt` (e.g. a `tessera convert --to dcp` copy of
# crates/tessera/tests/fixtures/olmo3/model_and_optim against its expected.pt), or `--fixture`
# (the fixture itself), or `--tessera-copy` (the fixture converted by tessera to its format and
# back to DCP: what CI runs). Prints one PASS/FAIL line per check; exits non-zero if any fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/olmo3-env.sh
if [ "${1:-}" = --tessera-copy ]; then
  # The fixture OLMo-core 3.0 wrote, through tessera (to its own format, then `convert --to dcp`),
  # must load back into OLMo-core 3.0 whole: every tensor and every optimizer value.
  tessera="${TESSERA_CLI:-.venv/bin/tessera}"
  fixture=crates/tessera/tests/fixtures/olmo3
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  "$tessera" convert "$fixture/model_and_optim" "$work/native" >/dev/null
  "$tessera" convert "$work/native" "$work/copy" --to dcp >/dev/null
  .venv-olmo3/bin/python scripts/olmo3_interop.py "$work/copy" "$fixture/expected.pt"
else
  .venv-olmo3/bin/python scripts/olmo3_interop.py "$@"
fi
