# Shared pieces of the benchmark scripts; sourced, not run. Expects TMP, BIN, CORE and a PIDS
# array in the caller (init_scratch, below, sets up TMP and PIDS with their cleanup).

# Wait until FILE holds PATTERN (a server's startup line), or fail showing the file.
wait_line() { # file pattern
  for _ in $(seq 100); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.05; done
  echo "timed out waiting for '$2' in $1" >&2; cat "$1" >&2; exit 1
}

# The port from a "listening on IP:PORT" startup line.
port_of() { grep -o 'listening on [0-9.]*:[0-9]*' "$1" | head -1 | sed 's/.*://'; }

# Start mock-llm pinned to CORE; sets MOCK to its port.
start_mock() {
  taskset -c "$CORE" "$BIN/mock-llm" --listen 127.0.0.1:0 --tokens 16 >"$TMP/mock.log" 2>&1 &
  PIDS+=($!)
  wait_line "$TMP/mock.log" listening
  MOCK=$(port_of "$TMP/mock.log")
}

# Write a one-worker Sluice config routing every model to mock-llm. With OBSERVE=1, the admin
# listener (metrics) and the access log (in LOGDIR) are on too.
write_sluice_config() { # file observe logdir
  cat >"$1" <<TOML
[server]
listen = "127.0.0.1:0"
workers = 1
pin_workers = false
[clusters.mock]
backends = [{ base_url = "http://127.0.0.1:$MOCK/v1" }]
[[routes]]
model = "*"
cluster = "mock"
TOML
  if [ "$2" = 1 ]; then
    cat >>"$1" <<TOML
[admin]
listen = "127.0.0.1:0"
[access_log]
dir = "$3"
[pricing."gpt-4o"]
input = 2.5
output = 10.0
TOML
  fi
}

# openai-python 1.x's request fields besides host, content-type, content-length and
# authorization, and the control asking mock-llm for the twenty more answer fields OpenAI's API
# sends (`x-mock-headers: provider`): with HEADS=provider, the wrk scripts below and
# bench/compare.sh's cost and latency rigs send them, so heads are real traffic's size (a
# request head of seventeen fields, ~600 bytes; an answer head of ~1.3 KB).
PROVIDER_HEAD_FIELDS=(
  "accept-encoding: gzip, deflate"
  "connection: keep-alive"
  "accept: application/json"
  "user-agent: OpenAI/Python 1.54.4"
  "x-stainless-lang: python"
  "x-stainless-package-version: 1.54.4"
  "x-stainless-os: Linux"
  "x-stainless-arch: x64"
  "x-stainless-runtime: CPython"
  "x-stainless-runtime-version: 3.12.7"
  "x-stainless-async: false"
  "x-stainless-retry-count: 0"
  "x-stainless-read-timeout: 600"
  "x-mock-headers: provider"
)

# The fields HEADS asks for (none when unset), one per line.
head_fields() {
  case ${HEADS:-} in
    "") ;;
    provider) printf '%s\n' "${PROVIDER_HEAD_FIELDS[@]}" ;;
    *) echo "HEADS: provider, or unset" >&2; return 1 ;;
  esac
}

# A wrk script POSTing exactly 1,024 bytes of chat-completions JSON.
# With MOCK_ECHO=none in the environment the requests carry `x-mock-echo: none`: mock-llm then
# answers without its echo of the request, a provider-sized answer (~330 bytes for chat).
# With HEADS=provider they carry the fields above.
write_post_lua() { # file [body bytes, default 1024]
  local fields
  fields=$(head_fields) || return 1
  python3 - "$1" "${2:-1024}" "${MOCK_ECHO:-}" "$fields" <<'PY'
import json, sys
size = int(sys.argv[2])
echo = sys.argv[3]
if echo not in ("", "none"):
    sys.exit("MOCK_ECHO: none, or unset")
base = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": ""}]})
body = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "x" * (size - len(base))}]})
assert len(body) == size, len(body)
fields = [("Content-Type", "application/json")]
if echo == "none":
    fields.append(("x-mock-echo", "none"))
