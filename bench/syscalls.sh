#!/usr/bin/env bash
# Syscalls a proxy makes per request: `strace -c -f` attached to the proxy for STRACE_SECS (3)
# seconds while wrk (one thread, CONNS keep-alive connections, 1 KB chat POSTs) drives it through
# mock-llm, all on CORE; the requests mock-llm served in that window divide the counts. strace
# slows every syscall, so the rate is far below the cost rig's and batching differs from it: read
# the counts per request, not the times.
#
#   bench/syscalls.sh                 # Sluice plain (PROXY=sluice)
#   PROXY=nginx bench/syscalls.sh     # nginx, same rig
set -euo pipefail
cd "$(dirname "$0")/.."
: "${PROXY:=sluice}" "${CORE:=0}" "${CONNS:=32}" "${STRACE_SECS:=3}"
case $PROXY in sluice | nginx) ;; *) echo "PROXY: sluice or nginx" >&2; exit 2 ;; esac
for tool in wrk strace nginx curl; do
  command -v "$tool" >/dev/null || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk strace nginx-light curl >/dev/null
    break
  }
done
cargo build --release -q -p sluice -p sluice-bench
BIN=target/release
. bench/lib.sh
init_scratch
start_mock
declare -A PID PORT
start_pinned_proxy "$PROXY" "$CORE"
write_post_lua "$TMP/post.lua" 1024
served() {
  curl -s "http://127.0.0.1:$MOCK/_mock/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["requests"])'
}
taskset -c "$CORE" wrk -t1 -c"$CONNS" -d"$((STRACE_SECS + 5))s" -s "$TMP/post.lua" \
  "http://127.0.0.1:${PORT[$PROXY]}/v1/chat/completions" >"$TMP/wrk.txt" &
WRK=$!
PIDS+=("$WRK")
sleep 2
before=$(served)
timeout "$STRACE_SECS" strace -f -c -p "${PID[$PROXY]}" -o "$TMP/strace.txt" 2>/dev/null || true
after=$(served)
wait "$WRK" || true
requests=$((after - before))
[ "$requests" -gt 0 ] || { echo "syscalls.sh: no requests served while traced" >&2; exit 1; }
echo "$PROXY: $requests requests in ${STRACE_SECS}s under strace, $CONNS connections; $(git rev-parse --short HEAD)"
echo
echo "| syscall | calls | per request |"
echo "| --- | ---: | ---: |"
awk -v n="$requests" '$1 ~ /^[0-9.]+$/ && NF >= 5 && $NF != "total" {
    name = $NF; calls = $4
    printf "| %s | %d | %.2f |\n", name, calls, calls / n; total += calls
  }
  END { printf "| all | %d | %.2f |\n", total, total / n }' "$TMP/strace.txt"
