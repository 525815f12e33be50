#!/usr/bin/env bash
# Where a proxy's CPU goes in the cost rig, per request: Sluice (plain) next to nginx (and any
# other proxy in PROXIES), sampled with `perf` while the kit's cost-rig load runs.
#
#   bench/profile.sh                 # ~1 min; prints a Markdown table, keeps perf.data in $OUT
#   PROXIES="sluice nginx haproxy" bench/profile.sh
#   PROXIES="sluice sluice-ai" bench/profile.sh   # what the AI pipeline adds (keys, limits, log)
#
# The rig is bench/compare.sh's cost rig: mock-llm, the proxy and sluice-load (closed loop,
# CONNS keep-alive connections, SMALL_BYTES chat POSTs) all pinned to one core. For each proxy
# it samples the proxy's threads at 1,999 Hz with call graphs for SECS seconds and counts the
# proxy's CPU ticks and the requests mock-llm served over the same window, so each share of
# the profile converts to µs per request. Kernel rows are inclusive (everything under that
# kernel function, e.g. a loopback send includes delivering the segment to the receiver);
# user-space rows are self time, grouped by what the code does. `sluice-ai` is Sluice with the
# kit's AI pipeline (API keys, three policies on a redis-server it starts on the same core,
# metrics and the access log).
#
# RIG=latency profiles the latency rig instead: the proxy alone on CORE, sluice-load and
# mock-llm on CORE_B, open loop at RATE req/s over LAT_CONNS connections; there every request
# wakes an idle proxy from the other core, which costs more than in the cost rig.
#
# Knobs: BIN_DIR (default: release build, built if missing), OUT (default: a temp dir), PROXIES
# ("sluice nginx"), RIG (cost), CONNS (32), SMALL_BYTES (1024), SECS (8), RATE (15000),
# LAT_CONNS (64), CORE and CORE_B (the first two CPUs we may use), PERF_CALLGRAPH (`perf
# record`'s call-graph option, default `-g`; `--call-graph dwarf,16384` names the callers of
# memcpy and other inlined code, which frame pointers miss).
set -euo pipefail
cd "$(dirname "$0")/.."
export LC_ALL=C
die() { echo "profile.sh: $*" >&2; exit 1; }

: "${PROXIES:=sluice nginx}" "${CONNS:=32}" "${SMALL_BYTES:=1024}" "${SECS:=8}"
: "${RIG:=cost}" "${RATE:=15000}" "${LAT_CONNS:=64}"
read -r FIRST SECOND < <(python3 -c 'import os; c = sorted(os.sched_getaffinity(0)); print(c[0], c[1] if len(c) > 1 else -1)')
: "${CORE:=$FIRST}" "${CORE_B:=$SECOND}"
case $RIG in
  cost) CLIENT_CORE=$CORE ;;
  latency) CLIENT_CORE=$CORE_B; [ "$CORE_B" -ge 0 ] && [ "$CORE_B" != "$CORE" ] || die "RIG=latency needs a second CPU" ;;
  *) die "RIG is cost or latency" ;;
esac
command -v perf >/dev/null || { apt-get install -y -qq linux-perf >/dev/null 2>&1 || die "perf is missing (apt-get install linux-perf)"; }
for p in $PROXIES; do
  case $p in
    sluice) ;;
    sluice-ai) command -v redis-server >/dev/null || die "redis-server is missing (apt-get install redis-server)" ;;
    nginx | haproxy) command -v "$p" >/dev/null || die "$p is missing (bench/compare.sh installs it)" ;;
    *) die "unknown proxy $p (sluice, sluice-ai, nginx, haproxy)" ;;
  esac
done
if [ -z "${BIN_DIR:-}" ]; then
  cargo build --release -q -p sluice -p sluice-bench
  BIN_DIR=target/release
fi
BIN=$(cd "$BIN_DIR" && pwd)
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/sluice-profile.XXXXXX")}
mkdir -p "$OUT"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/sluice-profile-run.XXXXXX")
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.2
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT
. bench/lib.sh

start_mock
taskset -a -p -c "$CLIENT_CORE" "${PIDS[0]}" >/dev/null
declare -A PORT=() PID=()
KEY=sk-profile-1
case " $PROXIES " in *" sluice-ai "*) start_pinned_redis "$CORE" ;; esac
for p in $PROXIES; do
  case $p in
    haproxy)
      PORT[$p]=$(free_port)
      write_haproxy_config "$TMP/haproxy.cfg" "${PORT[$p]}" "$MOCK" 4096 # 2 fds per connection
      taskset -c "$CORE" haproxy -db -f "$TMP/haproxy.cfg" >"$TMP/haproxy.log" 2>&1 &
      PID[$p]=$!
      PIDS+=($!)
      ;;
    *) start_pinned_proxy "$p" "$CORE" ;; # sluice, sluice-ai, nginx
  esac
  wait_http "http://127.0.0.1:${PORT[$p]}/v1/models" "${PID[$p]}"
done

