#!/usr/bin/env bash
# The side-by-side comparison kit: Sluice against nginx, haproxy and monolake (and the direct
# path, no proxy, as the floor), all proxying to the same mock-llm, on this machine.
#
#   bench/compare.sh            # full run, ~20–30 min on a 2-core machine; writes the marked
#                               # block of perf/RESULTS.md, perf/charts/*.svg, perf/raw/
#   bench/compare.sh --quick    # ~1 min smoke run (the test suite runs it); writes $OUT, or a
#                               # new temp dir, never perf/
#
# What it does:
#   - installs what is missing: nginx (Debian nginx-light), haproxy, redis-server (apt), and
#     monolake 0.3.0 (built from crates.io, with one `if let` chain un-chained for Rust ≥ 1.88;
#     a full run only — --quick notes it as not run when it is missing);
#   - starts every proxy once with one worker, upstream keep-alive, no access log, no response
#     buffering: nginx, haproxy, monolake, Sluice plain (default config) and Sluice "ai" (API-key
#     auth, three stacked policies on the Redis backend, admin metrics, protobuf access log);
#   - cost rig: sluice-load, mock-llm and the proxy all on core A; closed loop; req/s and the
#     proxy's CPU µs per request (utime+stime from /proc/PID/stat over the requests mock-llm
#     served); core B must stay idle;
#   - latency rig: the proxy alone on core A, sluice-load + mock-llm on core B (mock-llm on core C
#     when CORE_C names a third core); nginx's closed-loop
#     capacity in this layout, then open loop at LEVELS % of it, p50 / p99 / p99.9; core A must
#     run nothing but the proxy;
#   - scenarios: 1 KB chat POST, 64 KB prompt, SSE streams (64 events 20 ms apart) at 1 / 100 /
#     1,000 concurrent streams, 10,000 idle keep-alive connections (RSS);
#   - rounds interleave the proxies (A B C A B C …); the report gives medians, ratios to nginx
#     per round (median, min–max), and flags runs whose idle core was busy.
#
# Settings (environment; defaults for a full run, then --quick):
#   BIN_DIR       directory with sluice, mock-llm, sluice-load, sluice-probe (also SLUICE_BIN_DIR).
#                 Unset: target/release, built first with cargo build --release.
#   OUT           write RESULTS.md, charts/ and raw/ here instead of perf/ (--quick: a temp dir)
#   PROXIES       "direct nginx haproxy monolake sluice sluice-ai"
#   SCENARIOS     "small large sse idle"           LAT_SCENARIOS "small" (which get the latency rig)
#   ROUNDS 5 / 1  DURATION 5 / 1  WARMUP 0.5 / 0.2  CONNS 32 / 8      (cost rig, capacity runs)
#   LEVELS "25 50 75 90"  CAP_RUNS 3 / 1  LAT_DURATION 3 / 0.5  LAT_WARMUP 0.5 / 0.1  LAT_CONNS 64 / 8
#   SSE_CONCS "1 100 1000" / "1 10"  SSE_TOKENS 64 / 16  SSE_GAP_MS 20 / 10  SSE_DURATION 5 / 1
#   IDLE_CONNS 10000 / 1000  IDLE_HOLD 3 / 1   SMALL_BYTES 1024  LARGE_BYTES 65536
#   CORE_A, CORE_B  the two cores (default: the first two this process may run on)
#   CORE_C        mock-llm's (and redis-server's) core in the latency rig (default: CORE_B); a
#                 third core leaves core B to the client, whose busy share the report gives
#   IDLE_MAX_PCT 10  (busier than this, a should-be-idle core flags the run as disturbed)
#   HEADS=provider   heads of real traffic's size in the cost and latency rigs: openai-python's
#                    request fields, and mock-llm answering with a provider's (bench/lib.sh)
#   NO_INSTALL=1     never install anything; a missing nginx/haproxy is then an error
#   KEEP_TMP=1       keep the scratch directory (configs, logs, Sluice's access log)
#   MONOLAKE_BIN     a monolake binary to use (else monolake on PATH or in ~/.cargo/bin, else built)
#   MONOLAKE_TOOLCHAIN  e.g. +1.87.0: the rustup toolchain to build monolake with
set -euo pipefail
cd "$(dirname "$0")/.."
KIT_ROOT=$PWD
export LC_ALL=C

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "compare.sh: $*" >&2; exit 1; }

QUICK=0
for arg in "$@"; do
  case $arg in
    --quick) QUICK=1 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument $arg (see --help)" ;;
  esac
done

