#!/usr/bin/env bash
# `mtplxctl tune` end to end on one machine: a real daemon serving the embedded model, depths
# 0-6 timed through its API, the report, the trace of the tune's own requests and the log.
# Writes under $OUT. On the H200: export PYTHONPATH=$PWD:/root/site first. Small sizes for a
# CPU check: MAX_TOKENS=16 REPEATS=1 DEPTHS=0-2 bash docs/benchmarks-data/tune-gpu.sh
set -euo pipefail
OUT=${OUT:-/tmp/tune-out}
MAX_TOKENS=${MAX_TOKENS:-256}
REPEATS=${REPEATS:-3}
DEPTHS=${DEPTHS:-0-6}
mkdir -p "$OUT"
if ! python3 -c "import trio, hypercorn, quart_trio, rich, psutil, tomli_w, keyring" 2>"$OUT/missing.txt"; then
  echo "tune-gpu: the daemon's own dependencies are not importable here:" >&2
  cat "$OUT/missing.txt" >&2
  exit 3
fi
MTPLX_HOME=$(mktemp -d)
export MTPLX_HOME MTPLX_PORT=0
trap 'python3 -m mtplxctl stop >/dev/null 2>&1 || true; cp "$MTPLX_HOME/logs/mtplxd.log" "$OUT/mtplxd.log" 2>/dev/null || true' EXIT
python3 -m mtplxctl start --json > "$OUT/start.json"
python3 -m mtplxctl status --json > "$OUT/status.json"
COLUMNS=100 python3 -m mtplxctl tune --depths "$DEPTHS" --max-tokens "$MAX_TOKENS" --repeats "$REPEATS" \
  --json-out "$OUT/tune.json" | tee "$OUT/tune.txt"
python3 -m mtplxctl trace 1 --json --html "$OUT/tune-trace.html" > "$OUT/tune-trace.json"
echo "tune-gpu: done; $OUT/tune.json"
