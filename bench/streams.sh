#!/usr/bin/env bash
# Many concurrent SSE streams through ONE Sluice worker to ONE backend (issue #15's "10,000
# streams" must-show, as far as this machine allows): STREAMS streams of EVENTS events GAP_MS
# apart, started open loop over RAMP s (so they overlap, staggered, and all are in flight at
# once for most of a stream's life), each on its own client connection.
#
#   bench/streams.sh                                  # 9,900 streams, 64 events 200 ms apart
#   STREAMS=1000 GAP_MS=20 bench/streams.sh
#   SLUICE_BIN=/path/to/other/sluice bench/streams.sh # another build
#
# Sluice (release build, default config, one worker) on core 0; mock-llm and sluice-load on
# core 1. Reports: streams completed and their statuses, errors, content events received
# against those sent, events that arrived coalesced with another in one read (a buffering
# proxy coalesces; the gap between events is GAP_MS, so any coalescing is the proxy's or the
# client's), the inter-event gap p50 / p99, the upstream connections Sluice opened, and
# Sluice's RSS before and at its peak (sampled every 0.5 s) with the KiB per stream, and its CPU.
# DIRECT=1 runs the same load straight at mock-llm: how much of the coalescing and the gap's tail
# the client and mock-llm make on their own.
#
# Why not 10,000 streams 20 ms apart, as the issue asks: this VM's hard open-file limit is
# 20,000 per process and cannot be raised, and each stream holds two sockets in Sluice (client
# and upstream), so 9,900 is the most that fits with Sluice's own descriptors; and 10,000
# streams 20 ms apart are 500,000 events a second for mock-llm, Sluice and the client on this
# machine's 2 vCPUs, which measures the CPU rather than the proxy. GAP_MS=200 keeps it at
# ~50,000 events a second.
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${STREAMS:-9900}
EVENTS=${EVENTS:-64}
GAP_MS=${GAP_MS:-200}
RAMP=${RAMP:-5}
. bench/lib.sh
release_rig
SLUICE_BIN=${SLUICE_BIN:-$BIN/sluice}


start_mock
declare -A PID PORT
start_pinned_proxy sluice 0 # SLUICE_BIN, the default config
SLUICE_PID=${PID[sluice]}
URL="http://127.0.0.1:${PORT[sluice]}/v1/chat/completions"
echo "machine: $(nproc) CPU(s), $(uname -r), open-file limit $(ulimit -n); commit $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty')"
echo "$STREAMS streams of $EVENTS events ${GAP_MS} ms apart, started over ${RAMP}s"

rss_before=$(rss_kib "$SLUICE_PID")
accepted_before=$(mock_stat connections_accepted)
(
  peak=0
  while kill -0 "$SLUICE_PID" 2>/dev/null; do
    r=$(rss_kib "$SLUICE_PID")
    [ "$r" -gt "$peak" ] && peak=$r && echo "$peak" >"$TMP/peak"
    sleep 0.5
  done
) &
PIDS+=($!)
rate=$(python3 -c "print(max(1, round($STREAMS / $RAMP)))")
[ "${DIRECT:-0}" = 1 ] && URL="http://127.0.0.1:$MOCK/v1/chat/completions"
ticks_before=$(proc_ticks "$SLUICE_PID")
started=$EPOCHREALTIME
taskset -c 1 "$BIN/sluice-load" --url "$URL" --connections "$STREAMS" --rate "$rate" \
  --duration "${RAMP}s" --stream --timeout 120s \
  --header "x-mock-tokens: $EVENTS" --header "x-mock-inter-token-ms: $GAP_MS" \
  --json "$TMP/streams.json" >"$TMP/load.txt" 2>&1 || { cat "$TMP/load.txt" >&2; exit 1; }
accepted_after=$(mock_stat connections_accepted)
ticks=$(( $(proc_ticks "$SLUICE_PID") - ticks_before ))
wall=$(python3 -c "print($EPOCHREALTIME - $started)")
python3 - "$TMP/streams.json" "$STREAMS" "$EVENTS" "$rss_before" "$(cat "$TMP/peak")" \
  "$((accepted_after - accepted_before - 1))" "$ticks" "$(getconf CLK_TCK)" "$wall" "${DIRECT:-0}" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
streams, events = int(sys.argv[2]), int(sys.argv[3])
before, peak, upstream = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
cpu_s, wall, direct = int(sys.argv[7]) / int(sys.argv[8]), float(sys.argv[9]), sys.argv[10] == "1"
if direct:
    print("DIRECT=1: the client straight at mock-llm (Sluice idle): what the client and mock-llm alone do")
ok = sum(n for s, n in r["statuses"].items() if s.startswith("2"))
gap = r["event_gap"]
print(f"streams answered 2xx: {ok} of {r['requests']} started; statuses {r['statuses']}; errors {r['errors_total']}")
print(f"content events: {r['content_events']} (expected {streams * events}); coalesced: {r['coalesced_events']}")
print(f"event gap p50 {gap['p50_ms']} ms, p99 {gap['p99_ms']} ms, p99.9 {gap['p999_ms']} ms; max in flight {r['max_in_flight']}")
print(f"upstream connections opened: {upstream}")
print(f"Sluice CPU: {cpu_s:.2f} s over {wall:.1f} s ({100 * cpu_s / wall:.0f}% of its core), "
      f"{cpu_s * 1e6 / max(r['content_events'], 1):.1f} µs per content event")
print(f"Sluice RSS: {before / 1024:.1f} MiB before, {peak / 1024:.1f} MiB peak: {(peak - before) / streams:.1f} KiB per stream")
PY
