#!/usr/bin/env bash
# Round trips between tessera.olmo_core and ai2-olmo-core 0.1.0 itself, both ways
# (scripts/interop/olmo_interop.py): creates .venv-olmo (torch 2.7.1 + ai2-olmo-core 0.1.0, tessera built
# into it) if missing, then runs the round trips on CPU with gloo ranks.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/env/olmo_env.sh
.venv-olmo/bin/python scripts/interop/olmo_interop.py
