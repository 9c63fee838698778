#!/usr/bin/env bash
# Creates .venv-olmo3: ai2-olmo-core 3.0.0, whose checkpoints are torch DCP directories
# (olmo_core.distributed.checkpoint, default unflattened optimizer state). It brings its own
# torch (2.13), so it shares neither .venv (torch 2.15) nor .venv-olmo (0.1.0, torch 2.7.1).
# Used by scripts/fixtures/make_olmo3_fixtures.py and scripts/interop/olmo3_interop.sh; those need no tessera.
# `--with-tessera` also builds tessera's wheel into it (maturin develop), so one process can
# run both. Safe to rerun: pip skips what is installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
py="${PYTHON:-python3}"
if [ ! -x .venv-olmo3/bin/python ]; then
  "$py" -m venv .venv-olmo3
fi
.venv-olmo3/bin/pip install --quiet --disable-pip-version-check \
  "ai2-olmo-core==3.0.0" numpy pytest "maturin>=1.5,<2"
if [ "${1:-}" = "--with-tessera" ]; then
  VIRTUAL_ENV="$PWD/.venv-olmo3" .venv-olmo3/bin/maturin develop --release --quiet
fi