# The exact command, with the settings given in the environment.
KNOBS="BIN_DIR SLUICE_BIN_DIR OUT MONOLAKE_BIN MONOLAKE_VERSION MONOLAKE_TOOLCHAIN PROXIES SCENARIOS LAT_SCENARIOS ROUNDS DURATION WARMUP CONNS
LEVELS CAP_RUNS LAT_DURATION LAT_WARMUP LAT_CONNS SSE_CONCS SSE_TOKENS SSE_GAP_MS SSE_DURATION
SSE_WARMUP IDLE_CONNS IDLE_HOLD SMALL_BYTES LARGE_BYTES CORE_A CORE_B CORE_C IDLE_MAX_PCT HEADS NO_INSTALL"
COMMAND=""
for k in $KNOBS; do
  if [ -n "${!k+x}" ]; then
    v=${!k}
    [[ $v =~ [[:space:]] ]] && v="'$v'"
    COMMAND+="$k=$v "
  fi
done
COMMAND+="bench/compare.sh${*:+ $*}"

if [ "$QUICK" = 1 ]; then
  : "${ROUNDS:=1}" "${DURATION:=1}" "${WARMUP:=0.2}" "${CONNS:=8}" "${CAP_RUNS:=1}"
  : "${LAT_DURATION:=0.5}" "${LAT_WARMUP:=0.1}" "${LAT_CONNS:=8}"
  : "${SSE_CONCS:=1 10}" "${SSE_TOKENS:=16}" "${SSE_GAP_MS:=10}" "${SSE_DURATION:=1}"
  : "${IDLE_CONNS:=1000}" "${IDLE_HOLD:=1}"
else
  : "${ROUNDS:=5}" "${DURATION:=5}" "${WARMUP:=0.5}" "${CONNS:=32}" "${CAP_RUNS:=3}"
  : "${LAT_DURATION:=3}" "${LAT_WARMUP:=0.5}" "${LAT_CONNS:=64}"
  : "${SSE_CONCS:=1 100 1000}" "${SSE_TOKENS:=64}" "${SSE_GAP_MS:=20}" "${SSE_DURATION:=5}"
  : "${IDLE_CONNS:=10000}" "${IDLE_HOLD:=3}"
fi
: "${PROXIES:=direct nginx haproxy monolake sluice sluice-ai}"
: "${SCENARIOS:=small large sse idle}" "${LAT_SCENARIOS:=small}" "${LEVELS:=25 50 75 90}"
: "${SMALL_BYTES:=1024}" "${LARGE_BYTES:=65536}" "${IDLE_MAX_PCT:=10}" "${NO_INSTALL:=0}"
# One stream lasts about SSE_TOKENS × SSE_GAP_MS; the warm-up lets every connection finish one.
: "${SSE_WARMUP:=$(awk -v t="$SSE_TOKENS" -v g="$SSE_GAP_MS" 'BEGIN {printf "%.2f", t * g * 1.05 / 1000 + 0.2}')}"

want() { [[ " $PROXIES " == *" $1 "* ]]; }
has_scenario() { [[ " $SCENARIOS " == *" $1 "* ]]; }
declare -A NOTES=()
drop_proxy() { # name reason
  NOTES[$1]="not run ($2)"
  echo "compare.sh: $1: not run ($2)" >&2
  PROXIES=$(echo " $PROXIES " | sed "s/ $1 / /; s/^ *//; s/ *$//")
}
ALL_PROXIES=$PROXIES

# --- where things go -----------------------------------------------------------------------------
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)
  RESULTS=$OUT/RESULTS.md CHARTS=$OUT/charts RAW=$OUT/raw CHARTS_REL=charts RAW_REL=raw
elif [ "$QUICK" = 1 ]; then
  OUT=$(mktemp -d "${TMPDIR:-/tmp}/sluice-bench-quick.XXXXXX")
  RESULTS=$OUT/RESULTS.md CHARTS=$OUT/charts RAW=$OUT/raw CHARTS_REL=charts RAW_REL=raw
else
  RESULTS=perf/RESULTS.md CHARTS=perf/charts RAW=perf/raw CHARTS_REL=charts RAW_REL=raw
fi
rm -rf "$RAW"
mkdir -p "$RAW" "$CHARTS"
# Only the charts this kit writes: perf/charts also holds other scripts' (bench/soak.sh).
rm -f "$CHARTS"/{cost,latency,frontier,p99-vs-load,sse-gap}-*.svg
# perf/raw holds megabytes of histograms: never commit it.
[ "$RAW" = perf/raw ] && printf '*\n' >"$RAW/.gitignore"

