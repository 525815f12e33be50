#!/usr/bin/env bash
# The soak (bench/soak.py): release binaries, then DURATION seconds (default 1800) of mixed load
# with a reload every 30 s and a Redis restart half-way; writes OUT (default /tmp/sluice-soak)
# /soak.json and /soak.svg and exits non-zero when memory or descriptors did not come back, an
# answered request has no access-log record (or two), or the Redis ledger's spend differs from
# what the access log billed.
#
#   bench/soak.sh                  # 30 minutes
#   DURATION=300 RATE=200 bench/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v redis-server >/dev/null || apt-get install -y -qq redis-server >/dev/null
cargo build --release -q -p sluice -p sluice-bench
exec python3 bench/soak.py
