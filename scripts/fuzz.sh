#!/usr/bin/env bash
# Run the fuzz targets (cargo-fuzz on a nightly toolchain), each for SECS seconds, and print
# each run's executions, coverage and corpus size. Each run starts from the committed seeds
# (fuzz/seeds/<target>/, minimised: one input per set of code edges) and grows a local corpus
# (fuzz/corpus/<target>/, not committed) with the inputs that reach new code; a crash is saved
# in fuzz/artifacts/<target>/ and the run stops — fix it, and add the input to the seeds (the
# test suite replays every seed).
#
#   scripts/fuzz.sh                  # every target, 10 minutes each
#   SECS=60 scripts/fuzz.sh sse      # one target, one minute
#   JOBS=2 scripts/fuzz.sh           # two targets at a time
#   MERGE=1 scripts/fuzz.sh sse      # after the run, add to the seeds only the local inputs
#                                    # that reach code the seeds do not (then commit them)
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${SECS:-600}
JOBS=${JOBS:-1}
if ! rustup toolchain list | grep -q '^nightly'; then
  echo "fuzz.sh: cargo-fuzz needs a nightly toolchain: rustup toolchain install nightly" >&2
  exit 1
fi
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(request_head chunked response_head sse json_inspect config translate)
(cd fuzz && cargo +nightly fuzz build -O "${targets[@]:0:1}" >/dev/null 2>&1 || true)
run() {
  local t=$1 log="fuzz/target/fuzz-$1.log"
  mkdir -p fuzz/target
  mkdir -p "fuzz/corpus/$t"
  if (cd fuzz && cargo +nightly fuzz run -O "$t" "corpus/$t" "seeds/$t" -- \
      -max_total_time="$SECS" -rss_limit_mb=2048 -print_final_stats=1) >"$log" 2>&1; then
    local done_line execs cov
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1)
    execs=$(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}')
    cov=$(echo "$done_line" | grep -oE 'cov: [0-9]+' | awk '{print $2}')
    echo "$t: ${SECS}s, ${execs:-?} executions, coverage ${cov:-?} edges, local corpus $(ls "fuzz/corpus/$t" | wc -l) files, no crash"
    [ "${MERGE:-0}" = 0 ] || merge "$t"
  else
    echo "$t: FAILED — see $log and fuzz/artifacts/$t/" >&2
    return 1
  fi
}
# Add to fuzz/seeds/T the inputs of fuzz/corpus/T that cover code edges the seeds do not
# (edges only: hit counts and comparison operands would keep thousands of near-duplicates).
merge() {
  local t=$1 before
  before=$(ls "fuzz/seeds/$t" | wc -l)
  (cd fuzz && "target/x86_64-unknown-linux-gnu/release/$t" -merge=1 -use_cmp=0 -use_counters=0 \
    -use_value_profile=0 -rss_limit_mb=2048 "seeds/$t" "corpus/$t") >"fuzz/target/merge-$t.log" 2>&1
  echo "$t: seeds $before -> $(ls "fuzz/seeds/$t" | wc -l) files"
}
status=0
running=0
for t in "${targets[@]}"; do
  run "$t" || status=1 &
  running=$((running + 1))
  if [ "$running" -ge "$JOBS" ]; then wait -n || status=1; running=$((running - 1)); fi
done
wait || status=1
exit $status
