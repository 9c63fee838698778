#!/usr/bin/env bash
# torchtitan 0.3.0's own CheckpointManager with tessera as its `dcp`, against the same runs on
# torch DCP (scripts/interop/torchtitan_interop.py says what runs). About 6 min.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/env/torchtitan_env.sh
.venv-titan/bin/python scripts/interop/torchtitan_interop.py