fields += [tuple(f.split(": ", 1)) for f in sys.argv[4].splitlines()]
open(sys.argv[1], "w").write(
    'wrk.method = "POST"\nwrk.body = [[' + body + ']]\n'
    + "".join('wrk.headers["%s"] = "%s"\n' % kv for kv in fields)
)
PY
}

# ---- Used by bench/compare.sh (the comparison kit); the functions above are unchanged. --------

# A free TCP port on 127.0.0.1 (for servers whose config needs a fixed port).
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Wait until URL answers any HTTP status (the server is up), or fail after about 20 s. With a
# PID, fail at once if that process has exited.
wait_http() { # url [pid]
  for _ in $(seq 400); do
    curl -s -o /dev/null --max-time 1 "$1" && return 0
    if [ -n "${2:-}" ] && ! kill -0 "$2" 2>/dev/null; then
      echo "process $2 exited before $1 answered" >&2; return 1
    fi
    sleep 0.05
  done
  echo "timed out waiting for $1" >&2; return 1
}

# CPU time of a process, all its threads, in clock ticks: utime + stime from /proc/PID/stat.
proc_ticks() { # pid
  local stat rest
  stat=$(<"/proc/$1/stat") || { echo 0; return; }
  rest=${stat##*) }             # the fields after "(comm) "; comm may hold spaces
  set -- $rest                  # $1 = state (field 3), so utime (14) is $12, stime (15) $13
  echo $(( ${12} + ${13} ))
}

# Resident set size of a process in KiB.
rss_kib() { # pid
  awk '/^VmRSS:/ {print $2; f=1} END {if (!f) print 0}' "/proc/$1/status" 2>/dev/null || echo 0
}

# nginx: one worker, no master, upstream keep-alive, access log off, no buffering either way (as
# an SSE gateway must run). Writes DIR/nginx.conf.
write_nginx_config() { # dir port upstream_port [worker_connections]
  local conns=${4:-16384}
  mkdir -p "$1"
  cat >"$1/nginx.conf" <<CONF
daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile $((conns + 64));
user root;
pid $1/nginx.pid;
error_log $1/error.log warn;
events { worker_connections $conns; }
http {
  access_log off;
  client_body_temp_path $1/body;
  proxy_temp_path $1/proxy;
  fastcgi_temp_path $1/fcgi;
  uwsgi_temp_path $1/uwsgi;
  scgi_temp_path $1/scgi;
  keepalive_requests 1000000;
  keepalive_timeout 75s;
  client_max_body_size 16m;
  upstream mock { server 127.0.0.1:$3; keepalive 64; keepalive_requests 1000000; }
  server {
    listen 127.0.0.1:$2 backlog=16384;
    location / {
      proxy_pass http://mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }
  }
}
CONF
}

# haproxy: one thread, HTTP mode, server-side keep-alive with connection reuse, no log lines
# (no "log" directive), every piece of a response forwarded at once (http-no-delay, for SSE).
write_haproxy_config() { # file port upstream_port [maxconn]
  cat >"$1" <<CONF
global
  nbthread 1
  maxconn ${4:-16384}
defaults
  mode http
  option http-keep-alive
  # Send each piece as it comes: without it haproxy sends with MSG_MORE and the kernel holds
  # small SSE events back (measured: ~150 ms to the first event, events coalesced).
  option http-no-delay
  http-reuse always
  timeout connect 5s
  timeout client 120s
  timeout server 120s
  timeout http-keep-alive 75s
  timeout http-request 10s
frontend bench
  bind 127.0.0.1:$2 backlog 16384
  default_backend mock
backend mock
  server mock1 127.0.0.1:$3
CONF
}

# monolake: one worker thread on io_uring, not pinned by itself (taskset pins it). Its router
# replaces the request path with the upstream URI's path, so each path the kit sends gets its own
# route.
write_monolake_config() { # file port upstream_port
  cat >"$1" <<CONF
[runtime]
worker_threads = 1
cpu_affinity = false

[servers.bench]
name = "bench"
listener = { type = "socket", value = "127.0.0.1:$2" }
http_timeout = { server_keepalive_timeout_sec = 75, upstream_read_timeout_sec = 120 }

[[servers.bench.routes]]
path = "/v1/chat/completions"
upstreams = [{ endpoint = { type = "uri", value = "http://127.0.0.1:$3/v1/chat/completions" } }]

[[servers.bench.routes]]
path = "/v1/models"
upstreams = [{ endpoint = { type = "uri", value = "http://127.0.0.1:$3/v1/models" } }]
CONF
}

# Append API-key auth and three stacked policies (key RPM, entity TPM, model concurrency) on the
# Redis backend to a Sluice config; limits set high enough never to reject. Needs BIN.
append_limits_config() { # file redis_port key
  cat >>"$1" <<TOML
[limits]
backend = "redis"
[limits.redis]
address = "127.0.0.1:$2"

[[keys]]
id = "bench"
sha256 = "$("$BIN/sluice" key hash "$3")"
entity = "bench-team"
tags = ["pro"]

[[policies]]
id = "key-rpm"
tags = ["pro"]
per = "key"
max_requests = 1000000000

[[policies]]
id = "entity-tpm"
entities = ["bench-team"]
per = "entity"
max_tokens = 1000000000000

[[policies]]
id = "model-concurrency"
models = ["*"]
per = "model"
max_concurrency = 100000
TOML
}

# Sluice with its AI pipeline on: the admin listener (metrics) and the access log (LOGDIR), and
# the limits above. Needs MOCK (see start_mock) and BIN.
write_sluice_ai_config() { # file redis_port key logdir
  write_sluice_config "$1" 1 "$4"
  append_limits_config "$1" "$2" "$3"
}

# ---- Used by the scale checks (sweep.sh, mixed.sh, cost_wrk.sh). ------------------------

# Start PROXY pinned to CORE, one worker, proxying to mock-llm (see start_mock): `sluice` (the
# default config), `sluice-ai` (write_sluice_ai_config; needs REDIS_PORT and KEY) or `nginx`.
# Sets PID[PROXY] and PORT[PROXY] (associative arrays the caller declares) and adds the PID to
# PIDS. SLUICE_BIN, when set, is the Sluice binary (default: $BIN/sluice); `sluice-base` and
# `sluice-ai-base` are the same two configs on BASE_BIN (another build, e.g. the commit before
# a change, to compare in the same rounds).
start_pinned_proxy() { # proxy core
  local proxy=$1 core=$2 bin=${SLUICE_BIN:-$BIN/sluice}
  case $proxy in
    sluice | sluice-ai | sluice-base | sluice-ai-base)
      if [ "${proxy%-base}" != "$proxy" ]; then
        bin=${BASE_BIN:?"$proxy needs BASE_BIN, the Sluice binary to compare with"}
      fi
      if [ "${proxy%-base}" = sluice ]; then
        write_sluice_config "$TMP/$proxy.toml" 0 ""
      else
        mkdir -p "$TMP/logs-$proxy"
        write_sluice_ai_config "$TMP/$proxy.toml" "$REDIS_PORT" "$KEY" "$TMP/logs-$proxy"
      fi
      taskset -c "$core" "$bin" --config "$TMP/$proxy.toml" >"$TMP/$proxy.log" 2>&1 &
      PID[$proxy]=$!
      PIDS+=($!)
      wait_line "$TMP/$proxy.log" "listening on"
      PORT[$proxy]=$(port_of "$TMP/$proxy.log")
      ;;
    nginx)
      PORT[$proxy]=$(free_port)
      write_nginx_config "$TMP/nginx" "${PORT[$proxy]}" "$MOCK"
      taskset -c "$core" nginx -p "$TMP/nginx" -c "$TMP/nginx/nginx.conf" >"$TMP/nginx.log" 2>&1 &
      PID[$proxy]=$!
      PIDS+=($!)
      wait_http "http://127.0.0.1:${PORT[$proxy]}/" "${PID[$proxy]}"
      ;;
    *) echo "unknown proxy $proxy" >&2; exit 1 ;;
  esac
}

