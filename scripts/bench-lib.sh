# Shared pieces of the benchmark scripts; sourced, not run. Expects TMP, BIN, CORE and a PIDS
# array in the caller.

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

# A wrk script POSTing exactly 1,024 bytes of chat-completions JSON.
write_post_lua() { # file
  python3 - "$1" <<'PY'
import json, sys
base = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": ""}]})
body = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "x" * (1024 - len(base))}]})
assert len(body) == 1024, len(body)
open(sys.argv[1], "w").write(
    'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\nwrk.body = [[' + body + ']]\n'
)
PY
}