# --- what it needs -------------------------------------------------------------------------------
need() { command -v "$1" >/dev/null 2>&1; }
APT_UPDATED=0
apt_install() { # package...
  [ "$NO_INSTALL" = 1 ] && return 1
  [ "$(id -u)" = 0 ] || { echo "compare.sh: not root, cannot apt-get install $*" >&2; return 1; }
  echo "== installing $* (Debian packages)"
  if [ "$APT_UPDATED" = 0 ]; then
    apt-get update -qq >>"$RAW/install.log" 2>&1 || return 1
    APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
    >>"$RAW/install.log" 2>&1
}
need curl || apt_install curl || die "curl is missing and could not be installed"
need taskset || apt_install util-linux || die "taskset is missing and could not be installed"
if want nginx && ! need nginx; then
  apt_install nginx-light || die "nginx is missing and could not be installed (apt-get install nginx-light; see $RAW/install.log). scripts/test.sh installs it."
fi
if want haproxy && ! need haproxy; then
  apt_install haproxy || die "haproxy is missing and could not be installed (apt-get install haproxy; see $RAW/install.log). scripts/test.sh installs it."
fi
if want sluice-ai && ! need redis-server; then
  apt_install redis-server || drop_proxy sluice-ai "redis-server is missing and could not be installed"
fi
want nginx || die "nginx must be in PROXIES: every ratio is against it"
MONOLAKE=${MONOLAKE_BIN:-}
MONOLAKE_VERSION=${MONOLAKE_VERSION:-0.3.0}
# monolake 0.3.0 is its only release. Its monolake-services 0.3.2 chains `let`s in edition 2021
# (src/http/util.rs), which Rust 1.88 and later refuse whatever the feature flags; it also needs
# nightly features (impl_trait_in_assoc_type), which RUSTC_BOOTSTRAP=1 lets a stable compiler
# accept. With a compiler that new, the kit builds the crates.io sources with that one `if`
# un-chained (bench/monolake-services-0.3.2-let-chains.patch: same behaviour, nested `if let`);
# with an older one (or MONOLAKE_TOOLCHAIN=+1.87.0) it runs `cargo install` unchanged.
CRATES_DL=${CRATES_DL:-https://static.crates.io/crates}
monolake_install() {
  local tc=${MONOLAKE_TOOLCHAIN:-} minor src log=$RAW/monolake-install.log
  # Its default TLS feature links OpenSSL.
  pkg-config --exists openssl 2>/dev/null || apt_install pkg-config libssl-dev || true
  minor=$(rustc ${tc:+"$tc"} --version | sed -n 's/^rustc 1\.\([0-9]*\).*/\1/p')
  if [ "${minor:-0}" -lt 88 ] || [ "$MONOLAKE_VERSION" != 0.3.0 ]; then
    echo "== installing monolake: cargo ${tc:+$tc }install monolake --version $MONOLAKE_VERSION (builds for several minutes)"
    if RUSTC_BOOTSTRAP=1 cargo ${tc:+"$tc"} install monolake --version "$MONOLAKE_VERSION" >"$log" 2>&1; then
      MONOLAKE=$HOME/.cargo/bin/monolake
      return 0
    fi
    MONOLAKE_WHY="\`cargo install monolake --version $MONOLAKE_VERSION\` failed: $({ grep -m 1 '^error' "$log" || true; } | cut -c1-200)"
    return 1
  fi
  echo "== installing monolake 0.3.0 from crates.io with monolake-services 0.3.2 patched for $(rustc --version | cut -d' ' -f1-2) (builds for ~4 minutes)"
  src=$(mktemp -d "${TMPDIR:-/tmp}/monolake-src.XXXXXX")
  # (`set -e` does not apply inside an `if` condition, hence the && chain.)
  if (
    cd "$src" &&
      curl -fsSL "$CRATES_DL/monolake/monolake-0.3.0.crate" | tar xz &&
      curl -fsSL "$CRATES_DL/monolake-services/monolake-services-0.3.2.crate" | tar xz &&
      (cd monolake-services-0.3.2 && git apply "$KIT_ROOT/bench/monolake-services-0.3.2-let-chains.patch") &&
      printf '\n[patch.crates-io]\nmonolake-services = { path = "../monolake-services-0.3.2" }\n' \
        >>monolake-0.3.0/Cargo.toml &&
      RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR="$src/target" cargo install --path monolake-0.3.0
  ) >"$log" 2>&1; then
    rm -rf "$src"
    MONOLAKE=$HOME/.cargo/bin/monolake
    return 0
  fi
  rm -rf "$src"
  MONOLAKE_WHY="building monolake 0.3.0 from crates.io failed: $({ grep -m 1 '^error' "$log" || tail -n 1 "$log"; } | cut -c1-200) (log: $log)"
  return 1
}
if want monolake; then
  [ -n "$MONOLAKE" ] || MONOLAKE=$(command -v monolake || true)
  [ -n "$MONOLAKE" ] || [ ! -x "$HOME/.cargo/bin/monolake" ] || MONOLAKE=$HOME/.cargo/bin/monolake
  if [ -z "$MONOLAKE" ]; then
    if [ "$QUICK" = 1 ]; then
      drop_proxy monolake "not installed; --quick never builds it (a full run tries \`cargo install monolake\`)"
    elif [ "$NO_INSTALL" = 1 ]; then
      drop_proxy monolake "not installed, and NO_INSTALL=1"
    elif ! monolake_install; then
      drop_proxy monolake "$MONOLAKE_WHY"
    fi
  fi
fi

if [ -z "${BIN_DIR:-}" ] && [ -n "${SLUICE_BIN_DIR:-}" ]; then BIN_DIR=$SLUICE_BIN_DIR; fi
# The revision the report names is the tree's as the binaries are built: an edit made while the
# run goes on (it takes half an hour) is not in what was measured.
SLUICE_REV=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD -- core bench proto 2>/dev/null || SLUICE_REV+="+uncommitted"
if [ -z "${BIN_DIR:-}" ]; then
  echo "== building release binaries"
  cargo build --release -q -p sluice -p sluice-bench
  BIN_DIR=target/release
fi
BIN=$(cd "$BIN_DIR" && pwd) || die "BIN_DIR $BIN_DIR does not exist"
for b in sluice mock-llm sluice-load sluice-probe; do
  [ -x "$BIN/$b" ] || die "$BIN/$b is missing (cargo build -p sluice -p sluice-bench)"
done
BUILD=release
case $BIN in */debug) BUILD=debug ;; esac

