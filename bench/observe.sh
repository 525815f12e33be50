#!/usr/bin/env bash
# Cost of observability: Sluice with metering, metrics and the access log on, against a Sluice
# without them, and p99 latency while the access-log disk is slow. Everything pinned to one core.
#
#   BASE_BIN=/path/to/sluice-without-observability bench/observe.sh
#
# BASE_BIN is a Sluice built from a commit before metering was wired in (metering has no off
# switch); without it the baseline is this build with the admin listener and access log off
# (metering still on). Slow disk: every write(2) of the access-log writer thread is delayed by
# SLOW_MS via strace's syscall fault injection; the worker threads are not traced.
set -euo pipefail
cd "$(dirname "$0")/.."

CORE=${CORE:-0}
DURATION=${DURATION:-10}
CONNS=${CONNS:-32}
ROUNDS=${ROUNDS:-5}
SLOW_MS=${SLOW_MS:-1000}

command -v wrk >/dev/null && command -v strace >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk strace >/dev/null
}
cargo build --release -q -p sluice -p sluice-bench
BIN=target/release
BASE_BIN=${BASE_BIN:-$BIN/sluice}
TMP=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$TMP"; }
trap cleanup EXIT
. bench/lib.sh  # the cd above put us at the repository root
start_mock

start_sluice() { # name binary observe(0/1)
  write_sluice_config "$TMP/$1.toml" "$3" "$TMP/log-$1"
  taskset -c "$CORE" "$2" --config "$TMP/$1.toml" >"$TMP/$1.log" 2>&1 &
  PIDS+=($!)
  eval "${1}_PID=$!"
  wait_line "$TMP/$1.log" listening
  eval "${1}_PORT=$(port_of "$TMP/$1.log")"
}
start_sluice base "$BASE_BIN" 0
start_sluice observed "$BIN/sluice" 1

write_post_lua "$TMP/post.lua"
run() { # port -> "rps p99_us"
  taskset -c "$CORE" wrk -t1 -c"$CONNS" -d"${DURATION}s" --latency -s "$TMP/post.lua" "http://127.0.0.1:$1/v1/chat/completions" |
    awk '/Requests\/sec/ {rps=$2} /^ +99%/ {v=$2; u=v; gsub(/[0-9.]/,"",u); gsub(/[a-z]/,"",v); m=(u=="ms")?1000:(u=="s")?1e6:1; p99=v*m} END {print rps, p99}'
}

echo "== throughput and p99: base (${BASE_BIN}) vs observed (metering + metrics + access log), $ROUNDS interleaved rounds, core $CORE"
run "$base_PORT" >/dev/null; run "$observed_PORT" >/dev/null
: >"$TMP/rounds"
for r in $(seq "$ROUNDS"); do
  echo "base $(run "$base_PORT")" | tee -a "$TMP/rounds"
  echo "observed $(run "$observed_PORT")" | tee -a "$TMP/rounds"
done

echo "== p99 while the access-log disk is slow: each write(2) of the log writer thread delayed ${SLOW_MS} ms"
WRITER=$(grep -l '^sluice-log-w0' /proc/"$observed_PID"/task/*/comm | head -1 | cut -d/ -f5)
for r in $(seq "$ROUNDS"); do
  echo "fast-disk $(run "$observed_PORT")" | tee -a "$TMP/rounds"
  strace -qq -p "$WRITER" -e trace=write,pwrite64,fsync -e inject=write:delay_enter=$((SLOW_MS * 1000)) \
    -e inject=fsync:delay_enter=$((SLOW_MS * 1000)) -o /dev/null &
  STRACE=$!
  sleep 0.5
  echo "slow-disk $(run "$observed_PORT")" | tee -a "$TMP/rounds"
  kill "$STRACE" 2>/dev/null || true; wait "$STRACE" 2>/dev/null || true
done
echo "access-log batches dropped while slow (from the log files' record count vs requests) — see sluice logs"

python3 - "$TMP/rounds" <<'PY'
import sys, statistics as st
rows = {}
for line in open(sys.argv[1]):
    name, rps, p99 = line.split()
    rows.setdefault(name, []).append((float(rps), float(p99)))
def med(xs): return st.median(xs)
print()
print("| run | req/s (median) | min–max | p99 µs (median) | min–max |")
print("| --- | --- | --- | --- | --- |")
for name in ("base", "observed", "fast-disk", "slow-disk"):
    r = [a for a, _ in rows[name]]; p = [b for _, b in rows[name]]
    print(f"| {name} | {med(r):,.0f} | {min(r):,.0f}–{max(r):,.0f} | {med(p):,.0f} | {min(p):,.0f}–{max(p):,.0f} |")
ratios = [o[0] / b[0] for o, b in zip(rows["observed"], rows["base"])]
print(f"\nobserved / base req/s: median {med(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
PY
echo "log records written: $("$BIN/sluice" logs "$TMP"/log-observed/*.pb 2>/dev/null | wc -l)"
