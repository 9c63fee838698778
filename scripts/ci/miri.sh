#!/usr/bin/env bash
# Runs, under Miri (Stacked Borrows, the default), the unit tests of the code that held or
# holds `unsafe` in the load path and the data model: TensorData split/join and the checked
# ShardedTensor arithmetic (state::), the read engine cutting load buffers into disjoint
# per-segment slices and refusing overlaps (io::read), loads through it into caller buffers
# (io::load::tests), and the staging pool's volatile pre-faulting (io::staging).
#
# Not run here: tests that reach libc through FFI Miri cannot execute (async save's thread
# priority, local-file storage, MPI) and the integration tests (minutes each under Miri).
#
# Needs nightly with Miri: rustup +nightly component add miri rust-src.
# Default features are off: they only add the object-store client, which these tests do not
# use, and which would cost minutes to build under Miri.
set -euo pipefail
cd "$(dirname "$0")/../.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/miri}"
# Thread scheduling is explored from a fixed seed; pass e.g. -Zmiri-many-seeds=0..8 to widen.
export MIRIFLAGS="${MIRIFLAGS:-}"
cargo +nightly miri test -p tessera --no-default-features --lib -- \
    state:: io::read:: io::load::tests:: io::staging::
