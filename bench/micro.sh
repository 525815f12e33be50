#!/usr/bin/env bash
# Core-gateway benchmarks (the figures in perf/RESULTS.md): Sluice with one worker against nginx
# with one worker, both proxying to mock-llm, with upstream keep-alive, the load generator, the
# proxy and mock-llm all pinned to ONE core so CPU cost is comparable.
#
#   bench/micro.sh              # full run: throughput rounds, added TTFB, idle RSS
#   ROUNDS=5 DURATION=10 CONNS=32 CORE=0 bench/micro.sh
#
# Measures:
#   1. requests/s and proxy CPU µs per request (utime+stime from /proc/PID/stat over the run),
#      1 KB chat-completions POST, keep-alive both sides; rounds interleave direct, nginx, sluice.
#   2. time to first byte of a streamed response, direct vs through each proxy (sluice-probe).
#   3. RSS of the proxy holding 10,000 idle keep-alive client connections.
set -euo pipefail
cd "$(dirname "$0")/.."

CORE=${CORE:-0}
DURATION=${DURATION:-10}
CONNS=${CONNS:-32}
ROUNDS=${ROUNDS:-5}
IDLE_CONNS=${IDLE_CONNS:-10000}
# nginx buffering: off is what an SSE gateway needs; on is nginx's default for plain proxying.
NGINX_BUFFERING=${NGINX_BUFFERING:-off}
ONLY=${ONLY:-all}   # all | throughput | ttfb | rss
# SLUICE_OBSERVE=1: run Sluice with the admin listener (metrics) and the access log on.
SLUICE_OBSERVE=${SLUICE_OBSERVE:-0}

need() { command -v "$1" >/dev/null 2>&1; }
if ! need nginx || ! need wrk; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light wrk >/dev/null
fi
cargo build --release -q -p sluice -p sluice-bench
BIN=target/release
TMP=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT
ulimit -n 65536 || true

. bench/lib.sh  # the cd above put us at the repository root

# --- upstream and sluice ------------------------------------------------------------------------
start_mock
write_sluice_config "$TMP/sluice.toml" "$SLUICE_OBSERVE" "$TMP/accesslog"
taskset -c "$CORE" "${SLUICE_BIN:-$BIN/sluice}" --config "$TMP/sluice.toml" >"$TMP/sluice.log" 2>&1 &
SLUICE_PID=$!
PIDS+=($SLUICE_PID)
wait_line "$TMP/sluice.log" listening
SLUICE=$(port_of "$TMP/sluice.log")

# --- nginx: one worker, upstream keep-alive, no access log, no buffering (as for SSE) ----------
NGINX=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
mkdir -p "$TMP/nginx"
cat >"$TMP/nginx/nginx.conf" <<CONF
daemon off;
master_process off;
worker_processes 1;
user root;
pid $TMP/nginx/nginx.pid;
error_log $TMP/nginx/error.log warn;
events { worker_connections 16384; }
http {
  access_log off;
  client_body_temp_path $TMP/nginx/body;
  proxy_temp_path $TMP/nginx/proxy;
  fastcgi_temp_path $TMP/nginx/fcgi;
  uwsgi_temp_path $TMP/nginx/uwsgi;
  scgi_temp_path $TMP/nginx/scgi;
  keepalive_requests 1000000;
  upstream mock { server 127.0.0.1:$MOCK; keepalive 64; keepalive_requests 1000000; }
  server {
    listen 127.0.0.1:$NGINX;
    location / {
      proxy_pass http://mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering $NGINX_BUFFERING;
      proxy_request_buffering $NGINX_BUFFERING;
    }
  }
}
CONF
taskset -c "$CORE" nginx -c "$TMP/nginx/nginx.conf" -p "$TMP/nginx" >"$TMP/nginx.log" 2>&1 &
NGINX_PID=$!
PIDS+=($NGINX_PID)
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$NGINX/v1/models" && break; sleep 0.05; done

# --- 1. throughput and CPU per request --------------------------------------------------------
write_post_lua "$TMP/post.lua"

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
CLK=$(getconf CLK_TCK)

run_one() { # name port pid(or empty)
  local name=$1 port=$2 pid=${3:-} before after out rps reqs cpu
  [ -n "$pid" ] && before=$(cpu_ticks "$pid")
  out=$(taskset -c "$CORE" wrk -t1 -c"$CONNS" -d"${DURATION}s" -s "$TMP/post.lua" "http://127.0.0.1:$port/v1/chat/completions")
  [ -n "$pid" ] && after=$(cpu_ticks "$pid")
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  reqs=$(echo "$out" | awk '/requests in/ {print $1}')
  if echo "$out" | grep -q "Non-2xx"; then echo "$name: non-2xx answers!" >&2; echo "$out" >&2; exit 1; fi
  if [ -n "$pid" ]; then
    cpu=$(python3 -c "print(f'{($after - $before) * 1e6 / $CLK / $reqs:.2f}')")
  else
    cpu="-"
  fi
  echo "$name $rps $cpu"
}

