#!/usr/bin/env bash
# Runs every test of the project: the Rust workspace (unit, integration, CLI tests), a short
# fuzzing of every parser (scripts/ci/fuzz.sh ci), then the Python package's tests (pytest, real
# torch on CPU, multi-process with gloo), then the MPI example, the round trips with
# ai2-olmo-core 0.1.0 (.venv-olmo), a DCP copy and tessera.olmo_core.v3's saves loaded by
# ai2-olmo-core 3.0.0 and its Trainer on tessera.olmo_core.v3 (.venv-olmo3),
# torchtitan 0.3.0's checkpoint manager against torch DCP (.venv-titan) and,
# where Megatron-LM's tests are (MEGATRON_PEER), three of its suites (.venv-megatron). The object-store tests run against moto_server (an S3 implementation,
# installed into .venv with the Python test requirements), started here on a free loopback
# port and stopped on exit; and against Azurite (Azure Blob, npm; scripts/env/azurite_env.sh) and
# fake-gcs-server (GCS, from .venv), which the tests start themselves, in memory, on loopback.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
bash scripts/env/python_env.sh
bash scripts/env/azurite_env.sh

if [ -z "${TESSERA_TEST_S3_ENDPOINT:-}" ]; then
  port="$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  mkdir -p target
  .venv/bin/moto_server -H 127.0.0.1 -p "$port" >target/moto.log 2>&1 &
  moto_pid=$!
  trap 'kill "$moto_pid" 2>/dev/null || true' EXIT
  for _ in $(seq 1 100); do
    if .venv/bin/python -c "import socket; socket.create_connection(('127.0.0.1', $port), 1)" 2>/dev/null; then
      break
    fi
    sleep 0.2
  done
  export TESSERA_TEST_S3_ENDPOINT="http://127.0.0.1:$port"
  echo "moto_server on $TESSERA_TEST_S3_ENDPOINT"
fi

cargo test --workspace --all-targets
# The examples in the API docs (one per entry point) run too.
cargo test --workspace --doc
# Every parser fuzzed for 10 s each from its seed corpus, under the harness's allocation cap
# (nightly + cargo-fuzz, installed if missing; about 2 min with the build). Long runs:
# FUZZ_KEEP_GOING=1 scripts/ci/fuzz.sh SECS all.
bash scripts/ci/fuzz.sh ci
.venv/bin/python -m pytest tests/python -q
# Types for users: _native.pyi against the built extension, and the package (pyproject's [tool.mypy]).
.venv/bin/python -m mypy.stubtest tessera._native --allowlist tests/stubtest-allowlist.txt
.venv/bin/python -m mypy
# Multi-process Rust over MPI (installs OpenMPI if missing): save under 4 ranks, load under 3 and 1.
bash scripts/ci/mpi_example.sh
# The memory tier across MPI processes: 8 ranks on 4 simulated nodes, nodes lost, ranks killed
# with SIGKILL during a save and a drain, a new world size (about 1 min).
bash scripts/ci/memory_tier_processes.sh
# OLMo-core: round trips with ai2-olmo-core 0.1.0 itself, both ways (its own venv, torch 2.7.1).
bash scripts/interop/olmo_interop.sh
# OLMo-core 3.0 (its own venv, torch 2.13): a checkpoint it wrote, converted by tessera to its
# format and back to a DCP copy, loads into ai2-olmo-core 3.0.0 itself with every value.
bash scripts/interop/olmo3_interop.sh --tessera-copy
# ... and what tessera.olmo_core.v3 (OLMo-core 3.x's API over tessera) saves loads into it too.
bash scripts/interop/olmo3_interop.sh --tessera-v3
# OLMo-core 3.0.0's own Trainer with tessera.olmo_core.v3 as its checkpoint module: saves on 2
# ranks, resumes on 2, 1 and 3, unshards, and cross-loads with OLMo-core's own module (~75 s).
bash scripts/interop/olmo3_trainer.sh --impl tessera
# torchtitan 0.3.0's own CheckpointManager with tessera.torch.dcp as its `dcp`, against the same
# runs on torch DCP: every async_mode, seed checkpoints, FSDP + TP, the HF export (.venv-titan
# over .venv; about 6 min).
bash scripts/interop/torchtitan_interop.sh
# Megatron-LM's own dist_checkpointing tests (test_mapping, test_serialization, test_strict) with
# megatron.core.dist_checkpointing aliased to tessera's, when the peer's tests and harness are
# here: the folder $MEGATRON_PEER names (.ci/run sets it to ../shared/peers/megatron-lm, where
# this project's machines keep them). Its run.sh creates .venv-megatron: torch 2.10 +
# megatron-core 0.16.1, about 7 min the first time. The full suite: scripts/ci/megatron_suite.sh all.
peer="${MEGATRON_PEER:-}"
if [ -n "$peer" ] && [ -f "$peer/run.sh" ]; then
  bash scripts/ci/megatron_suite.sh
else
  echo "SKIPPED: Megatron-LM's own dist_checkpointing suite: its tests and harness are not here" \
    "(MEGATRON_PEER='${peer}'). To run it: MEGATRON_PEER=/path/to/peers/megatron-lm bash scripts/ci/megatron_suite.sh"
fi
