#!/usr/bin/env bash
# Fuzzes tessera's parsers with cargo-fuzz (libFuzzer), starting from the committed seed corpora
# (fuzz/corpus/TARGET, made by scripts/ci/fuzz_seed.sh from the test fixtures).
#
#   scripts/ci/fuzz.sh ci                  every target for ${FUZZ_CI_SECS:-10} s: the CI-sized run
#   scripts/ci/fuzz.sh [SECS] [TARGET]     one target (default unpickle) for SECS (default 600) s
#   scripts/ci/fuzz.sh SECS all            every target for SECS s each, one after the other
#   FUZZ_KEEP_GOING=1 scripts/ci/fuzz.sh … long runs: libFuzzer's fork mode, so a crash, OOM or
#                                          timeout is saved and fuzzing goes on to the end
#
# Targets (fuzz/fuzz_targets/*.rs): index (tessera.index, v1/v2, the ranged v2 open), safetensors
# (data file headers), dcp (DCP .metadata and the DCP/Megatron/OLMo-core readers), unpickle (the
# restricted unpickler), zip (torch.save zip/zip64 archives), zarr (.zarray and the Megatron zarr
# reader), olmo (OLMo-core 0.1.x metadata.json + rank files), tier_manifest (the memory tier's
# commit manifest and the restore decision over it).
#
# The harness caps memory: one allocation over 512 MiB (-malloc_limit_mb) or a process over
# 2 GiB (-rss_limit_mb) fails the run, so a parser that allocates from a claimed length is
# found; an input taking over 10 s is a timeout. The JSON readers (zarr, olmo, safetensors, tier_manifest) get
# the dictionary fuzz/dict/json.dict. Needs a nightly toolchain and cargo-fuzz
# (installed when missing). New corpus entries go to fuzz/target/corpus/TARGET (ignored by
# git), so the seeds stay as committed; failing inputs go to fuzz/artifacts/TARGET and make the
# script fail. Minimise one with `cargo +nightly fuzz tmin TARGET ARTIFACT` and keep it in
# fuzz/regressions/TARGET/, which every run replays first. A summary (target, seconds,
# executions, verdict) is printed and written to fuzz/target/fuzz-summary.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."

all_targets=(index safetensors dcp unpickle zip zarr olmo tier_manifest)
if [ "${1:-}" = ci ]; then
    secs="${FUZZ_CI_SECS:-10}"
    targets=("${all_targets[@]}")
else
    secs="${1:-600}"
    case "${2:-unpickle}" in
        all) targets=("${all_targets[@]}") ;;
        *) targets=("${2:-unpickle}") ;;
    esac
fi

if ! rustup toolchain list | grep -q '^nightly'; then
    rustup toolchain install nightly --profile minimal
fi
if ! command -v cargo-fuzz >/dev/null 2>&1; then
    cargo install cargo-fuzz
fi

build_start=$(date +%s)
if [ "${#targets[@]}" -eq 1 ]; then
    cargo +nightly fuzz build "${targets[0]}"
else
    cargo +nightly fuzz build
fi
echo "fuzz build: $(($(date +%s) - build_start)) s"

summary=fuzz/target/fuzz-summary.txt
: >"$summary"
failed=0
for target in "${targets[@]}"; do
    work=fuzz/target/corpus/$target
    artifacts=fuzz/artifacts/$target
    log=fuzz/target/$target-fuzz.log
    mkdir -p "$work" "$artifacts"
    # Minimised past findings (fuzz/regressions/TARGET) run first, with the seeds.
    corpora=("$work" "fuzz/corpus/$target")
    [ -d "fuzz/regressions/$target" ] && corpora+=("fuzz/regressions/$target")
    marker=$(mktemp)
    # The targets but unpickle read through the load API, which starts IO threads;
    # LeakSanitizer counts glibc's per-thread destructor record (32 bytes,
    # __cxa_thread_atexit_impl) of each as a leak.
    leaks=0
    [ "$target" = unpickle ] && leaks=1
    flags=(-max_total_time="$secs" -timeout=10 -malloc_limit_mb=512 -rss_limit_mb=2048 -detect_leaks="$leaks"
        -artifact_prefix="$artifacts/")
    # JSON readers get a dictionary of keys and edge-of-range numbers (fuzz/dict/json.dict).
    case "$target" in zarr | olmo | safetensors | tier_manifest) flags+=(-dict=fuzz/dict/json.dict) ;; esac
    start=$(date +%s)
    status=0
    if [ -n "${FUZZ_KEEP_GOING:-}" ]; then
        cargo +nightly fuzz run "$target" "${corpora[@]}" -- "${flags[@]}" \
            -fork=1 -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1 >"$log" 2>&1 || status=$?
    else
        cargo +nightly fuzz run "$target" "${corpora[@]}" -- "${flags[@]}" >"$log" 2>&1 || status=$?
    fi
    took=$(($(date +%s) - start))
    # Executions: the last stats line (`#N` in a run, `#K: … exec/s` per job in fork mode,
    # whose total is in its `Done N runs` or the sum shown by `INFO: … total_runs`).
    runs=$(grep -oE '^Done [0-9]+ runs' "$log" | tail -n 1 | grep -oE '[0-9]+' || true)
    [ -n "$runs" ] || runs=$(grep -oE '^#[0-9]+' "$log" | tail -n 1 | tr -d '#' || true)
    # Fork mode counts what its jobs hit: `oom/timeout/crash: a/b/c`.
    hits=$(grep -oE 'oom/timeout/crash: [0-9]+/[0-9]+/[0-9]+' "$log" | tail -n 1 || true)
    found=$(find "$artifacts" -type f -newer "$marker" | sort)
    rm -f "$marker"
    if [ -n "$found" ] || [ "$status" -ne 0 ]; then
        verdict="FAILED (exit $status): $(echo "$found" | tr '\n' ' ')"
        failed=1
    else
        verdict=clean
    fi
    echo "$target: $took s, ${runs:-?} executions${hits:+ ($hits)}, $verdict (log: $log)" | tee -a "$summary"
done
echo "total: $(($(date +%s) - build_start)) s including the build"
exit "$failed"
