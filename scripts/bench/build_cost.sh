#!/usr/bin/env bash
# What speaking GCS and Azure costs the `tessera` binary: a clean release build of
# tessera-cli with its default features (S3, GCS, Azure) and one with --no-default-features
# (S3 only), each in a fresh target directory, one after the other; prints the wall time, the
# crates compiled and the stripped binary's size of each, and their ratios. Takes two full
# release builds (about 10 minutes with 2 jobs).
set -euo pipefail
cd "$(dirname "$0")/../.."
jobs="${CARGO_BUILD_JOBS:-2}"
root="$(mktemp -d "${TMPDIR:-/tmp}/tessera-build-cost.XXXXXX")"
trap 'rm -rf "$root"' EXIT
declare -A secs size crates
for variant in all s3; do
  flags=()
  if [ "$variant" = s3 ]; then flags=(--no-default-features); fi
  crates[$variant]="$(cargo tree -p tessera-cli -e normal --prefix none "${flags[@]}" | sort -u | wc -l)"
  start=$(date +%s.%N)
  CARGO_TARGET_DIR="$root/$variant" cargo build --release -q -j "$jobs" -p tessera-cli "${flags[@]}"
  end=$(date +%s.%N)
  secs[$variant]="$(echo "$end - $start" | bc)"
  size[$variant]="$(stat -c %s "$root/$variant/release/tessera")"
done
printf '| build of tessera-cli (release, -j %s) | wall time | crates | binary |\n|---|---|---|---|\n' "$jobs"
printf '| S3 only (--no-default-features) | %.0f s | %s | %.1f MiB |\n' "${secs[s3]}" "${crates[s3]}" "$(echo "${size[s3]} / 1048576" | bc -l)"
printf '| S3 + GCS + Azure (default) | %.0f s | %s | %.1f MiB |\n' "${secs[all]}" "${crates[all]}" "$(echo "${size[all]} / 1048576" | bc -l)"
printf '| ratio | %.2f× | +%s | %.2f× |\n' "$(echo "${secs[all]} / ${secs[s3]}" | bc -l)" \
  "$(( ${crates[all]} - ${crates[s3]} ))" "$(echo "${size[all]} / ${size[s3]}" | bc -l)"
