#!/usr/bin/env bash
# Creates .venv-titan: torchtitan 0.3.0 (PyPI) over the project's own .venv (torch 2.15 and
# tessera, which scripts/env/python_env.sh installs): a venv of its own for torchtitan and its
# light dependencies, reading .venv's packages through a .pth file, so that torch is not
# installed twice. torchtitan's data and logging extras (datasets, tensorboard, wandb) are not
# installed: its checkpointing imports none of them. transformers checks the Hugging Face
# export. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/env/python_env.sh
py="${PYTHON:-python3}"
if [ ! -x .venv-titan/bin/python ]; then
  "$py" -m venv .venv-titan
fi
site="$(.venv-titan/bin/python -c 'import site; print(site.getsitepackages()[0])')"
main_site="$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')"
# addsitedir, not a bare path: .venv's own .pth files (tessera's editable install) are read too.
echo "import site; site.addsitedir('$main_site')" > "$site/zz_tessera_main_venv.pth"
.venv-titan/bin/pip install --quiet --disable-pip-version-check --no-deps \
  "torchtitan==0.3.0" "torch_checkpointing==0.1.1" "spmd_types==0.2.3" "tyro==1.0.17" \
  "docstring_parser==0.18.0" "einops==0.8.2" "torchdata==0.11.0"
# transformers, with its dependencies, checks the Hugging Face export (from_pretrained).
.venv-titan/bin/pip install --quiet --disable-pip-version-check "transformers==5.24.0"
.venv-titan/bin/python -c "import torchtitan.components.checkpointer.dcp, tessera.torch.dcp, transformers"
