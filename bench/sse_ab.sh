#!/usr/bin/env bash
# The kit's SSE load (bench/compare.sh, SSE_CONCS) for a few proxies, many rounds, side by side:
# the time to an event stream's first byte and first event, which at 1,000 streams moves more
# between rounds of one proxy than between proxies (perf/RESULTS.md, "The first token at 1,000
# streams").
#
#   bench/sse_ab.sh                                         # nginx and Sluice, 10 rounds
#   BASE_BIN=/path/to/older/sluice PROXIES="sluice-base sluice" ROUNDS=12 bench/sse_ab.sh
#   STREAMS=700 bench/sse_ab.sh
#
# Each run starts its proxy afresh on core 0 (alone); mock-llm (one for every run) and
# sluice-load on core 1. STREAMS connections each stream one completion after another, 64
# events 20 ms apart, at STREAMS / 1.344 streams a second (the kit's rate: about STREAMS in
# flight, staggered), 5 s after 1.5 s of warm-up. Rounds interleave the proxies. One line a
# run: time to first byte (min, p50, mean, p90, p99), the first event's p50, the event gap's
# p99, and the proxy's CPU over the run in clock ticks (it shows how fast the machine was in
# that round); then each proxy's medians over the rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
PROXIES=${PROXIES:-nginx sluice}
ROUNDS=${ROUNDS:-10}
STREAMS=${STREAMS:-1000}
. bench/lib.sh
release_rig nginx
declare -A PID PORT
start_mock
RATE=$(python3 -c "print(round($STREAMS / 1.344, 1))")
: >"$TMP/runs.txt"

one_run() { # proxy
  start_pinned_proxy "$1" 0
  local pid=${PID[$1]} before after
  before=$(proc_ticks "$pid")
  taskset -c "$CORE" "$BIN/sluice-load" --url "http://127.0.0.1:${PORT[$1]}/v1/chat/completions" \
    --stream --rate "$RATE" --connections "$STREAMS" --duration 5s --warmup 1.5s \
    --body-bytes 1024 --timeout 60s --header "x-mock-tokens: 64" \
    --header "x-mock-inter-token-ms: 20" --json "$TMP/run.json" >/dev/null 2>&1
  after=$(proc_ticks "$pid")
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  python3 - "$1" "$TMP/run.json" $((after - before)) <<'PY' | tee -a "$TMP/runs.txt"
import json, sys
proxy, path, ticks = sys.argv[1], sys.argv[2], int(sys.argv[3])
j = json.load(open(path))
t = j["ttfb"]
print(f"{proxy:<12} ttfb min {t['min_ms']:5.2f} p50 {t['p50_ms']:6.2f} mean {t['mean_ms']:6.2f} "
      f"p90 {t['p90_ms']:6.2f} p99 {t['p99_ms']:6.2f} | first event p50 {j['first_event']['p50_ms']:6.2f} "
      f"| gap p99 {j['event_gap']['p99_ms']:6.2f} | cpu ticks {ticks} "
      f"| errors {sum(j.get('errors', {}).values())}")
PY
}

for _ in $(seq "$ROUNDS"); do
  for p in $PROXIES; do one_run "$p"; done
done

echo "== medians over $ROUNDS round(s), $STREAMS streams"
python3 - "$TMP/runs.txt" <<'PY'
import re, statistics as st, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\S+)\s+ttfb min\s+\S+ p50\s+(\S+) mean\s+(\S+) p90\s+(\S+) p99\s+(\S+) "
                 r"\| first event p50\s+(\S+) .*cpu ticks (\d+)", line)
    if m:
        rows.setdefault(m.group(1), []).append([float(x) for x in m.groups()[1:]])
for proxy, runs in rows.items():
    c = list(zip(*runs))
    print(f"{proxy:<12} ttfb p50 {st.median(c[0]):.2f} ms ({min(c[0]):.2f}-{max(c[0]):.2f}), "
          f"mean {st.median(c[1]):.2f}, p90 {st.median(c[2]):.2f}, p99 {st.median(c[3]):.2f}; "
          f"first event p50 {st.median(c[4]):.2f}; cpu ticks {st.median(c[5]):.0f} "
          f"({min(c[5]):.0f}-{max(c[5]):.0f})")
PY
