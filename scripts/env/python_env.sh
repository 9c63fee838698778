#!/usr/bin/env bash
# Creates .venv (if missing) with the test requirements, and builds + installs the tessera
# Python package into it (maturin develop, release mode). Safe to rerun: only rebuilds.
set -euo pipefail
cd "$(dirname "$0")/../.."
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
# pip skips what is already installed; torch is large (~3 GB) the first time.
.venv/bin/pip install --quiet --disable-pip-version-check -r requirements-dev.txt
.venv/bin/maturin develop --release --quiet