if [ "$ONLY" = all ] || [ "$ONLY" = throughput ]; then
echo "== throughput: 1 KB POST, $CONNS connections, ${DURATION}s per run, $ROUNDS interleaved rounds, all on core $CORE (nginx proxy_buffering $NGINX_BUFFERING)"
# Warm-up.
run_one warm-nginx "$NGINX" >/dev/null
run_one warm-sluice "$SLUICE" >/dev/null
: >"$TMP/rounds"
for r in $(seq "$ROUNDS"); do
  run_one direct "$MOCK" | tee -a "$TMP/rounds"
  run_one nginx "$NGINX" "$NGINX_PID" | tee -a "$TMP/rounds"
  run_one sluice "$SLUICE" "$SLUICE_PID" | tee -a "$TMP/rounds"
done
python3 - "$TMP/rounds" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1])]
by = {}
for name, rps, cpu in rows:
    by.setdefault(name, []).append((float(rps), None if cpu == "-" else float(cpu)))
def med(xs): return st.median(xs)
n_rps = [r for r, _ in by["nginx"]]; s_rps = [r for r, _ in by["sluice"]]
ratios = [s / n for s, n in zip(s_rps, n_rps)]
cpu_ratios = [s[1] / n[1] for s, n in zip(by["sluice"], by["nginx"])]
print()
print("| path | req/s (median) | min–max | proxy CPU µs/req (median) | min–max |")
print("| --- | --- | --- | --- | --- |")
for name in ("direct", "nginx", "sluice"):
    rps = [r for r, _ in by[name]]; cpu = [c for _, c in by[name] if c is not None]
    c = f"{med(cpu):.2f} | {min(cpu):.2f}–{max(cpu):.2f}" if cpu else "– | –"
    print(f"| {name} | {med(rps):,.0f} | {min(rps):,.0f}–{max(rps):,.0f} | {c} |")
print()
print(f"sluice/nginx req/s ratio: median {med(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
print(f"sluice/nginx CPU/req ratio: median {med(cpu_ratios):.3f} (min {min(cpu_ratios):.3f}, max {max(cpu_ratios):.3f})")
PY

echo "upstream connections mock-llm accepted so far: $(curl -s "http://127.0.0.1:$MOCK/_mock/stats")"
fi

# --- 2. added time to first byte of a streamed response ------------------------------------------
if [ "$ONLY" = all ] || [ "$ONLY" = ttfb ]; then
echo
echo "== time to first byte of a streamed response (sequential, one keep-alive connection, all on core $CORE, $ROUNDS interleaved rounds)"
: >"$TMP/ttfb"
for r in $(seq "$ROUNDS"); do
  for target in "direct $MOCK" "nginx $NGINX" "sluice $SLUICE"; do
    set -- $target
    taskset -c "$CORE" "$BIN/sluice-probe" ttfb --addr "127.0.0.1:$2" --n 5000 --warmup 500 | sed "s/^/$1 /" | tee -a "$TMP/ttfb"
  done
done
python3 - "$TMP/ttfb" <<'PY'
import sys, statistics as st, re
rows = {}
for line in open(sys.argv[1]):
    name, metric, *kv = line.split()
    d = dict(x.split("=") for x in kv)
    rows.setdefault((name, metric), []).append(float(d["p50"]))
print()
for metric in ("first_byte_us", "first_event_us"):
    d = rows[("direct", metric)]
    for name in ("nginx", "sluice"):
        added = [p - q for p, q in zip(rows[(name, metric)], d)]
        print(f"{name} added {metric} p50: median {st.median(added):.1f} µs (per round: {', '.join(f'{a:.1f}' for a in added)})")
PY
fi

# --- 3. RSS with idle keep-alive connections -----------------------------------------------------
if [ "$ONLY" = all ] || [ "$ONLY" = rss ]; then
echo
echo "== RSS holding $IDLE_CONNS idle keep-alive client connections"
rss_kib() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
for target in "sluice $SLUICE $SLUICE_PID" "nginx $NGINX $NGINX_PID"; do
  set -- $target
  before=$(rss_kib "$3")
  "$BIN/sluice-probe" idle --addr "127.0.0.1:$2" --conns "$IDLE_CONNS" --hold-secs 3 >"$TMP/idle.out" &
  probe=$!
  wait_line "$TMP/idle.out" ready
  during=$(rss_kib "$3")
  wait "$probe"
  echo "$1: RSS before ${before} KiB, with $(grep -o 'ready [0-9]*' "$TMP/idle.out" | cut -d' ' -f2) idle connections ${during} KiB ($(python3 -c "print(f'{$during/1024:.1f}')") MiB); $(grep still_open "$TMP/idle.out")"
done
fi
