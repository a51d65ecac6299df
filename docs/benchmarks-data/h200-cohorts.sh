#!/usr/bin/env bash
# MTP cohorts (issue #20 phase 2) on a GPU machine, in one go (about 6 minutes on an H200):
#   1. concurrent streams, embedded model: serial MTP, interleaved MTP, the AR batch lane and
#      MTP cohorts at 1,2,3,4,8 streams, single-stream MTP and AR in the same run;
#   2. batched vs per-row verify cost at widths 1/3/8 and the cohort numerics (largest logit
#      difference, first divergence of greedy cohort rows against solo AR), embedded model;
#   3. the same cycle cost at Qwen3-4B dimensions (random weights, bfloat16).
# Each part has its own time limit, so one that overruns does not take the others with it.
# Usage, from the repository root:  OUT=/some/dir bash docs/benchmarks-data/h200-cohorts.sh
set -uo pipefail
: "${OUT:?set OUT to the folder for the JSON reports}"
export PYTHONPATH=$PWD:${PYTHONPATH:-/root/site}
mkdir -p "$OUT"
MODEL=mtplxd/models/embedded
timeout 240 python -m mtplxd.engine.bench.concurrency --model "$MODEL" --streams 1,2,3,4,8 \
    --max-tokens 128 --repeats 2 --json-out "$OUT/h200-embedded-concurrency-cohorts.json" \
    > "$OUT/h200-embedded-concurrency-cohorts.log" 2>&1
echo "concurrency: exit $?"
timeout 90 python -m mtplxd.engine.bench.cohort --model "$MODEL" --context 512 --depth 6 \
    --repeats 20 --divergence-tokens 128 --json-out "$OUT/h200-embedded-cohort.json" \
    > "$OUT/h200-embedded-cohort.log" 2>&1
echo "cohort (embedded): exit $?"
timeout 120 python -m mtplxd.engine.bench.cohort --dims qwen3-4b --dtype bfloat16 --context 512 \
    --depth 3 --repeats 20 --json-out "$OUT/h200-4b-cohort.json" > "$OUT/h200-4b-cohort.log" 2>&1
echo "cohort (4B dims): exit $?"