# The cost rig with wrk as the client (bench/cost_wrk.sh, bench/kernel_work.sh): mock-llm, a
# redis-server and every proxy in PROXIES pinned to CORE, and wrk's request scripts, post.lua
# (BODY_BYTES chat POSTs, as write_post_lua writes them) and post-ai.lua (the same with
# sluice-ai's key; see lua_of); then a second of load warms each proxy. Sets MOCK, MOCK_PID, KEY,
# REDIS_PORT and the PID and PORT arrays.
start_wrk_rig() {
  start_mock
  MOCK_PID=${PIDS[-1]}
  write_post_lua "$TMP/post.lua" "$BODY_BYTES"
  KEY=sk-cost-wrk-1
  { cat "$TMP/post.lua"; echo "wrk.headers[\"Authorization\"] = \"Bearer $KEY\""; } >"$TMP/post-ai.lua"
  declare -gA PID PORT
  start_pinned_redis "$CORE"
  local proxy
  for proxy in $PROXIES; do start_pinned_proxy "$proxy" "$CORE"; done
  # Warm every proxy (pools, page tables) before the first measured run.
  for proxy in $PROXIES; do wrk_at "$proxy" 1 >/dev/null; done
}

# wrk's request script for a proxy of start_wrk_rig: the one with the key for sluice-ai (and
# sluice-ai-base).
lua_of() { case $1 in sluice-ai*) echo "$TMP/post-ai.lua" ;; *) echo "$TMP/post.lua" ;; esac; }

