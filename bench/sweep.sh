#!/usr/bin/env bash
# Connection sweep (issue #15, item 3): the proxy's CPU per request at one offered rate, with
# 16, 256 and 4,096 client connections. A proxy whose cost grows with the connection count
# (timers, ring size, scheduling) shows it here; the request rate stays the same, so only the
# number of connections the requests are spread over changes.
#
#   bench/sweep.sh                                    # Sluice and nginx, the working tree's build
#   PROXIES=sluice CONNS_LIST="16 4096" ROUNDS=1 bench/sweep.sh
#
# Layout: the proxy alone on core 0 (one worker); mock-llm and sluice-load (io_uring engine,
# open loop at RATE req/s, 1 KB chat POSTs) on core 1. Each run warms up WARMUP s (the
# connections are opened then), then the proxy's CPU (utime + stime) and mock-llm's served
# requests are read at the start and end of the next DURATION s: CPU µs per request over that
# window only. Rounds interleave the proxies and connection counts.
set -euo pipefail
cd "$(dirname "$0")/.."
PROXIES=${PROXIES:-"sluice nginx"}
CONNS_LIST=${CONNS_LIST:-"16 256 4096"}
RATE=${RATE:-8000}
ROUNDS=${ROUNDS:-3}
WARMUP=${WARMUP:-3}
DURATION=${DURATION:-8}
. bench/lib.sh
release_rig nginx
SLUICE_BIN=${SLUICE_BIN:-$BIN/sluice}


start_mock
declare -A PID PORT
for proxy in $PROXIES; do start_pinned_proxy "$proxy" 0; done

HZ=$(getconf CLK_TCK)
echo "machine: $(nproc) CPU(s), $(uname -r); commit $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty'); rate $RATE req/s, ${WARMUP}s warm-up, ${DURATION}s measured, $ROUNDS round(s)"
echo "round proxy conns cpu_us_per_req served_rps p50_ms p99_ms p999_ms errors"
for round in $(seq "$ROUNDS"); do
  for conns in $CONNS_LIST; do
    for proxy in $PROXIES; do
      out="$TMP/$proxy-$conns-$round.json"
      taskset -c 1 "$BIN/sluice-load" --url "http://127.0.0.1:${PORT[$proxy]}/v1/chat/completions" \
        --connections "$conns" --rate "$RATE" --duration "$((WARMUP + DURATION))s" \
        --warmup "${WARMUP}s" --body-bytes 1024 --json "$out" >/dev/null 2>"$TMP/load.err" &
      load=$!
      sleep "$WARMUP"
      t0=$(proc_ticks "${PID[$proxy]}"); s0=$(mock_stat requests)
      sleep "$DURATION"
      t1=$(proc_ticks "${PID[$proxy]}"); s1=$(mock_stat requests)
      wait "$load" || { cat "$TMP/load.err" >&2; exit 1; }
      python3 - "$out" "$round" "$proxy" "$conns" "$((t1 - t0))" "$HZ" "$((s1 - s0))" "$DURATION" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
rnd, proxy, conns, ticks, hz, served, secs = sys.argv[2:]
served = int(served) - 2  # the two stats requests
cpu_us = int(ticks) / int(hz) * 1e6 / max(served, 1)
lat = r["latency"]
print(f"{rnd} {proxy} {conns} {cpu_us:.1f} {served / float(secs):.0f} "
      f"{lat['p50_ms']:.3f} {lat['p99_ms']:.3f} {lat['p999_ms']:.3f} {r['errors_total']}")
PY
    done
  done
done