# The two cores: A runs the proxy (and everything in the cost rig), B the client side.
read -r FIRST SECOND < <(python3 -c 'import os; c = sorted(os.sched_getaffinity(0)); print(c[0], c[1] if len(c) > 1 else -1)')
: "${CORE_A:=$FIRST}" "${CORE_B:=$SECOND}"
[ "$CORE_B" -ge 0 ] && [ "$CORE_A" != "$CORE_B" ] || die "needs two CPUs to pin to (this process may use only core $FIRST)"
: "${CORE_C:=$CORE_B}"
[ "$CORE_C" != "$CORE_A" ] || die "CORE_C ($CORE_C) is the proxy's core: the latency rig keeps core A to the proxy"

ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
NOFILE=$(ulimit -n)
MAXCONN=$((NOFILE > 65600 ? 65536 : NOFILE - 64))
# haproxy reserves two descriptors per connection (client and server side) against its limit.
HAPROXY_MAXCONN=$(((NOFILE - 200) / 2))
[ "$HAPROXY_MAXCONN" -le "$MAXCONN" ] || HAPROXY_MAXCONN=$MAXCONN
if [ "$IDLE_CONNS" -gt $((MAXCONN - 200)) ]; then
  echo "compare.sh: open-file limit $NOFILE: idle connections reduced from $IDLE_CONNS" >&2
  IDLE_CONNS=$((MAXCONN - 200))
fi

# --- processes -----------------------------------------------------------------------------------
TMP=$(mktemp -d "${TMPDIR:-/tmp}/sluice-bench.XXXXXX")
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for _ in $(seq 40); do
    local alive=0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.05
  done
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  # Keep the configs and the servers' own output with the raw data (not the access log).
  mkdir -p "$RAW/setup"
  cp "$TMP"/*.toml "$TMP"/*.cfg "$TMP"/*.log "$RAW/setup/" 2>/dev/null || true
  cp "$TMP/nginx/nginx.conf" "$TMP/nginx/error.log" "$RAW/setup/" 2>/dev/null || true
  if [ -n "${KEEP_TMP:-}" ]; then echo "kept $TMP" >&2; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

CORE=$CORE_A
. bench/lib.sh
# sluice-load's --header arguments for HEADS (none when unset).
HEAD_ARGS=()
HEAD_FIELDS=$(head_fields) || die "HEADS: provider, or unset"
while IFS= read -r field; do
  [ -z "$field" ] || HEAD_ARGS+=(--header "$field")
done <<<"$HEAD_FIELDS"

# Wait until FILE holds PATTERN, failing if PID exits first or after SECS.
wait_for_line() { # file pattern pid secs
  local end=$((SECONDS + $4))
  until grep -q "$2" "$1" 2>/dev/null; do
    kill -0 "$3" 2>/dev/null || { echo "process $3 exited; its output:" >&2; cat "$1" >&2; return 1; }
    [ "$SECONDS" -lt "$end" ] || { echo "timed out waiting for '$2' in $1" >&2; cat "$1" >&2; return 1; }
    sleep 0.05
  done
}

declare -A PORT_OF=() PID_OF=()
start_mock
MOCK_PID=${PIDS[-1]}
PORT_OF[direct]=$MOCK PID_OF[direct]=$MOCK_PID
echo "== mock-llm on port $MOCK"

REDIS_PID=""
if want sluice-ai; then
  REDIS_PORT=$(free_port)
  taskset -c "$CORE_A" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" \
    --appendonly no >"$TMP/redis.log" 2>&1 &
  REDIS_PID=$!
  PIDS+=("$REDIS_PID")
  for _ in $(seq 200); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done
  redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 || { cat "$TMP/redis.log" >&2; die "redis-server did not start"; }
fi

start_proxy() { # name port cmd...
  local name=$1 port=$2
  shift 2
  taskset -c "$CORE_A" "$@" >"$TMP/$name.log" 2>&1 &
  PIDS+=($!)
  PID_OF[$name]=$!
  PORT_OF[$name]=$port
}

if want nginx; then
  write_nginx_config "$TMP/nginx" "$(free_port)" "$MOCK" "$MAXCONN"
  port=$(sed -n 's/.*listen 127.0.0.1:\([0-9]*\).*/\1/p' "$TMP/nginx/nginx.conf")
  start_proxy nginx "$port" nginx -c "$TMP/nginx/nginx.conf" -p "$TMP/nginx"
