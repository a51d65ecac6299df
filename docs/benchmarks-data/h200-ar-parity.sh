#!/usr/bin/env bash
# Issue 22 point 5 on a GPU machine: our AR decode beside stock mlx-lm's generate_step, ONE
# command, ONE JSON file in $OUT, under 4 minutes on an H200 including first-use kernel
# compilation: a 220 s limit stops it regardless, no new run starts after 160 s, and the
# JSON is rewritten after every run ("complete": false until the end), so a cut run keeps
# what it measured.
# Random-weight Qwen3-4B dims built in memory (bench.real_size's builder), 4-bit first (the
# main target), then bf16, then 8-bit; 512 tokens of context; greedy and T=0.6 top-p 0.95;
# ms per token of each loop, 4 runs per arm interleaved (the first arm alternates), plus the
# kernels one decode step launches and the host time to build it, ours and mlx-lm's.
# Usage, from the repository root:  OUT=/some/dir bash docs/benchmarks-data/h200-ar-parity.sh
# (PYTHON=... picks the interpreter, python3 by default; SIZE, DTYPES, CONTEXT, TOKENS, REPEATS,
# BUDGET_S and LIMIT_S override the defaults: SIZE=tiny CONTEXT=32 is the CPU test path)
set -uo pipefail
: "${OUT:?set OUT to the folder for the JSON report}"
export PYTHONPATH=$PWD:${PYTHONPATH:-/root/site}
mkdir -p "$OUT"
SIZE=${SIZE:-qwen3-4b}
"${PYTHON:-python3}" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
timeout --signal=INT --kill-after=10 "${LIMIT_S:-220}" "${PYTHON:-python3}" -m mtplxd.engine.bench.ar_parity \
    --size "$SIZE" --dtypes "${DTYPES:-4bit,bf16,8bit}" --context "${CONTEXT:-512}" --tokens "${TOKENS:-64}" \
    --repeats "${REPEATS:-4}" --budget-s "${BUDGET_S:-160}" --json-out "$OUT/h200-ar-parity.json"
echo "ar_parity: exit $?"
