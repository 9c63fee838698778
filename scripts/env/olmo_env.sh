#!/usr/bin/env bash
# Creates .venv-olmo: ai2-olmo-core 0.1.0, the peer whose checkpoint format tessera.olmo_core
# reads and writes. It needs torch <= 2.7.1, so it cannot share .venv (torch 2.15). Used by
# scripts/fixtures/make_olmo_fixtures.py, scripts/interop/olmo_interop.sh and scripts/bench/bench_olmo.py; tessera's
# wheel is built into it too (maturin develop), so one process can run both. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/../.."
py="${PYTHON:-python3}"
if [ ! -x .venv-olmo/bin/python ]; then
  "$py" -m venv .venv-olmo
fi
.venv-olmo/bin/pip install --quiet --disable-pip-version-check \
  "torch==2.7.1" "ai2-olmo-core==0.1.0" safetensors numpy pytest "maturin>=1.5,<2"
if [ "${1:-}" != "--no-tessera" ]; then
  VIRTUAL_ENV="$PWD/.venv-olmo" .venv-olmo/bin/maturin develop --release --quiet
fi