fi
if want haproxy; then
  port=$(free_port)
  write_haproxy_config "$TMP/haproxy.cfg" "$port" "$MOCK" "$HAPROXY_MAXCONN"
  start_proxy haproxy "$port" haproxy -db -f "$TMP/haproxy.cfg"
fi
if want monolake; then
  port=$(free_port)
  write_monolake_config "$TMP/monolake.toml" "$port" "$MOCK"
  start_proxy monolake "$port" env RUST_LOG=warn "$MONOLAKE" --config "$TMP/monolake.toml"
fi
for name in sluice sluice-ai; do
  want "$name" || continue
  if [ "$name" = sluice ]; then
    write_sluice_config "$TMP/$name.toml" 0 ""
  else
    AI_KEY=sk-bench-kit-1
    mkdir -p "$TMP/accesslog"
    write_sluice_ai_config "$TMP/$name.toml" "$REDIS_PORT" "$AI_KEY" "$TMP/accesslog"
  fi
  taskset -c "$CORE_A" "$BIN/sluice" --config "$TMP/$name.toml" >"$TMP/$name.log" 2>&1 &
  PIDS+=($!)
  PID_OF[$name]=$!
  wait_for_line "$TMP/$name.log" listening "${PID_OF[$name]}" 60 || die "$name did not start"
  PORT_OF[$name]=$(port_of "$TMP/$name.log")
done

# Every target must answer a chat POST and a stream before it is measured.
check_target() { # name
  local name=$1 url="http://127.0.0.1:${PORT_OF[$1]}" auth=() body
  [ "$name" = sluice-ai ] && auth=(-H "Authorization: Bearer $AI_KEY")
  wait_http "$url/v1/models" "${PID_OF[$name]}" || return 1
  body=$(curl -s --max-time 10 "${auth[@]}" -H 'Content-Type: application/json' \
    -d '{"model":"mock-model","messages":[{"role":"user","content":"hi"}]}' \
    -w ' HTTP=%{http_code}' "$url/v1/chat/completions") || true
  [[ $body == *"HTTP=200" ]] || { echo "$name: chat POST answered: ${body: -300}" >&2; return 1; }
  body=$(curl -sN --max-time 10 "${auth[@]}" -H 'Content-Type: application/json' \
    -H 'x-mock-tokens: 3' \
    -d '{"model":"mock-model","stream":true,"messages":[{"role":"user","content":"hi"}]}' \
    "$url/v1/chat/completions") || true
  [[ $body == *"data: [DONE]"* ]] || { echo "$name: stream answered: ${body: -300}" >&2; return 1; }
}
for name in $PROXIES; do
  if ! check_target "$name"; then
    [ -f "$TMP/$name.log" ] && tail -n 20 "$TMP/$name.log" >&2
    if [ "$name" = monolake ]; then
      kill "${PID_OF[monolake]}" 2>/dev/null || true
      drop_proxy monolake "installed, but it did not proxy a chat POST and a stream with the kit's config"
    else
      die "$name does not work (see above)"
    fi
  fi
done
echo "== targets: $PROXIES (cores: proxy $CORE_A, client side $CORE_B; binaries: $BIN)"

# --- measurement ---------------------------------------------------------------------------------
# A JSON snapshot: the target's CPU ticks, mock-llm's and redis's, the target's RSS, the requests
# mock-llm served so far and every core's /proc/stat counters.
snapshot() { # target_pid
  local t=$EPOCHREALTIME cpus req redis=0
  cpus=$(awk '/^cpu[0-9]/ {printf "%s\"%s\":[%s,%s,%s,%s,%s,%s,%s,%s]", n++ ? "," : "", substr($1, 4), $2, $3, $4, $5, $6, $7, $8, $9}' /proc/stat)
  req=$(curl -s --max-time 5 "http://127.0.0.1:$MOCK/_mock/stats" | sed -n 's/.*"requests":\([0-9]*\).*/\1/p')
  [ -n "$REDIS_PID" ] && redis=$(proc_ticks "$REDIS_PID")
  printf '{"t":%s,"target":%s,"mock":%s,"redis":%s,"rss_kib":%s,"mock_requests":%s,"cpus":{%s},"t_end":%s}' \
    "$t" "$(proc_ticks "$1")" "$(proc_ticks "$MOCK_PID")" "$redis" "$(rss_kib "$1")" "${req:-0}" "$cpus" "$EPOCHREALTIME"
}

