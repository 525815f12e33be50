#!/usr/bin/env bash
# Cost of the AI pipeline's limits: Sluice with API-key auth and three stacked policies on the
# Redis backend, against the plain proxy path (no keys, no policies); then Redis commands per
# second at two request rates (they must not grow with the rate). Everything — wrk, mock-llm,
# Sluice's one worker and redis-server — pinned to one core.
#
#   bench/limits.sh            # ROUNDS=5 DURATION=10 CONNS=32 CORE=0 LOW=1000 HIGH=20000
set -euo pipefail
cd "$(dirname "$0")/.."

CORE=${CORE:-0}
DURATION=${DURATION:-10}
CONNS=${CONNS:-32}
ROUNDS=${ROUNDS:-5}
LOW=${LOW:-1000}
HIGH=${HIGH:-20000}

command -v wrk >/dev/null && command -v redis-server >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk redis-server >/dev/null
}
cargo build --release -q -p sluice -p sluice-bench
BIN=target/release
TMP=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$TMP"; }
trap cleanup EXIT
. bench/lib.sh
start_mock

REDIS_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
taskset -c "$CORE" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >"$TMP/redis.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done

KEY=sk-bench-limits-1
write_sluice_config "$TMP/plain.toml" 0 ""
write_sluice_config "$TMP/limited.toml" 0 ""
printf '[admin]\nlisten = "127.0.0.1:0"\n' >>"$TMP/limited.toml"
append_limits_config "$TMP/limited.toml" "$REDIS_PORT" "$KEY"

start_sluice() { # name
  taskset -c "$CORE" "$BIN/sluice" --config "$TMP/$1.toml" >"$TMP/$1.log" 2>&1 &
  PIDS+=($!)
  wait_line "$TMP/$1.log" listening
  eval "${1}_PORT=$(port_of "$TMP/$1.log")"
}
start_sluice plain
start_sluice limited

write_post_lua "$TMP/post.lua"
echo "wrk.headers[\"x-api-key\"] = \"$KEY\"" >>"$TMP/post.lua"
run() { # port -> "rps p99_us"
  taskset -c "$CORE" wrk -t1 -c"$CONNS" -d"${DURATION}s" --latency -s "$TMP/post.lua" "http://127.0.0.1:$1/v1/chat/completions" |
    awk '/Requests\/sec/ {rps=$2} /Non-2xx/ {bad=$NF} /^ +99%/ {v=$2; u=v; gsub(/[0-9.]/,"",u); gsub(/[a-z]/,"",v); m=(u=="ms")?1000:(u=="s")?1e6:1; p99=v*m} END {if (bad) {print "non-2xx responses: " bad > "/dev/stderr"; exit 1}; print rps, p99}'
}

ADMIN=$(grep -o 'admin listening on [0-9.]*:[0-9]*' "$TMP/limited.log" | sed 's/.*on //')
refusals() { curl -s "http://$ADMIN/metrics" | grep -E '^sluice_(limiter_hits_total|requests_total)' | grep -v ' 0$' | grep -v '2xx' || echo '  none'; }
trap 'echo "limited gateway refusals:"; refusals; cleanup' EXIT
echo "== plain proxy vs auth + 3 stacked policies on Redis, $ROUNDS interleaved rounds, core $CORE"
run "$plain_PORT" >/dev/null; run "$limited_PORT" >/dev/null
: >"$TMP/rounds"
for r in $(seq "$ROUNDS"); do
  echo "plain $(run "$plain_PORT")" | tee -a "$TMP/rounds"
  echo "limited $(run "$limited_PORT")" | tee -a "$TMP/rounds"
done

commands() { redis-cli -p "$REDIS_PORT" info stats | awk -F: '/^total_commands_processed/ {print $2+0}'; }
echo "== Redis commands/s at $LOW and $HIGH req/s (open loop, ${DURATION}s each)"
for rate in "$LOW" "$HIGH"; do
  before=$(commands)
  t0=$(date +%s.%N)
  taskset -c "$CORE" "$BIN/sluice-load" --url "http://127.0.0.1:$limited_PORT/v1/chat/completions" \
    --connections 64 --rate "$rate" --duration "${DURATION}s" --keys "$KEY" --models gpt-4o \
    --json "$TMP/load-$rate.json" >"$TMP/load-$rate.txt"
  t1=$(date +%s.%N)
  after=$(commands)
  python3 - "$rate" "$before" "$after" "$t0" "$t1" "$TMP/load-$rate.json" <<'PY' | tee -a "$TMP/redis"
import json, sys
rate, before, after, t0, t1, path = sys.argv[1:]
j = json.load(open(path))
secs = float(t1) - float(t0)
# Each INFO call is itself a command: subtract ours (2 per measurement).
cmds = (int(after) - int(before) - 1) / secs
print(f"redis {rate} {j.get('rps', j.get('req_per_sec', 0))} {cmds:.1f}")
PY
done

python3 - "$TMP/rounds" "$TMP/redis" <<'PY'
import sys, statistics as st
rows = {}
for line in open(sys.argv[1]):
    name, rps, p99 = line.split()
    rows.setdefault(name, []).append((float(rps), float(p99)))
print()
print("| run | req/s (median) | min–max | p99 µs (median) |")
print("| --- | --- | --- | --- |")
for name in ("plain", "limited"):
    r = [a for a, _ in rows[name]]; p = [b for _, b in rows[name]]
    print(f"| {name} | {st.median(r):,.0f} | {min(r):,.0f}–{max(r):,.0f} | {st.median(p):,.0f} |")
ratios = [l[0] / p[0] for l, p in zip(rows["limited"], rows["plain"])]
print(f"\nlimited / plain req/s: median {st.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
print("\n| target rate | achieved req/s | Redis commands/s |")
print("| --- | --- | --- |")
red = [l.split() for l in open(sys.argv[2])]
for _, rate, got, cmds in red:
    print(f"| {int(rate):,} | {float(got):,.0f} | {float(cmds):,.1f} |")
a, b = float(red[0][3]), float(red[1][3])
print(f"\nRedis commands/s at {red[1][1]} vs {red[0][1]} req/s: ratio {b / a:.2f}")
PY
