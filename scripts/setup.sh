#!/usr/bin/env bash
# Install what Sluice's tests need on a fresh Debian-like machine, as root: cargo-nextest,
# clippy / rustfmt, Python packages (pip) and Debian packages (apt-get). Idempotent: whatever is
# already there is left alone, so a second run installs nothing and takes a second.
# scripts/test.sh runs it first; run it alone to prepare a machine.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }

if ! cargo nextest --version >/dev/null 2>&1; then
  log "installing cargo-nextest"
  cargo install cargo-nextest --locked
fi
if ! rustup component list --installed 2>/dev/null | grep -q '^clippy'; then
  rustup component add clippy rustfmt || true
fi
# pip as the machine has it; a Debian system Python refuses plain installs ("externally
# managed"), so fall back to --break-system-packages there.
pip_install() {
  python3 -m pip install --quiet "$@" || python3 -m pip install --quiet --break-system-packages "$@"
}
if ! python3 -c 'import prometheus_client' >/dev/null 2>&1; then
  log "installing prometheus_client (the metrics exposition test parses /metrics with it)"
  pip_install prometheus_client
fi
if ! python3 -c "import google.protobuf, grpc_tools.protoc" >/dev/null 2>&1; then
  log "installing python protobuf + grpcio-tools (the access-log test decodes with them)"
  pip_install protobuf grpcio-tools
fi
if ! python3 -c 'import openai' >/dev/null 2>&1; then
  log "installing openai (the README's Python example runs in tests/it/readme.rs)"
  pip_install openai
fi
if ! python3 -c 'import anthropic' >/dev/null 2>&1; then
  log "installing anthropic (tests/it/anthropic_endpoint.rs runs the official SDK through Sluice)"
  pip_install anthropic
fi
if ! command -v curl >/dev/null 2>&1; then
  log "installing curl (the README's and the demo's requests)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends curl >/dev/null
fi
if ! command -v promtool >/dev/null 2>&1; then
  log "installing promtool (Debian package prometheus): validates the alert rules and /metrics"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
if ! command -v redis-server >/dev/null 2>&1; then
  log "installing redis-server (Debian package): the harness runs a real one for the sync backend's tests"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
fi

if ! command -v systemd-analyze >/dev/null 2>&1; then
  log "installing systemd (Debian package, ~6 MB): systemd-analyze verify checks conf/sluice.service"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd >/dev/null
fi

if ! command -v nginx >/dev/null 2>&1 || ! command -v haproxy >/dev/null 2>&1; then
  log "installing nginx-light and haproxy (Debian packages): the comparison kit's smoke test runs bench/compare.sh --quick against them"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light haproxy >/dev/null
fi
