#!/usr/bin/env bash
# Fuzzes one parser with cargo-fuzz for ${1:-600} seconds, starting from its committed seed
# corpus, and prints libFuzzer's last statistics line. Targets (${2:-unpickle}): unpickle, the
# restricted unpickler (crates/tessera/src/format/pickle.rs); olmo, the OLMo-core 0.1.x reader
# (crates/tessera/src/formats/olmo.rs and io/foreign/olmo.rs, through the load API).
#
# Needs a nightly toolchain (`rustup toolchain install nightly`); installs cargo-fuzz when
# missing. New corpus entries go to fuzz/target/corpus/TARGET (ignored by git), so the seeds
# in fuzz/corpus/TARGET stay as committed; crashes, timeouts and OOMs are written to
# fuzz/artifacts/TARGET and make the script fail.
set -euo pipefail
cd "$(dirname "$0")/.."

secs="${1:-600}"
target="${2:-unpickle}"
if ! command -v cargo-fuzz >/dev/null 2>&1; then
    cargo install cargo-fuzz
fi

work=fuzz/target/corpus/$target
artifacts=fuzz/artifacts/$target
mkdir -p "$work" "$artifacts"
# With -jobs=1 libFuzzer runs one worker and writes its output to fuzz-0.log here.
rm -f fuzz-0.log
cargo +nightly fuzz build "$target"
marker=$(mktemp)
start=$(date +%s)
# The olmo target reads through the load API, which starts IO threads; LeakSanitizer counts
# glibc's per-thread destructor record (32 bytes, __cxa_thread_atexit_impl) of each as a leak.
leaks=1
[ "$target" = olmo ] && leaks=0
cargo +nightly fuzz run "$target" "$work" "fuzz/corpus/$target" -- \
    -max_total_time="$secs" -jobs=1 -timeout=10 -rss_limit_mb=2048 -detect_leaks="$leaks"
end=$(date +%s)
log=fuzz/target/$target-fuzz.log
mv fuzz-0.log "$log"

echo "fuzzed for $((end - start)) s (log: $log)"
grep -E '^Done [0-9]+ runs' "$log" | tail -n 1 || true
grep -E '^#[0-9]+' "$log" | tail -n 1
found=$(find "$artifacts" -type f -newer "$marker" | sort)
rm -f "$marker"
if [ -n "$found" ]; then
    echo "failing inputs:" "$found" >&2
    exit 1
fi
