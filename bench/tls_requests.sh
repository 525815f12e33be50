#!/usr/bin/env bash
# Per-request cost of TLS on kept-alive connections: nginx against Sluice, each proxying a 1 KB
# chat completion to mock-llm, over TLS and over plain HTTP, with wrk as the client (32
# connections, one thread). The proxy runs alone on core 0; wrk and mock-llm share core 1.
# Prints requests per second and the proxy's CPU µs per request (utime + stime over the run /
# requests); the TLS cost of a request is the TLS row less the plain one. The same self-signed
# ECDSA P-256 certificate for both, TLS 1.3 (both negotiate TLS_AES_256_GCM_SHA384 with wrk's
# OpenSSL). Release binaries from `cargo build --release -p sluice -p sluice-bench`.
#
#   bench/tls_requests.sh              # 10 s per run, 3 interleaved rounds
#   TIME=5 ROUNDS=1 bench/tls_requests.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release}
TIME=${TIME:-10}
ROUNDS=${ROUNDS:-3}
CONNS=${CONNS:-32}
command -v nginx >/dev/null || { echo "nginx is needed (apt-get install nginx-light)"; exit 1; }
command -v wrk >/dev/null || { echo "wrk is needed (apt-get install wrk)"; exit 1; }
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$tmp/key.pem" \
  -out "$tmp/cert.pem" -subj /CN=localhost -addext subjectAltName=DNS:localhost -days 1 2>/dev/null
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
cpu_ticks() { local t=0; for p in "$@"; do t=$((t + $(awk '{print $14+$15}' "/proc/$p/stat"))); done; echo "$t"; }
hz=$(getconf CLK_TCK)

mock_port=$(free_port)
taskset -c 1 "$BIN/mock-llm" --listen "127.0.0.1:$mock_port" --tokens 16 >/dev/null & pids+=($!)

nginx_tls=$(free_port); nginx_plain=$(free_port)
mkdir -p "$tmp/nginx"
cat > "$tmp/nginx.conf" <<CONF
worker_processes 1;
pid $tmp/nginx/nginx.pid;
error_log $tmp/nginx/error.log;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $tmp/nginx; proxy_temp_path $tmp/nginx; fastcgi_temp_path $tmp/nginx;
  uwsgi_temp_path $tmp/nginx; scgi_temp_path $tmp/nginx;
  upstream mock { server 127.0.0.1:$mock_port; keepalive 64; }
  server {
    listen 127.0.0.1:$nginx_plain;
    listen 127.0.0.1:$nginx_tls ssl;
    ssl_certificate $tmp/cert.pem;
    ssl_certificate_key $tmp/key.pem;
    ssl_protocols TLSv1.2 TLSv1.3;
    keepalive_requests 1000000;
    location / {
      proxy_pass http://mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
CONF
taskset -c 0 nginx -c "$tmp/nginx.conf" -g 'daemon off;' & pids+=($!)

sluice_tls=$(free_port); sluice_plain=$(free_port)
cat > "$tmp/sluice.toml" <<CONF
[server]
listen = "127.0.0.1:$sluice_plain"
workers = 1
pin_workers = false
[tls]
listen = "127.0.0.1:$sluice_tls"
certificates = [{ cert = "$tmp/cert.pem", key = "$tmp/key.pem" }]
[clusters.c]
backends = [{ base_url = "http://127.0.0.1:$mock_port/v1" }]
[[routes]]
model = "gpt-4o"
cluster = "c"
CONF
taskset -c 0 "$BIN/sluice" --config "$tmp/sluice.toml" 2>"$tmp/sluice.log" & pids+=($!)
sluice_pid=$!
sleep 1
nginx_master=$(pgrep -f "nginx -c $tmp/nginx.conf" | head -1)
nginx_pids="$nginx_master $(pgrep -P "$nginx_master" | tr '\n' ' ')"

python3 - "$tmp/post.lua" <<'PY'
import json, sys
content = "x" * (1024 - 80)
body = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": content}]})
open(sys.argv[1], "w").write(
    'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
    f'wrk.body = {json.dumps(body)}\n')
PY

run() { # name url pids...
  local name=$1 url=$2; shift 2
  local before after out n
  # A warm-up, so the connections (and their handshakes) are not in the figure.
  taskset -c 1 wrk -t1 -c"$CONNS" -d1s -s "$tmp/post.lua" "$url" >/dev/null 2>&1
  before=$(cpu_ticks "$@")
  out=$(taskset -c 1 wrk -t1 -c"$CONNS" -d"${TIME}s" -s "$tmp/post.lua" "$url" 2>&1)
  after=$(cpu_ticks "$@")
  n=$(echo "$out" | awk '/requests in/ {print $1; exit}')
  errs=$(echo "$out" | awk '/Non-2xx|Socket errors/ {print}' | tr '\n' ' ')
  awk -v name="$name" -v n="$n" -v s="$TIME" -v d=$((after - before)) -v hz="$hz" -v e="$errs" \
    'BEGIN { printf "%-14s %9d requests  %8.0f /s  %6.2f µs CPU per request %s\n", name, n, n / s, d / hz * 1e6 / n, e }'
}

for round in $(seq 1 "$ROUNDS"); do
  echo "round $round"
  run "nginx plain" "http://127.0.0.1:$nginx_plain/v1/chat/completions" $nginx_pids
  run "sluice plain" "http://127.0.0.1:$sluice_plain/v1/chat/completions" "$sluice_pid"
  run "nginx tls" "https://127.0.0.1:$nginx_tls/v1/chat/completions" $nginx_pids
  run "sluice tls" "https://127.0.0.1:$sluice_tls/v1/chat/completions" "$sluice_pid"
done
