#!/usr/bin/env bash
# User-space instructions per request of the whole running proxy, counted by callgrind while
# wrk drives real requests through it: the request logic, the runtime, the allocator and the
# copies together, as a number that does not move with the machine's noise (unlike the cost
# rig's µs, whose rounds on a shared VM spread wider than most single cuts).
#
#   bench/callgrind_proxy.sh                          # sluice plain, 10 s of load
#   CONFIGS="sluice sluice-ai" bench/callgrind_proxy.sh   # and with the AI pipeline
#   BASE_BIN=/tmp/sluice-before bench/callgrind_proxy.sh  # the build before a change, too
#
# For each config, Sluice (one worker) runs under `valgrind --tool=callgrind` twice: once with
# no load, once with SECS seconds of wrk (one thread, CONNS connections, BODY_BYTES chat
# POSTs). Per request = (instructions of the loaded run - those of the idle run) / the requests
# mock-llm served; the idle run takes away start-up, config load and shutdown. It prints that
# figure and the TOP functions by their own instructions per request (each less its count in the
# idle run). What a timer or background task spends over time is not taken away: the loaded run
# lasts longer than the idle one.
#
# What it does not count: the kernel (syscalls, TCP), and by default most of what waiting
# costs. Under callgrind the proxy runs ~50x slower than the client and mock-llm, so its reads
# nearly always find data and its writes room: few timers are armed and few tasks are parked.
# UPSTREAM_DELAY_MS=3 has mock-llm hold each answer that long (`x-mock-delay-ms`), so the
# read of every answer's head parks, with its timer, as it does at full speed; CLIENT_DELAY_MS=2
# has wrk pause that long before each connection's next request, so the proxy's wait for it
# parks too (a keep-alive connection's idle wait). The runtime is
# monoio's epoll driver (`MONOIO_FORCE_LEGACY_DRIVER=1`): valgrind does not treat a waiting
# `io_uring_enter` as a blocking call, and the io_uring worker stalls under it. Everything above
# the driver — parsing, routing, metering, the access log — runs the same code on both.
#
# Knobs: SECS (10), CONNS (8), BODY_BYTES (1024), UPSTREAM_DELAY_MS (0), CLIENT_DELAY_MS (0),
# MOCK_ECHO (unset; "none":
# answers without mock-llm's echo of the request, as large as a provider's), HEADS (unset;
# "provider": openai-python's request fields and a provider's answer fields), CONFIGS ("sluice";
# also "sluice-ai": API keys, three policies on a redis-server it starts, metrics and the
# access log), BASE_BIN (adds "<config>-base" runs of that binary), SLUICE_BIN (the build to
# measure, when not this tree's: to compare two saved builds, one change at a time), TOP (25),
# KEEP (a directory to keep the callgrind files in, for callgrind_annotate), SATURATION (1: the
# measured build's runs — not BASE_BIN's — get `[saturation]` and a `max_in_flight` cap on the
# route that the load never reaches: the wait queue configured but idle; SATURATION_CAP sets
# that cap — below CONNS, most requests wait in the queue for one of its places), QUEUE_COUNT
# (1, with SATURATION=1: an admin listener, and the count of requests that went through the
# queue; the listener turns on metering the answers' usage, so compare runs that both have it).
set -euo pipefail
cd "$(dirname "$0")/.."
export LC_ALL=C
: "${SECS:=10}" "${CONNS:=8}" "${BODY_BYTES:=1024}" "${CONFIGS:=sluice}" "${TOP:=25}"
: "${UPSTREAM_DELAY_MS:=0}" "${CLIENT_DELAY_MS:=0}"
[[ $UPSTREAM_DELAY_MS =~ ^[0-9]+$ ]] || { echo "UPSTREAM_DELAY_MS: whole milliseconds" >&2; exit 2; }
[[ $CLIENT_DELAY_MS =~ ^[0-9]+$ ]] || { echo "CLIENT_DELAY_MS: whole milliseconds" >&2; exit 2; }
for tool in valgrind wrk redis-server; do
  command -v "$tool" >/dev/null || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind wrk redis-server >/dev/null
    break
  }
