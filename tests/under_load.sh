#!/usr/bin/env bash
# `make test-under-load`: run the command given (the suite) beside two CPU-bound processes, as on a busy
# machine. Each is a shell busy loop that also stops by itself once this script is gone (even if killed).
set -uo pipefail
hogs=()
for _ in 1 2; do
  (while kill -0 $$ 2>/dev/null; do :; done) &
  hogs+=($!)
done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
"$@"
