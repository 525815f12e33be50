#!/usr/bin/env bash
# A/B of two Sluice builds on the plain path: the same one-worker config (every model to
# mock-llm), wrk, mock-llm and both Sluices pinned to ONE core, rounds interleaved. Reports each
# build's req/s and CPU µs per request (utime+stime of the Sluice process over the round).
#
#   BASE_BIN=/path/to/older/sluice bench/ab.sh
#   ROUNDS=7 DURATION=8 CONNS=32 CORE=0 BASE_BIN=... bench/ab.sh
#
# Used for "no regression of the plain path" checks: BASE_BIN is a release build of the commit
# before a change (e.g. `git worktree add /tmp/base <commit>` and
# `CARGO_TARGET_DIR=/tmp/base-target cargo build --release -p sluice` there).
set -euo pipefail
cd "$(dirname "$0")/.."

CORE=${CORE:-0}
DURATION=${DURATION:-8}
CONNS=${CONNS:-32}
ROUNDS=${ROUNDS:-5}
: "${BASE_BIN:?BASE_BIN must name the baseline sluice binary}"

command -v wrk >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null
}
cargo build --release -q -p sluice -p sluice-bench
BIN=target/release
TMP=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$TMP"; }
trap cleanup EXIT
. bench/lib.sh # the cd above put us at the repository root
start_mock

start_sluice() { # name binary
  write_sluice_config "$TMP/$1.toml" 0 ""
  taskset -c "$CORE" "$2" --config "$TMP/$1.toml" >"$TMP/$1.log" 2>&1 &
  PIDS+=($!)
  eval "${1}_PID=$!"
  wait_line "$TMP/$1.log" listening
  eval "${1}_PORT=$(port_of "$TMP/$1.log")"
}
start_sluice base "$BASE_BIN"
start_sluice this "$BIN/sluice"

write_post_lua "$TMP/post.lua"
TICK=$(getconf CLK_TCK)
run() { # name -> "name rps cpu_us_per_request"
  local port pid before after out rps
  port=$(eval echo "\$${1}_PORT")
  pid=$(eval echo "\$${1}_PID")
  before=$(proc_ticks "$pid")
  out=$(taskset -c "$CORE" wrk -t1 -c"$CONNS" -d"${DURATION}s" -s "$TMP/post.lua" \
    "http://127.0.0.1:$port/v1/chat/completions")
  after=$(proc_ticks "$pid")
  rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
  local requests
  requests=$(awk '/requests in/ {print $1}' <<<"$out")
  echo "$1 $rps $(python3 -c "print(f'{($after - $before) / $TICK * 1e6 / $requests:.2f}')")"
}

echo "== plain path A/B: base ($BASE_BIN) vs this build, $ROUNDS interleaved rounds of ${DURATION}s, $CONNS connections, core $CORE"
run base >/dev/null
run this >/dev/null
: >"$TMP/rounds"
for _ in $(seq "$ROUNDS"); do
  run base | tee -a "$TMP/rounds"
  run this | tee -a "$TMP/rounds"
done

python3 - "$TMP/rounds" <<'PY'
import sys, statistics as st
rows = {}
for line in open(sys.argv[1]):
    name, rps, cpu = line.split()
    rows.setdefault(name, []).append((float(rps), float(cpu)))
print()
print("| build | req/s (median) | min–max | CPU µs / request (median) | min–max |")
print("| --- | --- | --- | --- | --- |")
for name in ("base", "this"):
    r = [a for a, _ in rows[name]]; c = [b for _, b in rows[name]]
    print(f"| {name} | {st.median(r):,.0f} | {min(r):,.0f}–{max(r):,.0f} | {st.median(c):.2f} | {min(c):.2f}–{max(c):.2f} |")
rps = [t[0] / b[0] for t, b in zip(rows["this"], rows["base"])]
cpu = [t[1] / b[1] for t, b in zip(rows["this"], rows["base"])]
print(f"\nthis / base req/s: median {st.median(rps):.3f} (min {min(rps):.3f}, max {max(rps):.3f})")
print(f"this / base CPU per request: median {st.median(cpu):.3f} (min {min(cpu):.3f}, max {max(cpu):.3f})")
PY
