#!/usr/bin/env bash
# TLS handshake cost: nginx against Sluice, the same ECDSA P-256 certificate, full handshakes
# (no session resumption), TLS 1.3, `openssl s_time -new` as the client on core 1 and the proxy
# alone on core 0. Prints handshakes per second and the proxy's CPU µs per handshake
# (utime + stime over the run / handshakes). Release binaries from `cargo build --release`.
#
#   bench/tls_handshake.sh            # 10 s per proxy, 3 rounds
#   TIME=5 ROUNDS=1 bench/tls_handshake.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release}
TIME=${TIME:-10}
ROUNDS=${ROUNDS:-3}
command -v nginx >/dev/null || { echo "nginx is needed (apt-get install nginx-light)"; exit 1; }
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$tmp/key.pem" \
  -out "$tmp/cert.pem" -subj /CN=localhost -addext subjectAltName=DNS:localhost -days 1 2>/dev/null
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
cpu_ticks() { # utime+stime of the given pids, in clock ticks
  local t=0; for p in "$@"; do t=$((t + $(awk '{print $14+$15}' "/proc/$p/stat"))); done; echo "$t"; }
hz=$(getconf CLK_TCK)

nginx_port=$(free_port)
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
  server {
    listen 127.0.0.1:$nginx_port ssl;
    ssl_certificate $tmp/cert.pem;
    ssl_certificate_key $tmp/key.pem;
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_session_cache off;
    ssl_session_tickets off;
    location / { return 200 "ok"; }
  }
}
CONF
taskset -c 0 nginx -c "$tmp/nginx.conf" -g 'daemon off;' & pids+=($!)

sluice_port=$(free_port)
plain_port=$(free_port)
cat > "$tmp/sluice.toml" <<CONF
[server]
listen = "127.0.0.1:$plain_port"
workers = 1
pin_workers = false
[tls]
listen = "127.0.0.1:$sluice_port"
certificates = [{ cert = "$tmp/cert.pem", key = "$tmp/key.pem" }]
[clusters.c]
backends = [{ base_url = "http://127.0.0.1:9/v1" }]
[[routes]]
model = "m"
cluster = "c"
CONF
taskset -c 0 "$BIN/sluice" --config "$tmp/sluice.toml" 2>"$tmp/sluice.log" & pids+=($!)
sluice_pid=$!
sleep 1
nginx_pids=$(pgrep -f "nginx -c $tmp/nginx.conf" | tr '\n' ' '; pgrep -P "$(pgrep -f "nginx -c $tmp/nginx.conf" | head -1)" | tr '\n' ' ')

run() { # name port pids...
  local name=$1 port=$2; shift 2
  local before after out n
  before=$(cpu_ticks "$@")
  out=$(taskset -c 1 openssl s_time -connect "127.0.0.1:$port" -new -time "$TIME" 2>/dev/null)
  after=$(cpu_ticks "$@")
  n=$(echo "$out" | awk '/connections in [0-9.]+s/ {print $1; exit}')
  awk -v name="$name" -v n="$n" -v s="$TIME" -v d=$((after - before)) -v hz="$hz" \
    'BEGIN { printf "%-8s %8d handshakes  %8.0f /s  %8.1f µs CPU per handshake\n", name, n, n / s, d / hz * 1e6 / n }'
}
for r in $(seq "$ROUNDS"); do
  echo "round $r"
  # shellcheck disable=SC2086
  run nginx "$nginx_port" $nginx_pids
  run sluice "$sluice_port" "$sluice_pid"
done