mock_requests() { curl -s --max-time 5 "http://127.0.0.1:$MOCK/_mock/stats" | sed -n 's/.*"requests":\([0-9]*\).*/\1/p'; }
load() { # proxy seconds
  local shape=(--connections "$CONNS")
  [ "$RIG" = cost ] || shape=(--connections "$LAT_CONNS" --rate "$RATE")
  [ "$1" != sluice-ai ] || shape+=(--header "Authorization: Bearer $KEY")
  taskset -c "$CLIENT_CORE" "$BIN/sluice-load" --url "http://127.0.0.1:${PORT[$1]}/v1/chat/completions" \
    "${shape[@]}" --duration "${2}s" --body-bytes "$SMALL_BYTES" >/dev/null
}
# Context switches of all the proxy's threads (each one is a sleep and a wake-up).
switches() { # pid
  cat /proc/"$1"/task/*/status 2>/dev/null | awk '/^(non)?voluntary_ctxt_switches/ {n += $2} END {print n + 0}'
}

CLK=$(getconf CLK_TCK)
for p in $PROXIES; do
  load "$p" 1 # warm: connections, pools, page tables
  load "$p" $((SECS + 2)) &
  lpid=$!
  sleep 1
  t0=$(proc_ticks "${PID[$p]}") r0=$(mock_requests) s0=$(switches "${PID[$p]}")
  perf record -q -F 1999 ${PERF_CALLGRAPH:--g} -p "${PID[$p]}" -o "$OUT/$p.perf.data" -- sleep "$SECS" 2>/dev/null
  t1=$(proc_ticks "${PID[$p]}") r1=$(mock_requests) s1=$(switches "${PID[$p]}")
  wait "$lpid"
  us=$(awk -v t=$((t1 - t0)) -v r=$((r1 - r0)) -v c="$CLK" 'BEGIN { printf "%.2f", t / c * 1e6 / r }')
  sw=$(awk -v s=$((s1 - s0)) -v r=$((r1 - r0)) 'BEGIN { printf "%.3f", s / r }')
  echo "$p $us $(((r1 - r0) / SECS)) $sw" >>"$OUT/cost.txt"
  perf report -i "$OUT/$p.perf.data" --stdio --no-children -g none --sort sym --percent-limit 0 \
    2>/dev/null >"$OUT/$p.self.txt"
  perf report -i "$OUT/$p.perf.data" --stdio --children -g none --sort sym --percent-limit 0 \
    2>/dev/null >"$OUT/$p.children.txt"
  echo "profiled $p: $us µs CPU per request at $(((r1 - r0) / SECS)) req/s" >&2
done

python3 - "$OUT" $PROXIES <<'PY'
import re, sys
out, proxies = sys.argv[1], sys.argv[2:]
cost = {l.split()[0]: (float(l.split()[1]), int(l.split()[2]), float(l.split()[3])) for l in open(f"{out}/cost.txt")}

def rows(path, children):
    pat = re.compile(r"^\s+([\d.]+)%\s+(?:([\d.]+)%\s+)?\[(.)\]\s+(.*)$")
    for line in open(path):
        m = pat.match(line)
        if m:
            yield float(m.group(1)), m.group(3), m.group(4).strip()

# Kernel, inclusive (children) shares of the entry points that matter for a proxy hop.
KERNEL = [
    ("TCP send, incl. loopback delivery to the peer", ["tcp_sendmsg"]),
    ("TCP receive (copy to the proxy)", ["tcp_recvmsg"]),
    ("sleeping and waking (scheduler)", ["schedule"]),
]
# User space, self time, by what the code does (first match wins).
USER = [
    ("JSON parse / validation", r"simd_json|^json"),
    ("HTTP parsing", r"httparse|ngx_http_parse|http_parse|h1_"),
    ("memcpy / memmove", r"mem(move|cpy|set)|__memmove|__memcpy"),
    ("allocator", r"^_?mi_|malloc|^free$|^cfree|_int_free|_int_malloc|ngx_p(c)?alloc|pool_alloc|pool_free"),
    ("clock reads", r"clock_gettime|read_tsc|Timespec|Instant"),
    ("event loop / runtime", r"^monoio::|ngx_epoll|ngx_event|ngx_process_events|fd_update|_do_poll|io_uring|ev_epoll"),
    ("prompt-token estimate", r"estimate_tokens"),
]

def profile(p):
    self_rows = list(rows(f"{out}/{p}.self.txt", False))
    child = {name: pct for pct, kind, name in rows(f"{out}/{p}.children.txt", True) if kind == "k"}
    kernel = sum(pct for pct, kind, _ in self_rows if kind == "k")
    user_total = sum(pct for pct, kind, _ in self_rows if kind != "k")
    res = {"kernel, all": kernel}
    named = 0.0
    for label, fns in KERNEL:
        v = sum(child.get(f, 0.0) for f in fns)
        res[label] = v
        named += v
    res["kernel, other (syscall entry, io_uring / epoll, timers, …)"] = max(0.0, kernel - named)
    buckets = {label: 0.0 for label, _ in USER}
    other = 0.0
    for pct, kind, name in self_rows:
        if kind == "k":
            continue
        for label, rx in USER:
            if re.search(rx, name):
                buckets[label] += pct
                break
        else:
            other += pct
    res["user space, all"] = user_total
    res.update(buckets)
    res["the proxy's own request logic and the rest"] = other
    return res

profiles = {p: profile(p) for p in proxies}
labels = list(next(iter(profiles.values())).keys())
print("| | " + " | ".join(proxies) + " |")
print("| --- |" + " --- |" * len(proxies))
print("| **CPU µs/request** (req/s) | " + " | ".join(f"**{cost[p][0]:.1f}** ({cost[p][1]:,})" for p in proxies) + " |")
print("| context switches per request | " + " | ".join(f"{cost[p][2]:.2f}" for p in proxies) + " |")
for label in labels:
    strong = label in ("kernel, all", "user space, all")
    cells = []
    for p in proxies:
        pct = profiles[p][label]
        us = pct / 100 * cost[p][0]
        cells.append(f"{us:.1f} ({pct:.0f}%)")
    name = f"**{label}**" if strong else "&nbsp;&nbsp;" + label
    print(f"| {name} | " + " | ".join(cells) + " |")
PY
