#!/usr/bin/env bash
# Build Sluice and mock-llm, start both with conf/sluice.toml, send one streaming and one
# non-streaming chat completion with curl, print them, and stop what was started.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -p sluice -p sluice-bench
bin=target/release
tmp=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

# The example config expects the upstream on 127.0.0.1:9000 and Sluice on 127.0.0.1:8080.
"$bin/mock-llm" --listen 127.0.0.1:9000 --ttft-ms 200 --inter-token-ms 80 --tokens 8 >"$tmp/mock.log" 2>&1 &
pids+=($!)
"$bin/sluice" --config conf/sluice.toml >"$tmp/sluice.log" 2>&1 &
pids+=($!)
for _ in $(seq 50); do
  grep -q "listening" "$tmp/sluice.log" 2>/dev/null && grep -q "listening" "$tmp/mock.log" 2>/dev/null && break
  sleep 0.1
done
cat "$tmp/sluice.log"

echo
echo "== non-streaming: POST /v1/chat/completions (model gpt-4o-mini, mapped to mock-small upstream)"
curl -sS http://127.0.0.1:8080/v1/chat/completions \
  -H 'content-type: application/json' -H 'authorization: Bearer sk-demo-pro' \
  -d '{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello"}]}'
echo
echo
echo "== streaming: the same request with \"stream\": true (events arrive as they are generated)"
curl -sSN http://127.0.0.1:8080/v1/chat/completions -H 'x-api-key: sk-demo-pro' \
  -H 'content-type: application/json' \
  -d '{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Say hello"}]}' \
  | grep -v '^: echo'
