#!/usr/bin/env bash
# Runs OLMo-core 3.0.0's own Trainer (CPU, gloo, tiny model) and checks its checkpoints round-trip
# through `olmo_core.distributed.checkpoint` as shipped (`--impl olmo`, the default) or through
# tessera's drop-in `tessera.olmo_core.v3` (`--impl tessera`): save on 2 ranks, resume on 2, 1 and
# 3, unshard, and cross-load between the two (see scripts/interop/olmo3_trainer.py). Creates .venv-olmo3 if
# missing. tessera must be importable there for --impl tessera and for the cross checks: installed
# (`bash scripts/env/olmo3_env.sh --with-tessera`), or on PYTHONPATH; this checkout's python/ is added
# when it holds a built extension. Prints one PASS/FAIL line per check; exits 1 if any fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/env/olmo3_env.sh
if ! .venv-olmo3/bin/python -c "import tessera" 2>/dev/null && compgen -G "python/tessera/_native*.so" >/dev/null; then
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
exec .venv-olmo3/bin/python scripts/interop/olmo3_trainer.py "$@"
