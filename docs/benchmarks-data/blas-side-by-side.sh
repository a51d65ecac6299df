#!/usr/bin/env bash
# Before/after of issue #29 on one machine, interleaved so that the machine's drifts hit both:
# BEFORE is a checkout of the commit before the change (bfloat16, MLX's bundled BLAS) with its
# own venv, AFTER this checkout (float32, the distribution's OpenBLAS). Usage:
#   git archive f3697b1 | tar -x -C /tmp/before && (cd /tmp/before && python3 -m venv .venv &&
#     .venv/bin/pip install -e ".[test]" &&
#     git -C $AFTER show 746ec34:mtplxd/engine/bench_prefill.py > mtplxd/engine/bench_prefill.py)
#   BEFORE=/tmp/before AFTER=$PWD OUT=docs/benchmarks-data/blas bash docs/benchmarks-data/blas-side-by-side.sh
set -euo pipefail
: "${BEFORE:?}" "${AFTER:?}" "${OUT:?}"
ROUNDS=${ROUNDS:-1}
FIRST=${FIRST:-1}                                # number of the first round (its files' suffix)
TOKENS=${TOKENS:-1024,4096,16384}                # prompt lengths of the prefill measurement
MODEL=$AFTER/mtplxd/models/embedded
mkdir -p "$OUT"
for round in $(seq "$FIRST" $((FIRST + ROUNDS - 1))); do
  for side in before after; do
    root=$BEFORE; [ "$side" = after ] && root=$AFTER
    # The prefill bench lives in the engine's bench room since the rooms landed; the "before"
    # checkout carries the flat copy its set-up line writes.
    prefill=mtplxd.engine.bench.prefill
    [ -f "$root/mtplxd/engine/bench/prefill.py" ] || prefill=mtplxd.engine.bench_prefill
    (cd "$root" && .venv/bin/python -m "$prefill" --model "$MODEL" \
      --tokens "$TOKENS" --repeats 1 --json-out "$OUT/prefill-$side-$round.json")
    (cd "$root" && .venv/bin/python -m mtplxd.engine.bench --model "$MODEL" --depth 3 \
      --repeats 2 --max-tokens 96 --json-out "$OUT/bench-$side-$round.json")
  done
done