# Put mock-llm (and redis) where the rig wants them: with the proxy, or with the client.
set_rig() { # cost|latency
  local core=$CORE_A
  [ "$1" = latency ] && core=$CORE_C
  taskset -a -p -c "$core" "$MOCK_PID" >/dev/null
  [ -z "$REDIS_PID" ] || taskset -a -p -c "$core" "$REDIS_PID" >/dev/null
}

RUN_N=0
# One sluice-load run against PROXY, recorded in runs.jsonl with the snapshots around it.
measure() { # scenario rig round proxy level conc -- sluice-load args...
  local scenario=$1 rig=$2 round=$3 proxy=$4 level=$5 conc=$6 id core pid pre post key=()
  shift 7
  RUN_N=$((RUN_N + 1))
  id=$(printf '%04d-%s-%s-%s-r%s' "$RUN_N" "$scenario" "$rig" "$proxy" "$round")
  [ "$level" = 0 ] || id+="-l$level"
  [ "$scenario" != sse ] || id+="-c$conc"
  core=$CORE_A
  [ "$rig" = cost ] || core=$CORE_B
  pid=${PID_OF[$proxy]}
  [ "$proxy" = sluice-ai ] && key=(--keys "$AI_KEY")
  pre=$(snapshot "$pid")
  if ! taskset -c "$core" "$BIN/sluice-load" --url "http://127.0.0.1:${PORT_OF[$proxy]}/v1/chat/completions" \
    "${key[@]}" "$@" --json "$RAW/$id.json" >"$RAW/$id.txt" 2>"$RAW/$id.err"; then
    cat "$RAW/$id.err" >&2
    die "sluice-load failed in run $id"
  fi
  post=$(snapshot "$pid")
  printf '{"id":"%s","scenario":"%s","rig":"%s","round":%s,"proxy":"%s","level":%s,"conc":%s,"pre":%s,"post":%s}\n' \
    "$id" "$scenario" "$rig" "$round" "$proxy" "$level" "$conc" "$pre" "$post" >>"$RAW/runs.jsonl"
  printf '  %-44s %s\n' "$id" "$(sed -n 's/^ *requests *//p' "$RAW/$id.txt")"
}

# Untimed pass so pools, caches and page tables are warm before round 1.
warm() { # core sluice-load args...
  local core=$1 proxy key
  shift
  for proxy in $PROXIES; do
    key=()
    [ "$proxy" = sluice-ai ] && key=(--keys "$AI_KEY")
    taskset -c "$core" "$BIN/sluice-load" --url "http://127.0.0.1:${PORT_OF[$proxy]}/v1/chat/completions" \
      "${key[@]}" "$@" >/dev/null 2>&1 || true
  done
}

cost_scenario() { # name body_bytes
  echo "== cost rig, $1 ($2-byte body): everything on core $CORE_A, $ROUNDS round(s)"
  set_rig cost
  warm "$CORE_A" --connections "$CONNS" --duration "${WARMUP}s" --body-bytes "$2" "${HEAD_ARGS[@]}"
  for r in $(seq "$ROUNDS"); do
    for proxy in $PROXIES; do
      measure "$1" cost "$r" "$proxy" 0 "$CONNS" -- --connections "$CONNS" \
        --duration "${DURATION}s" --warmup "${WARMUP}s" --body-bytes "$2" "${HEAD_ARGS[@]}"
    done
  done
}

declare -A CAPACITY=()
latency_scenario() { # name body_bytes
  echo "== latency rig, $1 ($2-byte body): proxy on core $CORE_A, client on core $CORE_B, mock-llm on core $CORE_C"
  set_rig latency
  warm "$CORE_B" --connections "$CONNS" --duration "${WARMUP}s" --body-bytes "$2" "${HEAD_ARGS[@]}"
  local caps=() cap rate
  for i in $(seq "$CAP_RUNS"); do
    measure "$1" capacity "$i" nginx 0 "$CONNS" -- --connections "$CONNS" \
      --duration "${DURATION}s" --warmup "${WARMUP}s" --body-bytes "$2" "${HEAD_ARGS[@]}"
    caps+=("$RAW/$(printf '%04d' "$RUN_N")-$1-capacity-nginx-r$i.json")
  done
  cap=$(python3 bench/report.py capacity "${caps[@]}")
  [ "$cap" -gt 0 ] || die "nginx served nothing in the capacity runs"
  CAPACITY[$1]=$cap
  echo "   nginx capacity in this layout: $cap req/s; open loop at $LEVELS %"
  for r in $(seq "$ROUNDS"); do
    for level in $LEVELS; do
      rate=$((cap * level / 100))
      [ "$rate" -gt 0 ] || rate=1
      for proxy in $PROXIES; do
        measure "$1" latency "$r" "$proxy" "$level" "$LAT_CONNS" -- --rate "$rate" \
          --connections "$LAT_CONNS" --duration "${LAT_DURATION}s" --warmup "${LAT_WARMUP}s" \
          --body-bytes "$2" "${HEAD_ARGS[@]}"
      done
    done
  done
}

