#!/usr/bin/env bash
# The kernel's work per request that a proxy can change, in the cost rig's shape (everything on
# CORE, wrk with one thread, CONNS keep-alive connections, 1 KB chat POSTs through mock-llm):
# TCP segments and bytes on loopback (nstat: the machine's counters, so the two ends of every
# connection are counted, and anything else running on the machine with them), pure ACKs and
# delayed ACKs, and the context switches of the proxy (all its threads; nginx's workers too)
# and of mock-llm, voluntary (it waited) and involuntary (it was preempted). Each is divided by
# the requests mock-llm served over the same SECS-second run; ROUNDS runs per proxy,
# interleaved.
#
#   bench/kernel_work.sh                          # nginx, Sluice plain, Sluice with the AI pipeline
#   PROXIES="nginx sluice" ROUNDS=3 bench/kernel_work.sh
#   MOCK_ECHO=none HEADS=provider bench/kernel_work.sh   # as bench/cost_wrk.sh takes them
set -euo pipefail
cd "$(dirname "$0")/.."
CORE=${CORE:-0}
ROUNDS=${ROUNDS:-2}
SECS=${SECS:-5}
CONNS=${CONNS:-32}
BODY_BYTES=${BODY_BYTES:-1024}
PROXIES=${PROXIES:-"nginx sluice sluice-ai"}
for tool in wrk nginx redis-server nstat; do
  command -v "$tool" >/dev/null || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk nginx-light redis-server iproute2 >/dev/null
    break
  }
done
cargo build --release -q -p sluice -p sluice-bench
BIN=target/release
. bench/lib.sh
init_scratch

start_wrk_rig

# "voluntary involuntary" context switches of a process's threads, and of its children's (nginx's
# workers).
switches() {
  local p t v=0 i=0
  for p in "$1" $(pgrep -P "$1" || true); do
    for t in /proc/"$p"/task/*; do
      v=$((v + $(awk '/^voluntary_ctxt_switches/ {print $2}' "$t/status")))
      i=$((i + $(awk '/^nonvoluntary_ctxt_switches/ {print $2}' "$t/status")))
    done
  done
  echo "$v $i"
}

# One counter of the run's nstat output (all of them are printed, zeros too).
count() { awk -v k="$1" '$1 == k {print $2}' "$TMP/nstat.txt"; }

echo "machine: $(nproc) CPU(s), $(uname -r), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); commit $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty')"
echo "core $CORE; $ROUNDS round(s) of ${SECS}s, $CONNS connections, $BODY_BYTES-byte bodies${MOCK_ECHO:+, x-mock-echo: $MOCK_ECHO}${HEADS:+, $HEADS-sized heads}"
: >"$TMP/runs.txt"
for round in $(seq "$ROUNDS"); do
  for proxy in $PROXIES; do
    s0=$(mock_stat requests)
    read -r pv0 pi0 < <(switches "${PID[$proxy]}")
    read -r mv0 mi0 < <(switches "$MOCK_PID")
    nstat -n >/dev/null
    wrk_at "$proxy" "$SECS" >/dev/null
    nstat -z >"$TMP/nstat.txt"
    read -r pv1 pi1 < <(switches "${PID[$proxy]}")
    read -r mv1 mi1 < <(switches "$MOCK_PID")
    s1=$(mock_stat requests)
    echo "$proxy $((s1 - s0)) $(count TcpOutSegs) $(count IpExtOutOctets) $(count TcpExtTCPPureAcks) $(count TcpExtDelayedACKs) $((pv1 - pv0)) $((pi1 - pi0)) $((mv1 - mv0)) $((mi1 - mi0))" >>"$TMP/runs.txt"
  done
done
python3 - "$TMP/runs.txt" "$PROXIES" <<'PY'
import statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    proxy, n, *counts = line.split()
    n = max(int(n), 1)
    runs[proxy].append([int(c or 0) / n for c in counts])
cols = ["TCP segments", "bytes on loopback", "pure ACKs", "delayed ACKs",
        "proxy: waited", "proxy: preempted", "mock-llm: waited", "mock-llm: preempted"]
print()
print("Per request (median of the rounds):")
print()
print("| proxy | " + " | ".join(cols) + " |")
print("| --- |" + " ---: |" * len(cols))
for proxy in sys.argv[2].split():
    med = [statistics.median(r[i] for r in runs[proxy]) for i in range(len(cols))]
    cells = [f"{med[0]:.3f}", f"{med[1]:,.0f}"] + [f"{m:.3f}" for m in med[2:]]
    print(f"| {proxy} | " + " | ".join(cells) + " |")
PY
