#!/usr/bin/env bash
# tessera across MPI processes (the README's commands): 4 ranks save, then 3 ranks and 1 rank
# load with another layout (the 3-rank load exchanges byte ranges with MPI_Alltoallv); the
# example checks every byte and exits non-zero on any difference.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/env/mpi_env.sh
# OpenMPI refuses to run as root unless told to (CI containers run as root).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo build --release -p tessera --features mpi --example mpi_checkpoint
dir="$(mktemp -d /tmp/tessera-mpi.XXXXXX)"
trap 'rm -rf "$dir"' EXIT
mpirun -n 4 --oversubscribe target/release/examples/mpi_checkpoint save "$dir/ckpt"
mpirun -n 3 --oversubscribe target/release/examples/mpi_checkpoint load "$dir/ckpt"
mpirun -n 1 target/release/examples/mpi_checkpoint load "$dir/ckpt"