done
cargo build --release -q -p sluice -p sluice-bench
BIN=target/release
CORE=$(python3 -c 'import os; print(sorted(os.sched_getaffinity(0))[0])')
. bench/lib.sh
init_scratch
start_mock
write_post_lua "$TMP/post.lua" "$BODY_BYTES"
if [ "$UPSTREAM_DELAY_MS" != 0 ]; then
  echo "wrk.headers[\"x-mock-delay-ms\"] = \"$UPSTREAM_DELAY_MS\"" >>"$TMP/post.lua"
fi
if [ "$CLIENT_DELAY_MS" != 0 ]; then
  echo "function delay() return $CLIENT_DELAY_MS end" >>"$TMP/post.lua"
fi
KEY=sk-callgrind-1
{ cat "$TMP/post.lua"; echo "wrk.headers[\"Authorization\"] = \"Bearer $KEY\""; } >"$TMP/post-ai.lua"
case " $CONFIGS " in *" sluice-ai "*) start_pinned_redis "$CORE" ;; esac

runs=()
for config in $CONFIGS; do
  runs+=("$config")
  [ -n "${BASE_BIN:-}" ] && runs+=("$config-base")
done

# One run under callgrind: config, binary, seconds of load (0: none), callgrind file. Sets
# SERVED (requests mock-llm served in the window) and IR (the run's instructions). Runs in this
# shell, not a subshell, so the valgrind'd proxy is in PIDS and a failure anywhere kills it.
measure() {
  local config=$1 bin=$2 secs=$3 out=$4 lua=$TMP/post.lua
  case $config in
    sluice) write_sluice_config "$TMP/$config.toml" 0 "" ;;
    sluice-ai)
      rm -rf "$TMP/logs" && mkdir -p "$TMP/logs"
      write_sluice_ai_config "$TMP/$config.toml" "$REDIS_PORT" "$KEY" "$TMP/logs"
      lua=$TMP/post-ai.lua
      ;;
    *) echo "callgrind_proxy.sh: unknown config $config (sluice, sluice-ai)" >&2; exit 1 ;;
  esac
  if [ "${SATURATION:-}" = 1 ] && [ "$bin" != "${BASE_BIN:-}" ]; then
    sed -i "s/^cluster = \"mock\"\$/groups = [{ targets = [{ cluster = \"mock\", max_in_flight = ${SATURATION_CAP:-100000} }] }]/" \
      "$TMP/$config.toml"
    printf '[saturation]\nclasses = [{ name = "interactive" }, { name = "batch" }]\n' >>"$TMP/$config.toml"
    # The plain config has no admin listener: one, to count the requests that waited.
    if [ "${QUEUE_COUNT:-}" = 1 ] && ! grep -q '^\[admin\]' "$TMP/$config.toml"; then
      printf '[admin]\nlisten = "127.0.0.1:0"\n' >>"$TMP/$config.toml"
    fi
  fi
  : >"$TMP/proxy.log"
  MONOIO_FORCE_LEGACY_DRIVER=1 valgrind --tool=callgrind --callgrind-out-file="$out" \
    "$bin" --config "$TMP/$config.toml" >"$TMP/proxy.log" 2>&1 &
  local vg=$!
  PIDS+=("$vg")
  # Start-up under callgrind takes seconds, not the tenths wait_line allows.
  for _ in $(seq 1200); do grep -q 'listening on' "$TMP/proxy.log" && break; sleep 0.1; done
  grep -q 'listening on' "$TMP/proxy.log" || { cat "$TMP/proxy.log" >&2; exit 1; }
  local port before after
  port=$(port_of "$TMP/proxy.log")
  # mock-llm does not count its /_mock/stats requests.
  before=$(mock_stat requests)
  if [ "$secs" != 0 ]; then
    wrk -t1 -c"$CONNS" -d"${secs}s" -s "$lua" "http://127.0.0.1:$port/v1/chat/completions" >"$TMP/wrk.txt"
    ! grep -q 'Non-2xx' "$TMP/wrk.txt" || { cat "$TMP/wrk.txt" >&2; exit 1; }
  fi
  after=$(mock_stat requests)
  if [ "${QUEUE_COUNT:-}" = 1 ] && [ "$bin" != "${BASE_BIN:-}" ]; then
    local admin
    admin=$(grep -o 'admin listening on [0-9.]*:[0-9]*' "$TMP/proxy.log" | sed 's/.*://')
    QUEUED=$(curl -s "http://127.0.0.1:$admin/metrics" |
      awk '/^sluice_queue_total\{.*outcome="dispatched"/ { n += $2 } END { print n + 0 }')
    echo "$config: $QUEUED requests went out of the wait queue" >&2
  fi
  kill -TERM "$vg"
  wait "$vg" || true
  SERVED=$((after - before))
  IR=$(grep -E '^(summary|totals):' "$out" | head -1 | awk '{print $2}')
}

