#!/usr/bin/env bash
# Upstream pools under concurrency (issue #15, item 4), Sluice with one worker in front of
# mock-llm, everything on loopback:
#   A. CONNS (256) concurrent small requests, closed loop, DURATION s: req/s, and how many
#      upstream connections Sluice opened (mock-llm's connections_accepted) — churn shows as
#      thousands, steady reuse as about CONNS.
#   B. STREAMS (1,100) concurrent streams of 64 events 20 ms apart: completed vs failed, and
#      the 503s of a connection cap.
#
#   bench/pools.sh                          # the working tree's release build
#   SLUICE_BIN=/path/to/old/sluice bench/pools.sh   # the same for another build
set -euo pipefail
cd "$(dirname "$0")/.."
CONNS=${CONNS:-256}
STREAMS=${STREAMS:-1100}
DURATION=${DURATION:-10}
. bench/lib.sh
release_rig
SLUICE_BIN=${SLUICE_BIN:-$BIN/sluice}


start_mock
declare -A PID PORT
start_pinned_proxy sluice 0 # SLUICE_BIN, the default config
URL="http://127.0.0.1:${PORT[sluice]}/v1/chat/completions"

echo "sluice: $SLUICE_BIN ($("$SLUICE_BIN" --version 2>/dev/null || echo '?'))"
before=$(mock_stat connections_accepted)
"$BIN/sluice-load" --url "$URL" --connections "$CONNS" --duration "${DURATION}s" --warmup 1s \
  --json "$TMP/a.json" >/dev/null
after=$(mock_stat connections_accepted)
python3 - "$TMP/a.json" "$CONNS" "$((after - before - 1))" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"A. {sys.argv[2]} concurrent small requests: {r['rps']:.0f} req/s, "
      f"statuses {r['statuses']}, errors {r['errors']}, upstream connections opened: {sys.argv[3]}")
PY

"$BIN/sluice-load" --url "$URL" --connections "$STREAMS" --duration 6s --stream --timeout 30s \
  --header 'x-mock-tokens: 64' --header 'x-mock-inter-token-ms: 20' --json "$TMP/b.json" >/dev/null
python3 - "$TMP/b.json" "$STREAMS" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
ok = sum(n for s, n in r["statuses"].items() if s.startswith("2"))
print(f"B. {sys.argv[2]} concurrent streams, 6 s: {ok} completed, statuses {r['statuses']}, "
      f"errors {r['errors']}, content events {r['content_events']}")
PY
