#!/usr/bin/env bash
# The memory tier across real processes, 8 ranks on 4 simulated nodes (a memory root each), over
# MPI (crates/tessera/examples/memory_tier.rs): any 2 nodes' roots deleted → restored bit-exact
# from memory; 3 → from the persistent tier; a job of another world size → from the persistent
# tier, resharded; a rank killed with SIGKILL during a memory save, and during a drain → the
# newest complete step restores. Each restore checks every byte. The same over torch.distributed
# (gloo) is in tests/python/test_memory_tier.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/env/mpi_env.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo build --release -p tessera --features mpi --example memory_tier
bin=target/release/examples/memory_tier
dir="$(mktemp -d /tmp/tessera-memtier.XXXXXX)"
trap 'rm -rf "$dir"' EXIT
run() { mpirun -n "$1" --oversubscribe "$bin" "${@:2}"; }

echo "== train 7 steps (drains at 3 and 6)"
run 8 train "$dir/job" 7
for lost in "0 1" "0 2" "0 3" "1 2" "1 3" "2 3"; do
  rm -rf "$dir/case" && cp -a "$dir/job" "$dir/case"
  for n in $lost; do rm -rf "$dir/case/node$n"; done
  echo "== nodes $lost lost: step 7 from memory"
  run 8 restore "$dir/case" 7 memory
done
rm -rf "$dir/case" && cp -a "$dir/job" "$dir/case"
rm -rf "$dir/case/node0" "$dir/case/node2" "$dir/case/node3"
echo "== 3 nodes lost: step 6 from the persistent tier"
run 8 restore "$dir/case" 6 persistent
rm -rf "$dir/case" && cp -a "$dir/job" "$dir/case"
echo "== 4 ranks: step 6 from the persistent tier, resharded"
run 4 restore "$dir/case" 6 persistent

echo "== rank 5 killed during step 5's memory save: step 4 or 5"
rm -rf "$dir/kill"
if run 8 train "$dir/kill" 5 5 save; then echo "the killed job exited 0"; exit 1; fi
run 8 restore "$dir/kill" 4 memory
echo "== rank 0 killed during step 6's drain (its memory commit done): step 6 from memory"
rm -rf "$dir/kill"
if run 8 train "$dir/kill" 6 0 drain; then echo "the killed job exited 0"; exit 1; fi
ls "$dir/kill/persistent"
cp -a "$dir/kill" "$dir/kill3"
run 8 restore "$dir/kill" 6 memory
echo "== ... and with 3 nodes lost: the persistent tier's newest committed step (3, or 6 if the drain ended)"
rm -rf "$dir/kill3/node1" "$dir/kill3/node2" "$dir/kill3/node3"
run 8 restore "$dir/kill3" 3 persistent
echo "memory tier across processes: every case restored bit-exact"
