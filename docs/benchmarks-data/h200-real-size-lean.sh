#!/usr/bin/env bash
# Issue 22's real-size tables in one device run of under 10 minutes on a fresh H200 machine:
# fewer graphs per config than real-size-h200.sh (first use of each graph compiles for 5-55 s
# at 4B size): cycles timed at T=0.6 only (the temperature of the projected MTP/AR), depths
# 1 and 3; decode at T=0 and 0.6 beside mlx-lm's generate_step. 4-bit first (the format the
# issue is about), then 8-bit and bf16, then Qwen3-32B dims in 4-bit. Reports tarred into $OUT.
# Usage, from the repository root on the GPU machine (MLX CUDA under /root/site):
#   OUT=$OUT bash docs/benchmarks-data/h200-real-size-lean.sh
set -u
OUT=${OUT:?set OUT to the folder for the reports}
BUDGET=${BUDGET:-540}
export PYTHONPATH=$PWD:${PYTHONPATH:-/root/site} PYTHONUNBUFFERED=1
export MTPLX_HOME=${MTPLX_HOME:-/root/mtplx-home}
work=/root/real-size-lean
started=$(date +%s)
mkdir -p "$OUT" "$work"

LOGS="$work"
STEP_TAIL=8
source "$(dirname "$0")/budget-steps.sh"

lean=(--depths 1,3 --cycle-temperatures 0.6 --decode-tokens 32 --cycles 10 --repeats 6)
step real-size-4b 330 python3 -m mtplxd.engine.bench.real_size --sizes qwen3-4b --dtypes 4bit,8bit,bf16 \
  "${lean[@]}" --json-out "$work/real-size-4b.json"
step real-size-32b 300 python3 -m mtplxd.engine.bench.real_size --sizes qwen3-32b --dtypes 4bit \
  "${lean[@]}" --json-out "$work/real-size-32b.json"
tar czf "$OUT/h200-real-size-lean.tgz" -C "$work" .
echo "done in $(( $(date +%s) - started ))s"
