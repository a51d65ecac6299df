#!/usr/bin/env bash
# Issues 20 and 22: does MLX's CUDA graph batching hold the small and mid-size models back?
# MLX 0.32's CUDA backend records kernels into CUDA graphs and launches one graph per 20
# operations (MLX_MAX_OPS_PER_BUFFER, default 20, "less than 255"), keeping instantiated graphs
# in an LRU of 100 (MLX_CUDA_GRAPH_CACHE_SIZE). A fused MTP cycle of the embedded model is about
# 1,650 kernels, so 80-odd graphs a cycle; a cohort cycle, the AR step and the prefill bring
# their own, so the cache may thrash (re-instantiating graphs every cycle), and 20 kernels a
# graph leaves a launch every 20. Each setting below runs in its own process (MLX reads them
# once): the embedded model's streams (serial MTP and fused cohorts at 1 and 3 streams; the
# direct MTP/AR arms at 1) and a Qwen3-4B 4-bit decode beside mlx-lm's (launch-bound at 7 ms).
# MLX_ENABLE_CACHE_THRASHING_CHECK=1 makes MLX say when its caches thrash.
# Usage, from the repository root on the GPU machine (MLX CUDA under /root/site):
#   OUT=$OUT bash docs/benchmarks-data/h200-graphs.sh
set -u
OUT=${OUT:?set OUT to the folder for the reports}
BUDGET=${BUDGET:-560}
export PYTHONPATH=$PWD:${PYTHONPATH:-/root/site} PYTHONUNBUFFERED=1
export MTPLX_HOME=${MTPLX_HOME:-/root/mtplx-home}  # compiled kernels kept across the settings
work=/root/graphs
started=$(date +%s)
mkdir -p "$OUT" "$work"
LOGS="$work"
source "$(dirname "$0")/budget-steps.sh"

# ops per graph / graph cache size; MLX's defaults (20/100) first
for setting in ${SETTINGS:-20/100 20/1000 100/1000 200/2000}; do
  ops=${setting%/*} cache=${setting#*/}
  export MLX_MAX_OPS_PER_BUFFER=$ops MLX_CUDA_GRAPH_CACHE_SIZE=$cache MLX_ENABLE_CACHE_THRASHING_CHECK=1
  step "streams-$ops-$cache" 110 python3 -m mtplxd.engine.bench.concurrency --model mtplxd/models/embedded \
    --depth 6 --streams 1,3 --arms serial_mtp,mtp_cohorts --max-tokens 256 --repeats 5 \
    --json-out "$work/streams-$ops-$cache.json"
  step "decode-4b-$ops-$cache" 70 python3 -m mtplxd.engine.bench.real_size --sizes qwen3-4b --dtypes 4bit \
    --depths "" --cycle-temperatures 0 --decode-tokens 32 --repeats 4 \
    --json-out "$work/decode-4b-$ops-$cache.json"
done
tar czf "$OUT/h200-graphs.tgz" -C "$work" .
echo "done in $(( $(date +%s) - started ))s"
