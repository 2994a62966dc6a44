#!/usr/bin/env bash
# One line per stage of `make`: what it does and how long it took. The stage's own output goes to LOG and
# is shown (its last 40 lines) only when the stage fails, with its exit status.
#   scripts/stage.sh NAME LOG COMMAND...
set -uo pipefail
name=$1 log=$2
shift 2
mkdir -p "$(dirname "$log")"
printf '[make] %s ... ' "$name"
start=$SECONDS
if "$@" >"$log" 2>&1; then
  echo "done in $((SECONDS - start)) s"
else
  rc=$?
  echo "FAILED (exit $rc) after $((SECONDS - start)) s; the last lines of $log:"
  tail -n 40 "$log"
  exit "$rc"
fi
