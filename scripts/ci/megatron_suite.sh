#!/usr/bin/env bash
# Megatron-LM's own dist_checkpointing unit tests (tag core_v0.16.1) against tessera, through the
# plain module alias a user would write (megatron.core.dist_checkpointing[.X] ->
# tessera.dist_checkpointing[.X]: the harness's tessera-strict mode), on CPU with gloo, 8 ranks.
# The harness and the tests are the peer's, in the folder $MEGATRON_PEER names (default
# ../shared/peers/megatron-lm, where this project's machines keep it; a clone of the repository
# alone has no copy); its run.sh creates .venv-megatron (torch 2.10 + megatron-core 0.16.1, about
# 7 GB) on first use. tessera goes in as a wheel built from this checkout with the project's own
# target dir. Without the peer's folder it says so and fails; scripts/ci/test.sh skips it then.
#
# usage: scripts/ci/megatron_suite.sh [SUITE ...]   default: the suites CI runs
#   (test_mapping.py test_serialization.py test_strict.py); "all" runs every suite of run.sh.
# Fails unless every case run passed or was skipped, except those megatron-core itself fails
# here (tests/megatron/peer_failures.tsv) and tessera's known deviations, reported apart
# (tests/megatron/deviations.tsv). Results: target/megatron-tests/tessera-strict/.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
peer=${MEGATRON_PEER:-$root/../shared/peers/megatron-lm}
if [ ! -x "$peer/run.sh" ] && [ ! -f "$peer/run.sh" ]; then
  echo "megatron_suite: Megatron-LM's tests and harness are not at $peer: set MEGATRON_PEER to their folder" >&2
  exit 1
fi
suites=("$@")
[ ${#suites[@]} -eq 0 ] && suites=(test_mapping.py test_serialization.py test_strict.py)
[ "${suites[0]}" = all ] && suites=()

bash scripts/env/python_env.sh >/dev/null 2>&1
rm -rf target/wheels-megatron
.venv/bin/maturin build --release --quiet -o target/wheels-megatron >/dev/null
wheel=$(ls target/wheels-megatron/*.whl | head -1)
out=$root/target/megatron-tests
rm -rf "$out/tessera-strict"
start=$(date +%s)
TESSERA_WHEEL=$wheel OUT=$out bash "$peer/run.sh" tessera-strict "${suites[@]}"
echo "megatron_suite: $(($(date +%s) - start)) s"
"$root/.venv-megatron/bin/python" - "$out/tessera-strict/summary.json" tests/megatron/peer_failures.tsv \
  tests/megatron/deviations.tsv <<'PY'
import json, sys
summary = json.load(open(sys.argv[1]))
def listed(path):
    return {l.split("\t")[0] for l in open(path) if l.strip() and not l.startswith("#")}
allowed, deviations = listed(sys.argv[2]), listed(sys.argv[3])
prefix = "tests/unit_tests/dist_checkpointing/"
counts, bad, known = {}, [], []
for node, r in sorted(summary.items()):
    counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    name = node.removeprefix(prefix)
    if r["outcome"] in ("passed", "skipped") or name in allowed:
        continue
    (known if name in deviations else bad).append(f"  {node}: {r['outcome']}: {r.get('msg', '')[:300]}")
print("megatron_suite (tessera-strict):", ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
if known:
    print(f"{len(known)} known deviation(s) (tests/megatron/deviations.tsv):\n" + "\n".join(known))
if not summary:
    print("no test case ran: see target/megatron-tests/tessera-strict/*/torchrun.out and logs/")
    sys.exit(1)
if bad:
    print(f"{len(bad)} case(s) failed that megatron-core passes:\n" + "\n".join(bad))
    sys.exit(1)
PY
