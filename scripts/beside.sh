#!/usr/bin/env bash
# `make test`: runs a command beside another and fails if either fails.
#
#   beside.sh "<background command>" <foreground command...>
#
# The background command (mypy, then the container image test: buildah copying file systems
# and pip installing wheels) writes to a file, printed once both have ended; the foreground
# one (the suite, whose workers mostly wait on the brokers and agent subprocesses) writes as
# usual. Side by side they take about as long as the suite alone, not the sum of both.
set -uo pipefail

background=$1
shift
output=$(mktemp "${TMPDIR:-/tmp}/queuekeeper-beside.XXXXXX")
trap 'rm -f "$output"' EXIT

# Each in a process group of its own, waited for with `wait` (which a signal interrupts),
# so an interrupted `make test` stops both and everything they started.
setsid bash -c "$background" >"$output" 2>&1 </dev/null &
pid=$!
setsid "$@" &
foreground=$!
trap 'kill -TERM -- "-$pid" "-$foreground" 2>/dev/null; exit 130' INT TERM
wait "$foreground"
foreground_status=$?
wait "$pid"
background_status=$?

printf '\n=== %s (ran beside: %s) exited %s ===\n' "$background" "$*" "$background_status"
cat "$output"
printf '=== end of %s ===\n' "$background"
if [ "$foreground_status" != 0 ] || [ "$background_status" != 0 ]; then
  printf 'beside.sh: %s exited %s, %s exited %s\n' \
    "$*" "$foreground_status" "$background" "$background_status" >&2
  exit 1
fi
