#!/usr/bin/env bash
# Installs what the `mpi` feature needs, if missing: Debian's OpenMPI (library, headers, mpirun)
# and libclang (the mpi crate generates its bindings with bindgen). Uses sudo when not root.
set -euo pipefail
if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 && ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1; then
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends libopenmpi-dev openmpi-bin libclang-dev >/dev/null
