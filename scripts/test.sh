#!/usr/bin/env bash
# Run Sluice's whole test suite on a fresh machine: scripts/setup.sh installs what the tests need
# (as root: apt-get and pip; idempotent), then scripts/suite.sh checks formatting and lints,
# builds the workspace (debug), runs the unit tests, then the black-box suite twice — once on
# io_uring, once on the epoll (legacy) driver.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
bash scripts/setup.sh
printf '== setup took %ds\n' $((SECONDS - started))
bash scripts/suite.sh