# Instructions by function in a callgrind file, as "count<TAB>function" lines. callgrind_annotate
# names code inlined from another file (core's slices, std's time) by that file: the rows are
# summed by function.
by_function() { # callgrind file
  callgrind_annotate --threshold=100 "$1" 2>/dev/null |
    awk '
      /^-+$/ { rule++; next }
      rule == 6 && /^ *[0-9,]+ \(/ {
        ir = $1; gsub(",", "", ir)
        fn = $0; sub(/^ *[0-9,]+ \([ 0-9.]+%\) +/, "", fn); sub(/ \[[^]]*\]$/, "", fn)
        sub(/^[^:]*:/, "", fn)
        sum[fn] += ir
      }
      END { for (fn in sum) printf "%d\t%s\n", sum[fn], fn }'
}

DIR=${KEEP:-$TMP/cg}
mkdir -p "$DIR"
echo "callgrind, ${SECS}s of wrk, $CONNS connections, $BODY_BYTES-byte chat POSTs, answers held ${UPSTREAM_DELAY_MS} ms, requests ${CLIENT_DELAY_MS} ms apart${MOCK_ECHO:+, x-mock-echo: $MOCK_ECHO}${HEADS:+, $HEADS-sized heads}; $(git rev-parse --short HEAD)"
echo
echo "| run | requests | instructions / request |"
echo "| --- | ---: | ---: |"
for run in "${runs[@]}"; do
  config=${run%-base}
  bin=${SLUICE_BIN:-$BIN/sluice}
  [ "$config" != "$run" ] && bin=$BASE_BIN
  measure "$config" "$bin" 0 "$DIR/$run-idle.out"
  idle=$IR
  measure "$config" "$bin" "$SECS" "$DIR/$run.out"
  [ "$SERVED" -gt 0 ] || { echo "callgrind_proxy.sh: no requests served in $run" >&2; exit 1; }
  echo "| $run | $SERVED | $(( (IR - idle) / SERVED )) |"
  echo "$SERVED" >"$DIR/$run.requests"
done
for run in "${runs[@]}"; do
  requests=$(cat "$DIR/$run.requests")
  echo
  echo "$run: top $TOP functions by their own instructions per request (less the idle run's)"
  echo
  echo "| instructions / request | function |"
  echo "| ---: | --- |"
  by_function "$DIR/$run-idle.out" >"$DIR/$run-idle.tsv"
  by_function "$DIR/$run.out" |
    awk -F'\t' -v n="$requests" '
      NR == FNR { idle[$2] = $1; next }
      { printf "%d\t%s\n", ($1 - idle[$2]) / n, $2 }' "$DIR/$run-idle.tsv" - |
    sort -t"$(printf '\t')" -k1,1nr |
    awk -F'\t' -v top="$TOP" 'NR <= top { printf "| %d | `%s` |\n", $1, $2 }'
done
