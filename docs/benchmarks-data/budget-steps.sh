# Sourced by the device scripts beside it (a device run is capped at 10 minutes, and first-use
# kernel compilation makes a step's length hard to foresee). Before sourcing, set BUDGET (the
# run's seconds), started (its start, `date +%s`) and LOGS (the folder for the step logs).
#   step NAME CAP_SECONDS COMMAND...
# runs COMMAND for at most CAP seconds and never past what is left of BUDGET (a step with
# under 15 s left is skipped), its output in $LOGS/NAME.log, and prints the log's tail.
# ONLY (space-separated step names), when set, runs those steps and skips the rest: a short
# lease can take the one figure it needs from a PART, e.g. ONLY="wall-ar ncu-ar-graphs".

step() {
  local name=$1 cap=$2 left
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then echo "== $name: skipped (ONLY)"; return; fi
  left=$(( BUDGET - ($(date +%s) - started) ))
  if (( left < 15 )); then echo "== $name: skipped, the budget is spent"; return; fi
  (( cap > left )) && cap=$left
  echo "== $name (at most ${cap}s)"
  timeout --signal=INT --kill-after=10 "$cap" "$@" > "$LOGS/$name.log" 2>&1
  echo "== $name: exit $? after $(( $(date +%s) - started ))s in all"
  tail -n "${STEP_TAIL:-12}" "$LOGS/$name.log"
}
