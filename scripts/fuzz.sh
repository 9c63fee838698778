#!/usr/bin/env bash
# Fuzzes the restricted unpickler (crates/tessera/src/format/pickle.rs, target
# fuzz/fuzz_targets/unpickle.rs) for ${1:-600} seconds with cargo-fuzz, starting from the
# committed seed corpus, and prints libFuzzer's last statistics line.
#
# Needs a nightly toolchain (`rustup toolchain install nightly`); installs cargo-fuzz when
# missing. New corpus entries go to fuzz/target/corpus/unpickle (ignored by git), so the seeds
# in fuzz/corpus/unpickle stay as committed; crashes, timeouts and OOMs are written to
# fuzz/artifacts/unpickle and make the script fail.
set -euo pipefail
cd "$(dirname "$0")/.."

secs="${1:-600}"
if ! command -v cargo-fuzz >/dev/null 2>&1; then
    cargo install cargo-fuzz
fi

work=fuzz/target/corpus/unpickle
artifacts=fuzz/artifacts/unpickle
mkdir -p "$work" "$artifacts"
# With -jobs=1 libFuzzer runs one worker and writes its output to fuzz-0.log here.
rm -f fuzz-0.log
cargo +nightly fuzz build unpickle
marker=$(mktemp)
start=$(date +%s)
cargo +nightly fuzz run unpickle "$work" fuzz/corpus/unpickle -- \
    -max_total_time="$secs" -jobs=1 -timeout=10 -rss_limit_mb=2048
end=$(date +%s)
log=fuzz/target/unpickle-fuzz.log
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
