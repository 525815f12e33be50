#!/usr/bin/env bash
# Tail latency of small requests under mixed load (issue #15, item 6): does a 64 KB prompt, or
# a burst of new connections, on the same worker stall the small requests beside it?
#
#   bench/mixed.sh                     # Sluice and nginx, ROUNDS=3, ~4 min
#   PROXIES=sluice ROUNDS=1 bench/mixed.sh
#
# Layout (the latency rig's): the proxy alone on core 0 with one worker; mock-llm, the load
# generators and the connection prober on core 1. In every run, small 1 KB chat POSTs go open
# loop at SMALL_RATE req/s over 32 connections (sluice-load, io_uring engine; latency from each
# request's intended send time), DURATION s after 1 s of warm-up. Beside them, one of:
#   alone  nothing (the baseline);
#   large  64 KB chat POSTs, open loop at LARGE_RATE req/s over 4 connections (mock-llm echoes
#          them: 64 KB each way);
#   churn  bursts of CHURN_CONNS new connections, one burst every second: each connection sends
#          one GET /v1/models, reads the answer and closes (sluice-probe idle, no hold).
# Reports p50 / p99 / p99.9 / max of the small requests per proxy and mode (median over rounds),
# and each mode's p99.9 against the same proxy's `alone` (the stall it added). Rounds
# interleave proxies and modes.
set -euo pipefail
cd "$(dirname "$0")/.."
PROXIES=${PROXIES:-"sluice nginx"}
MODES=${MODES:-"alone large churn"}
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-8}
SMALL_RATE=${SMALL_RATE:-3000}
LARGE_RATE=${LARGE_RATE:-200}
CHURN_CONNS=${CHURN_CONNS:-500}
. bench/lib.sh
release_rig nginx

start_mock
declare -A PID PORT
for proxy in $PROXIES; do start_pinned_proxy "$proxy" 0; done

echo "machine: $(nproc) CPU(s), $(uname -r), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); commit $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty')"
echo "small: $SMALL_RATE req/s over 32 connections, ${DURATION}s; large: 64 KB at $LARGE_RATE req/s; churn: $CHURN_CONNS new connections a second; $ROUNDS round(s)"
: >"$TMP/runs.txt"
for round in $(seq "$ROUNDS"); do
  for mode in $MODES; do
    for proxy in $PROXIES; do
      url="http://127.0.0.1:${PORT[$proxy]}/v1/chat/completions"
      side=""
      case $mode in
        large)
          taskset -c 1 "$BIN/sluice-load" --url "$url" --connections 4 --rate "$LARGE_RATE" \
            --body-bytes 65536 --duration "$((DURATION + 2))s" --json "$TMP/side.json" >/dev/null 2>&1 &
          side=$!
          ;;
        churn)
          (
            end=$((SECONDS + DURATION + 2))
            while [ "$SECONDS" -lt "$end" ]; do
              taskset -c 1 "$BIN/sluice-probe" idle --addr "127.0.0.1:${PORT[$proxy]}" \
                --conns "$CHURN_CONNS" --hold-secs 0 >/dev/null 2>&1 || true
              sleep 1
            done
          ) &
          side=$!
          ;;
      esac
      out="$TMP/$proxy-$mode-$round.json"
      taskset -c 1 "$BIN/sluice-load" --url "$url" --connections 32 --rate "$SMALL_RATE" \
        --body-bytes 1024 --duration "${DURATION}s" --warmup 1s --json "$out" >/dev/null 2>"$TMP/load.err" ||
        { cat "$TMP/load.err" >&2; exit 1; }
      [ -z "$side" ] || wait "$side" || true
      python3 - "$out" "$round" "$proxy" "$mode" >>"$TMP/runs.txt" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
l = r["latency"]
print(sys.argv[2], sys.argv[3], sys.argv[4], l["p50_ms"], l["p99_ms"], l["p999_ms"], l["max_ms"],
      r["errors_total"], r["send_lag"]["p999_ms"] if isinstance(r.get("send_lag"), dict) else -1)
PY
      tail -1 "$TMP/runs.txt"
    done
  done
done
python3 - "$TMP/runs.txt" <<'PY'
import statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    rnd, proxy, mode, p50, p99, p999, mx, errors, lag = line.split()
    runs[(proxy, mode)].append((float(p50), float(p99), float(p999), float(mx), int(errors), float(lag)))
med = lambda i, xs: statistics.median(x[i] for x in xs)
print()
print("| proxy | beside the small requests | p50 ms | p99 ms | p99.9 ms | max ms | p99.9 vs alone | client send lag p99.9 ms | errors |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for (proxy, mode), xs in sorted(runs.items()):
    alone = runs.get((proxy, "alone"))
    vs = f"{med(2, xs) / med(2, alone):.2f}×" if alone else "–"
    print(f"| {proxy} | {mode} | {med(0, xs):.3f} | {med(1, xs):.3f} | {med(2, xs):.3f} | {med(3, xs):.3f} "
          f"| {vs} | {med(5, xs):.3f} | {sum(x[4] for x in xs)} |")
PY
