#!/usr/bin/env bash
# Crash injection for the benchmark report (issues 4 and 29): a child process saving checkpoints
# is killed with SIGKILL at N random instants (default 500) per writer, in release; every outcome
# is checked (see crates/tessera/tests/crash.rs for the native sync and async saves,
# crates/tessera/tests/crash_writers.rs for the torch_dist and OLMo-core writers). Prints one
# summary line per mode and writes them to target/crash-report.txt.
#
#   scripts/ci/crash_test.sh [INSTANTS]            MODES="sync async torch_dist olmo" (default)
#   TESSERA_CRASH_SEED=N                           another sequence of kill delays
set -euo pipefail
cd "$(dirname "$0")/../.."
instants="${1:-500}"
modes="${MODES:-sync async torch_dist olmo}"
report=target/crash-report.txt
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"

cargo test --release -j"$CARGO_BUILD_JOBS" -p tessera --test integration --no-run
lines=()
for mode in $modes; do
    log="$(mktemp)"
    echo "== crash test: mode $mode, $instants instants"
    case "$mode" in
        sync|async) target=crash test="kill9_during_${mode}_saves_never_loads_half_written" ;;
        *) target=crash_writers test="kill9_during_${mode}_saves_never_loses_or_mixes_a_checkpoint" ;;
    esac
    if ! TESSERA_CRASH_INSTANTS="$instants" cargo test --release -j"$CARGO_BUILD_JOBS" -p tessera --test integration \
        -- --nocapture --exact "$target::$test" >"$log" 2>&1; then
        cat "$log"
        rm -f "$log"
        echo "crash test failed (mode $mode)" >&2
        exit 1
    fi
    line="$(grep '^crash \[' "$log" || true)"
    rm -f "$log"
    [ -n "$line" ] || { echo "no summary line (mode $mode)" >&2; exit 1; }
    echo "$line"
    lines+=("$line")
done
mkdir -p target
{
    echo "# tessera crash test, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    printf '%s\n' "${lines[@]}"
} >"$report"
echo "written to $report"
