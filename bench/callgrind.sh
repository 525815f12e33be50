#!/usr/bin/env bash
# Instructions per operation of each hot path, counted by callgrind: stable across runs on a
# noisy machine (unlike time), so a change's cost shows as a number you can diff.
#
#   bench/callgrind.sh            # every path; N=2000 iterations (and N/2 to cancel setup)
#   PATHS="inspect_64k meter_64k" bench/callgrind.sh   # only these
#
# Each path runs N/2 and N times; (Ir(N) − Ir(N/2)) / (N/2) is the cost of one operation with
# the fixture's setup (config load, limiter priming) subtracted.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-2000}
command -v valgrind >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null; }
cargo build --release -q -p sluice --features bench --example hotpath
BIN=${CARGO_TARGET_DIR:-target}/release/examples/hotpath
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
ir() { # path iterations -> total instructions
  valgrind --tool=callgrind --callgrind-out-file="$TMP/cg.out" "$BIN" "$1" "$2" 2>"$TMP/vg.log" >/dev/null
  grep -E '^(summary|totals):' "$TMP/cg.out" | head -1 | awk '{print $2}'
}
echo "| hot path | instructions / operation |"
echo "| --- | --- |"
for path in ${PATHS:-inspect inspect_64k meter_64k meter_answer encode_record sse estimate admit route pipeline request_head response_head}; do
  a=$(ir "$path" $((N / 2)))
  b=$(ir "$path" "$N")
  echo "| $path | $(( (b - a) / (N / 2) )) |"
done