sse_scenario() {
  echo "== SSE: $SSE_TOKENS events ${SSE_GAP_MS} ms apart at $SSE_CONCS concurrent streams (latency layout)"
  set_rig latency
  local hdr=(--header "x-mock-tokens: $SSE_TOKENS" --header "x-mock-inter-token-ms: $SSE_GAP_MS")
  local rate
  for r in $(seq "$ROUNDS"); do
    for c in $SSE_CONCS; do
      # Open loop at C streams per stream-length (plus 5%): about C streams in flight, staggered.
      rate=$(awk -v c="$c" -v t="$SSE_TOKENS" -v g="$SSE_GAP_MS" 'BEGIN {printf "%.3f", c / (t * g * 1.05 / 1000)}')
      for proxy in $PROXIES; do
        measure sse latency "$r" "$proxy" 0 "$c" -- --stream --rate "$rate" --connections "$c" \
          --duration "${SSE_DURATION}s" --warmup "${SSE_WARMUP}s" --body-bytes "$SMALL_BYTES" \
          --timeout 60s "${hdr[@]}"
      done
    done
  done
}

idle_scenario() {
  echo "== $IDLE_CONNS idle keep-alive connections: RSS"
  local proxy pid before during probe out n limit
  for proxy in $PROXIES; do
    case $proxy in
      direct) continue ;;
      # Its /v1/models needs the API key; the process is Sluice's, measured as "sluice".
      sluice-ai) continue ;;
    esac
    pid=${PID_OF[$proxy]}
    out=$RAW/idle-$proxy.txt
    n=$IDLE_CONNS limit=""
    if [ "$proxy" = haproxy ] && [ "$n" -gt $((HAPROXY_MAXCONN - 16)) ]; then
      n=$((HAPROXY_MAXCONN - 16))
      limit="haproxy reserves two file descriptors per connection: with this machine's open-file limit of $NOFILE it was offered $n"
    fi
    before=$(rss_kib "$pid")
    taskset -c "$CORE_B" "$BIN/sluice-probe" idle --addr "127.0.0.1:${PORT_OF[$proxy]}" \
      --conns "$n" --hold-secs "$IDLE_HOLD" >"$out" 2>&1 &
    probe=$!
    PIDS+=("$probe")
    if wait_for_line "$out" ready "$probe" 300; then
      during=$(rss_kib "$pid")
    else
      during=0
    fi
    wait "$probe" || echo "compare.sh: idle probe against $proxy failed: $(cat "$out")" >&2
    printf '{"proxy":"%s","conns":%s,"note":"%s","rss_before_kib":%s,"rss_during_kib":%s,"ready":%s,"still_open":%s}\n' \
      "$proxy" "$n" "$limit" "$before" "$during" "$(sed -n 's/^ready //p' "$out" | head -1 | grep . || echo 0)" \
      "$(sed -n 's/^still_open //p' "$out" | head -1 | grep . || echo 0)" >>"$RAW/idle.jsonl"
    echo "  $proxy: RSS $((before / 1024)) MiB -> $((during / 1024)) MiB; $(tr '\n' ' ' <"$out")"
  done
}

START=$SECONDS
has_scenario small && cost_scenario small "$SMALL_BYTES"
has_scenario large && cost_scenario large "$LARGE_BYTES"
for s in $LAT_SCENARIOS; do
  has_scenario "$s" || continue
  case $s in
    small) latency_scenario small "$SMALL_BYTES" ;;
    large) latency_scenario large "$LARGE_BYTES" ;;
    *) die "LAT_SCENARIOS: unknown scenario $s" ;;
  esac
done
has_scenario sse && sse_scenario
has_scenario idle && idle_scenario
echo "== measured in $((SECONDS - START)) s"

