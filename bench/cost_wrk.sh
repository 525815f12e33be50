#!/usr/bin/env bash
# The cost rig with wrk as the client (issue #15's first must-show asks for both clients; the
# kit, bench/compare.sh, drives it with sluice-load). Everything on ONE core: wrk (one thread),
# mock-llm, redis-server and the proxy; chat POSTs of BODY_BYTES (1,024) on CONNS keep-alive
# connections; rounds interleave nginx, Sluice plain and Sluice with the AI pipeline (API-key
# auth, three stacked policies on Redis, the admin listener and the protobuf access log — the
# kit's sluice-ai). Per run: req/s (wrk) and the proxy's CPU µs per request (utime + stime over the
# run, divided by the requests mock-llm served in it). Reports the median of the rounds, the
# min–max, and each run's ratio to the same round's nginx run.
#
#   bench/cost_wrk.sh                  # ROUNDS=5 DURATION=8 CONNS=32 CORE=0 BODY_BYTES=1024
#   BODY_BYTES=65536 bench/cost_wrk.sh # 64 KB prompts (mock-llm's answer echoes them: 64 KB too)
#   MOCK_ECHO=none bench/cost_wrk.sh   # answers without mock-llm's echo of the request: the size
#                                     # a provider's answer is (~330 bytes, not ~1.6 KB for 1 KB)
#   HEADS=provider bench/cost_wrk.sh   # heads of real traffic's size: openai-python's seventeen
#                                     # request fields, a provider's twenty more answer fields
#   BASE_BIN=/tmp/sluice-before PROXIES="nginx sluice-base sluice sluice-ai-base sluice-ai" \
#     bench/cost_wrk.sh                # a change against the build before it, same rounds
set -euo pipefail
cd "$(dirname "$0")/.."
CORE=${CORE:-0}
ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-8}
CONNS=${CONNS:-32}
BODY_BYTES=${BODY_BYTES:-1024}
PROXIES=${PROXIES:-"nginx sluice sluice-ai"}
for tool in wrk nginx redis-server; do
  command -v "$tool" >/dev/null || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk nginx-light redis-server >/dev/null
    break
  }
done
cargo build --release -q -p sluice -p sluice-bench
BIN=target/release
. bench/lib.sh
init_scratch

start_wrk_rig

HZ=$(getconf CLK_TCK)
echo "machine: $(nproc) CPU(s), $(uname -r), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); commit $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty')"
echo "$(nginx -v 2>&1); $(wrk --version 2>&1 | head -1 | cut -d' ' -f1-2); core $CORE; $ROUNDS round(s) of ${DURATION}s, $CONNS connections, $BODY_BYTES-byte bodies${MOCK_ECHO:+, x-mock-echo: $MOCK_ECHO}${HEADS:+, $HEADS-sized heads}"
: >"$TMP/runs.txt"
for round in $(seq "$ROUNDS"); do
  for proxy in $PROXIES; do
    t0=$(proc_ticks "${PID[$proxy]}"); s0=$(mock_stat requests)
    out=$(wrk_at "$proxy" "$DURATION")
    t1=$(proc_ticks "${PID[$proxy]}"); s1=$(mock_stat requests)
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    bad=$(echo "$out" | awk '/Non-2xx/ {print $NF} /Socket errors/ {print "socket"}' | head -1)
    echo "$round $proxy $rps $((t1 - t0)) $((s1 - s0)) ${bad:-0}" >>"$TMP/runs.txt"
    printf '  round %s %-10s %10s req/s %s\n' "$round" "$proxy" "$rps" "${bad:+errors: $bad}"
  done
done
python3 - "$TMP/runs.txt" "$HZ" <<'PY'
import statistics, sys
from collections import defaultdict
hz = int(sys.argv[2])
runs = defaultdict(dict)
for line in open(sys.argv[1]):
    rnd, proxy, rps, ticks, served, bad = line.split()
    runs[proxy][int(rnd)] = (float(rps), int(ticks) / hz * 1e6 / max(int(served), 1), bad)
med = lambda xs: statistics.median(xs) if xs else float("nan")  # no nginx run: no ratios
rng = lambda xs: f"{min(xs):.2f}–{max(xs):.2f}" if xs else "–"
print()
print("| proxy | req/s | min–max | ratio to nginx | ratio min–max | CPU µs/req | min–max | CPU ratio to nginx | ratio min–max | errors |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
base = runs.get("nginx", {})
for proxy, rounds in runs.items():
    rps = [v[0] for v in rounds.values()]
    cpu = [v[1] for v in rounds.values()]
    ratio = [rounds[r][0] / base[r][0] for r in rounds if r in base]
    cratio = [rounds[r][1] / base[r][1] for r in rounds if r in base]
    errors = sum(v[2] != "0" for v in rounds.values())
    print(f"| {proxy} | {med(rps):,.0f} | {min(rps):,.0f}–{max(rps):,.0f} | {med(ratio):.2f} | {rng(ratio)} "
          f"| {med(cpu):.2f} | {min(cpu):.2f}–{max(cpu):.2f} | {med(cratio):.2f} | {rng(cratio)} | {errors} |")
PY
