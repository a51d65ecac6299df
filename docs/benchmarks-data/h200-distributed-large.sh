#!/usr/bin/env bash
# Issue #26: the single-rank baseline on a model large enough for a split to matter, on one
# GPU: ONE command, ONE JSON file in $OUT, under 5 minutes on an H200 (a 280 s limit stops it
# regardless).
# It BUILDS the model on the machine that runs it (a 64 MiB carry cannot hold it): a
# random-weight dense qwen3 with an MTP head, 40 layers x hidden 4096 (64 heads of 64, 16 KV
# heads, MLP 12288), about 8.0 billion parameters, saved in bfloat16 (about 16 GB) under the
# local temporary folder ($TMPDIR, else /tmp), built by MLX where it computes (the GPU). Then
# the existing single-rank distributed bench (the one behind
# h200-distributed-single-rank-random-h1024.json) decodes it AR and MTP (depth 3), 4 prompts
# x 2 repeats x 64 tokens. The JSON has the checkpoint's parameters, bytes and dtype, and the
# seconds the build took.
# Usage, from the repository root on the GPU machine:
#   export PYTHONPATH=$PWD:/root/site; OUT=$OUT bash docs/benchmarks-data/h200-distributed-large.sh
# LAYERS, HIDDEN, TOKENS and REPEATS shrink it (the tests run it on the CPU with LAYERS=2
# HIDDEN=128); PYTHON picks the interpreter (python3 by default).
set -uo pipefail
: "${OUT:?set OUT to the folder for the JSON report}"
export PYTHONPATH=$PWD:${PYTHONPATH:-/root/site}
mkdir -p "$OUT"
LAYERS=${LAYERS:-40}
HIDDEN=${HIDDEN:-4096}
timeout --signal=INT --kill-after=10 280 "${PYTHON:-python3}" -m mtplxd.engine.bench.distributed \
    --ranks 1 --layers "$LAYERS" --hidden "$HIDDEN" --dtype bfloat16 --depth 3 \
    --max-tokens "${TOKENS:-64}" --repeats "${REPEATS:-2}" \
    --json-out "$OUT/h200-distributed-single-rank-random-l${LAYERS}-h${HIDDEN}.json"
echo "distributed single rank, ${LAYERS} layers x hidden ${HIDDEN}: exit $?"