# One wrk run of the wrk cost rig: one thread on CORE, CONNS connections, for the given seconds,
# against the proxy's chat endpoint with its request script; prints wrk's report.
wrk_at() { # proxy seconds
  taskset -c "$CORE" wrk -t1 -c"$CONNS" -d"$2s" -s "$(lua_of "$1")" \
    "http://127.0.0.1:${PORT[$1]}/v1/chat/completions"
}

# Start redis-server pinned to CORE (nothing persisted) and wait until it answers; sets
# REDIS_PORT (for sluice-ai's limits) and adds the PID to PIDS.
start_pinned_redis() { # core
  REDIS_PORT=$(free_port)
  taskset -c "$1" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
    >"$TMP/redis.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done
}

# The start of a scale check's rig: the release binaries built (BIN), the open-file limit
# lifted to the hard one, CORE=1 (mock-llm's and the load generator's core), a scratch directory
# (init_scratch). With `nginx`: nginx-light installed when it is missing.
release_rig() { # [nginx]
  cargo build --release -q -p sluice -p sluice-bench
  BIN=target/release
  ulimit -n "$(ulimit -Hn)"
  CORE=1
  init_scratch
  if [ "${1:-}" = nginx ] && ! command -v nginx >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null
  fi
}

# A scratch directory (TMP) and an empty PIDS array, both cleaned up when the script exits:
# every process in PIDS is killed and TMP removed.
init_scratch() {
  TMP=$(mktemp -d)
  PIDS=()
  trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$TMP"' EXIT
}

# One counter from mock-llm's /_mock/stats (see start_mock), e.g. `requests`. Each call is
# itself a request to mock-llm (on a connection of its own).
mock_stat() { # name
  curl -s "http://127.0.0.1:$MOCK/_mock/stats" | python3 -c "import json,sys; print(json.load(sys.stdin)['$1'])"
}
