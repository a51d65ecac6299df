#!/usr/bin/env bash
# Is the 3-wide fused cohort's cost in MLX's CUDA 8-bit quantized matmul? (issue #20: at 3
# streams the fused cohorts reached 2.29x serial MTP's aggregate, the target is 2.5x; the
# embedded model loads 8-bit on CUDA by default, and a 3-wide depth-6 verify is a matmul of
# M = 21 rows.) Serial MTP against fused cohorts at 1 and 3 streams, the embedded model
# loaded unquantized (its float32 checkpoint, computed in bfloat16 on CUDA) and then 8-bit,
# each in its own process under 280 s (a first-use compile on a fresh machine takes most of
# a minute: each run warms every arm first). Two JSON files in $OUT; progress on stdout.
# Usage, from the repository root:  OUT=/some/dir bash docs/benchmarks-data/h200-cohorts-quantize.sh
set -uo pipefail
: "${OUT:?set OUT to the folder for the JSON reports}"
export PYTHONPATH=$PWD:${PYTHONPATH:-/root/site}
mkdir -p "$OUT"
for quantize in none 8bit; do
  timeout 280 "${PYTHON:-python3}" -m mtplxd.engine.bench.concurrency --model mtplxd/models/embedded \
      --streams 1,3 --arms serial_mtp,mtp_cohorts --max-tokens 128 --repeats 2 \
      --quantize "$quantize" --json-out "$OUT/h200-embedded-cohorts-quantize-$quantize.json"
  echo "quantize $quantize: exit $?"
done
