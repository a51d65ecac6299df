#!/usr/bin/env bash
# Issues 20 and 22: do MLX's CUDA graph limits hold the small and mid-size models back?
# MLX's CUDA backend records kernels into CUDA graphs and launches one graph per
# MLX_MAX_OPS_PER_BUFFER operations or MLX_MAX_MB_PER_BUFFER megabytes of inputs, whichever
# comes first, keeping instantiated graphs in an LRU of MLX_CUDA_GRAPH_CACHE_SIZE. Its
# defaults depend on the GPU (mlx/backend/cuda/device.cpp, get_graph_limits): on an H100/H200
# (compute capability 9.0) 100 operations and 1000 MB a graph, on other GPUs 20 and 100 MB
# (A100: 20 and 400); the cache holds 400 graphs. A fused MTP cycle of the embedded model is
# about 1,650 kernels. Each setting below runs in its own process (MLX reads them once): the
# embedded model's streams (serial MTP and fused cohorts at 1 and 3 streams; the direct MTP/AR
# arms at 1) and a Qwen3-4B 4-bit decode beside mlx-lm's. A setting is OPS/CACHE, or
# `default` for MLX's own (both unset). MLX_ENABLE_CACHE_THRASHING_CHECK=1 makes MLX say when
# its caches thrash. Repeat a list (SETTINGS="default 200/400 default 200/400") to interleave.
# Usage, from the repository root on the GPU machine (MLX CUDA under /root/site):
#   OUT=$OUT bash docs/benchmarks-data/h200-graphs.sh
set -u
OUT=${OUT:?set OUT to the folder for the reports}
BUDGET=${BUDGET:-560}
export PYTHONPATH=$PWD:${PYTHONPATH:-/root/site} PYTHONUNBUFFERED=1
export MTPLX_HOME=${MTPLX_HOME:-/root/mtplx-home}  # compiled kernels kept across the settings
work=${WORK:-/root/graphs}
started=$(date +%s)
mkdir -p "$OUT" "$work"
LOGS="$work"
source "$(dirname "$0")/budget-steps.sh"

# A fresh machine compiles the engine's kernels first (over 110 s on 2026-12-03, which cost the
# first setting its streams): compile them once, untimed, into MTPLX_HOME.
step warm-up 200 python3 -m mtplxd.engine.bench.concurrency --model mtplxd/models/embedded \
  --depth 6 --streams 1,3 --arms serial_mtp,mtp_cohorts --max-tokens 32 --repeats 1 \
  --json-out "$work/warm-up.json"
run=0
for setting in ${SETTINGS:-default 20/400 100/400 200/2000}; do
  run=$((run + 1))
  unset MLX_MAX_OPS_PER_BUFFER MLX_CUDA_GRAPH_CACHE_SIZE
  if [[ $setting != default ]]; then
    export MLX_MAX_OPS_PER_BUFFER=${setting%/*} MLX_CUDA_GRAPH_CACHE_SIZE=${setting#*/}
  fi
  export MLX_ENABLE_CACHE_THRASHING_CHECK=1
  name="$run-${setting/\//-}"
  step "streams-$name" 110 python3 -m mtplxd.engine.bench.concurrency --model mtplxd/models/embedded \
    --depth 6 --streams 1,3 --arms serial_mtp,mtp_cohorts --max-tokens 256 --repeats 5 \
    --json-out "$work/streams-$name.json"
  step "decode-4b-$name" 70 python3 -m mtplxd.engine.bench.real_size --sizes qwen3-4b --dtypes 4bit \
    --depths "" --cycle-temperatures 0 --decode-tokens 32 --repeats 4 \
    --json-out "$work/decode-4b-$name.json"
done
tar czf "$OUT/h200-graphs.tgz" -C "$work" .
echo "done in $(( $(date +%s) - started ))s"
