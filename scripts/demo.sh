#!/usr/bin/env bash
# Build Sluice and mock-llm, run them with the shipped conf/sluice.toml plus a throwaway API key
# made for this run, send a non-streaming and a streaming chat completion (and one without the
# key) with curl, print them, and stop what was started.
#
# Both servers bind free ports (port 0, read back from their startup lines), so the demo never
# talks to whatever else holds 8080 or 9000. Any failure stops it with a non-zero exit.
#
#   BIN_DIR=target/debug scripts/demo.sh   # use binaries you built (default: a release build)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${BIN_DIR:-}" ]]; then
  cargo build --release -p sluice -p sluice-bench
  BIN_DIR=target/release
fi
bin=$BIN_DIR
tmp=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

fail() {
  echo "demo: $*" >&2
  for f in "$tmp"/*.log; do [[ -s $f ]] && { echo "--- $f" >&2; cat "$f" >&2; }; done
  exit 1
}

# The address a server printed in its `... listening on ADDR` line (waits up to 10 s).
listening_addr() { # LOG PATTERN PID
  for _ in $(seq 100); do
    local addr
    addr=$(sed -n "s/^$2 \([0-9.:]*\).*/\1/p" "$1" | head -n1)
    [[ -n $addr ]] && { echo "$addr"; return 0; }
    kill -0 "$3" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

"$bin/mock-llm" --listen 127.0.0.1:0 --ttft-ms 200 --inter-token-ms 80 --tokens 8 >"$tmp/mock.log" 2>&1 &
pids+=($!)
upstream=$(listening_addr "$tmp/mock.log" "mock-llm listening on" "${pids[-1]}") ||
  fail "mock-llm did not start"

# A key for this run only: the config keeps its SHA-256, curl sends the key.
key_out=$("$bin/sluice" key new)
key=$(sed -n 's/^# key[^:]*: *//p' <<<"$key_out")
key_sha=$(sed -n 's/^sha256 = "\(.*\)"$/\1/p' <<<"$key_out")

# The shipped config with free ports and the mock's address, plus the key (tier "pro").
sed -e 's|^listen = "127.0.0.1:8080"|listen = "127.0.0.1:0"|' \
    -e 's|^listen = "127.0.0.1:9090"|listen = "127.0.0.1:0"|' \
    -e "s|http://127.0.0.1:9000/v1|http://$upstream/v1|" \
    conf/sluice.toml >"$tmp/demo.toml"
cat >>"$tmp/demo.toml" <<EOF

[[keys]]
id = "demo"
sha256 = "$key_sha"
entity = "acme"
tags = ["pro"]
EOF

"$bin/sluice" --config "$tmp/demo.toml" >"$tmp/sluice.log" 2>&1 &
pids+=($!)
addr=$(listening_addr "$tmp/sluice.log" "sluice: listening on" "${pids[-1]}") ||
  fail "sluice did not start"
cat "$tmp/sluice.log"
url="http://$addr/v1/chat/completions"

echo
echo "== non-streaming: POST /v1/chat/completions (model gpt-4o-mini, mapped to mock-small upstream)"
curl -sS --fail-with-body "$url" \
  -H 'content-type: application/json' -H "authorization: Bearer $key" \
  -d '{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello"}]}' ||
  fail "the non-streaming request failed"
echo
echo
echo "== streaming: the same request with \"stream\": true (events arrive as they are generated)"
curl -sSN --fail-with-body "$url" -H "x-api-key: $key" \
  -H 'content-type: application/json' \
  -d '{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Say hello"}]}' \
  >"$tmp/stream.out" || fail "the streaming request failed"
grep -v '^: echo' "$tmp/stream.out"
grep -q '^data: \[DONE\]' "$tmp/stream.out" || fail "the stream did not end with [DONE]"
echo
echo "== without a key: 401, an OpenAI-style error"
status=$(curl -sS -o "$tmp/nokey.out" -w '%{http_code}' "$url" \
  -H 'content-type: application/json' \
  -d '{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello"}]}')
cat "$tmp/nokey.out"
echo
[[ $status == 401 ]] || fail "a request without a key got $status, not 401"
