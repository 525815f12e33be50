#!/usr/bin/env bash
# The A/B of two builds lives with the rest of the benchmarking, in bench/ab.sh; this path is
# kept because the team's standards name it. Same arguments and environment.
exec "$(dirname "$0")/../bench/ab.sh" "$@"