# --- report --------------------------------------------------------------------------------------
version_of() { "$@" 2>&1 | head -n 1 || true; }
for p in $ALL_PROXIES; do [ -n "${NOTES[$p]+x}" ] && export "NOTE_${p//-/_}=${NOTES[$p]}"; done
capacity_json=$(for k in "${!CAPACITY[@]}"; do printf '"%s":%s,' "$k" "${CAPACITY[$k]}"; done)
export B_COMMAND=$COMMAND B_QUICK=$QUICK B_BUILD=$BUILD B_CORE_A=$CORE_A B_CORE_B=$CORE_B B_CORE_C=$CORE_C \
  B_PROXIES=$PROXIES B_ALL=$ALL_PROXIES B_CAPACITY="{${capacity_json%,}}" \
  B_CHARTS_REL=$CHARTS_REL B_RAW_REL=$RAW_REL B_SLUICE=$SLUICE_REV \
  B_NGINX="$(version_of nginx -v | sed 's/^nginx version: //')" \
  B_HAPROXY="$(version_of haproxy -v | sed 's/ - https.*//; s/^HAProxy version /haproxy /')" \
  B_MONOLAKE="$([ -n "$MONOLAKE" ] && want monolake && { "$MONOLAKE" --version 2>&1 || true; } | grep -m 1 -o 'monolake [0-9][0-9.]*')" \
  B_REDIS="$(need redis-server && version_of redis-server --version | awk '{print "redis " $3}' | sed 's/v=//')" \
  B_RUSTC="$(version_of rustc --version)" \
  B_CPU="$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1)" \
  B_KNOB_NAMES="ROUNDS DURATION WARMUP CONNS CAP_RUNS LAT_DURATION LAT_WARMUP LAT_CONNS SSE_TOKENS SSE_GAP_MS SSE_DURATION IDLE_CONNS IDLE_HOLD SMALL_BYTES LARGE_BYTES IDLE_MAX_PCT"
for k in $B_KNOB_NAMES; do export "B_K_$k=${!k}"; done
python3 - "$RAW/meta.json" <<'PY'
import json, os, sys
e = os.environ
def env_list(s): return s.split()
def num(k):
    v = e["B_K_" + k]
    return float(v) if "." in v else int(v)
with open("/proc/meminfo") as f:
    mem = int(next(l for l in f if l.startswith("MemTotal")).split()[1]) / 1048576
all_proxies = env_list(e["B_ALL"])
notes = {p: e["NOTE_" + p.replace("-", "_")] for p in all_proxies if "NOTE_" + p.replace("-", "_") in e}
meta = {
    "command": e["B_COMMAND"], "quick": e["B_QUICK"] == "1", "build": e["B_BUILD"],
    "date": __import__("datetime").datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
    "kernel": os.uname().release, "cpu_model": e["B_CPU"] or "unknown CPU",
    "cpus": os.cpu_count(), "mem_gib": mem, "clk_tck": os.sysconf("SC_CLK_TCK"),
    "core_a": int(e["B_CORE_A"]), "core_b": int(e["B_CORE_B"]), "core_c": int(e["B_CORE_C"]),
    "proxies": env_list(e["B_PROXIES"]), "all_proxies": all_proxies, "notes": notes,
    "capacity": json.loads(e["B_CAPACITY"]),
    "charts_rel": e["B_CHARTS_REL"], "raw_rel": e["B_RAW_REL"],
    "versions": {"sluice": e["B_SLUICE"], "nginx": e["B_NGINX"], "haproxy": e["B_HAPROXY"],
                 "monolake": e["B_MONOLAKE"], "redis": e["B_REDIS"], "rustc": e["B_RUSTC"]},
    "setups": {
        "direct": "sluice-load straight at mock-llm (the floor; its CPU column is mock-llm's)",
        "nginx": "worker_processes 1, master_process off, access_log off, upstream keepalive 64, "
                 "proxy_http_version 1.1, proxy_buffering off, proxy_request_buffering off",
        "haproxy": "nbthread 1, mode http, http-reuse always, option http-no-delay (no "
                    "MSG_MORE coalescing of SSE events), no log directive",
        "monolake": "worker_threads 1 (io_uring), one route per path the kit sends, RUST_LOG=warn",
        "sluice": "workers = 1, default config otherwise (JSON validated, routed by model, "
                  "metering on; no keys, no limits, no access log)",
        "sluice-ai": "workers = 1 with API-key auth (Bearer), three stacked policies (key RPM, "
                     "entity TPM, model concurrency) on the Redis backend (redis-server on the "
                     "mock's core), the admin listener (/metrics) and the protobuf access log on",
    },
}
for k in e["B_KNOB_NAMES"].split():
    meta[k.lower()] = num(k)
with open(sys.argv[1], "w") as f:
    json.dump(meta, f, indent=1)
PY
python3 bench/report.py report --raw "$RAW" --results "$RESULTS" --charts "$CHARTS"
echo "== report: $RESULTS (charts in $CHARTS, raw runs in $RAW)"
