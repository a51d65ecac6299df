#!/usr/bin/env bash
# Fused MTP cohorts (issue #20) on a GPU machine: ONE command, ONE JSON file in $OUT, under
# 5 minutes on an H200: a 280 s limit stops it regardless, and the JSON is rewritten after
# each stream count ("complete": false until the end), so a cut run keeps what it measured.
# Concurrent streams with the embedded model at 1, 3 and 8 streams, side by side in one run:
# serial MTP (the fused single-stream loop, one request at a time), the AR batch lane, phased
# MTP cohorts (batched drafting, one batched verify, one sync per turn: mtp_cohorts_phased)
# and fused MTP cohorts (each cohort cycle one compiled graph over all its rows, read one
# cycle late: mtp_cohorts); single-stream MTP and AR at 1 stream; a short request beside two
# long ones. Before the figures every arm runs once at each stream count (16 tokens), so each
# cohort width's graphs compile outside the measurement. Progress goes to stdout.
# Usage, from the repository root:  OUT=/some/dir bash docs/benchmarks-data/h200-cohorts.sh
# (PYTHON=... picks the interpreter; python3 by default)
set -uo pipefail
: "${OUT:?set OUT to the folder for the JSON report}"
export PYTHONPATH=$PWD:${PYTHONPATH:-/root/site}
mkdir -p "$OUT"
timeout 280 "${PYTHON:-python3}" -m mtplxd.engine.bench.concurrency --model mtplxd/models/embedded \
    --streams 1,3,8 --arms serial_mtp,ar_batch,mtp_cohorts_phased,mtp_cohorts \
    --max-tokens 128 --repeats 2 --json-out "$OUT/h200-embedded-concurrency-fused-cohorts.json"
echo "concurrency: exit $?"
