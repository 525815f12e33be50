#!/usr/bin/env bash
# Sluice's test suite, on a machine scripts/setup.sh prepared: formatting and lints, the
# workspace built (debug), the unit tests and the black-box suite on io_uring, then the
# black-box suite again on the epoll (legacy) driver. Each part says how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }
part_started=$SECONDS
took() { printf '== %s took %ds\n' "$1" $((SECONDS - part_started)); part_started=$SECONDS; }

log "format and lints"
cargo fmt --all -- --check
# The benchmark fixture and the callgrind driver need the `bench` feature; the library alone,
# without it, is where an item nothing uses is an error (the fixture would hide some).
cargo clippy --workspace --all-targets --features sluice/bench -- -D warnings
cargo clippy -p sluice --lib --bins -- -D warnings
took "format and lints"

log "build"
cargo build --workspace
took "build"

log "unit tests + black-box suite (io_uring driver)"
cargo nextest run --workspace --no-fail-fast
took "unit tests + black-box suite (io_uring)"

log "black-box suite again on the epoll (legacy) driver"
# The same package selection as above (`--workspace`, filtered to the black-box tests): with
# `-p sluice-tests` cargo unifies features differently and rebuilds sluice and its JSON crates
# (~35 s here) for nothing.
SLUICE_TEST_DRIVER=legacy cargo nextest run --workspace -E 'package(sluice-tests)' --no-fail-fast
took "black-box suite (epoll)"
