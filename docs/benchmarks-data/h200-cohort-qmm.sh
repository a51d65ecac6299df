#!/usr/bin/env bash
# Where does a 3-wide fused cohort cycle lose to the lone cycle on the H200? (issue #20: at 3
# streams fused cohorts reached 2.29x serial MTP's aggregate, the target is 2.5x.) The
# embedded model runs 8-bit on CUDA; a lone depth-6 verify multiplies 7 rows by each weight,
# which MLX serves with its matvec (qmv: under 8 rows), a 3-wide cohort's 21 rows, which MLX
# serves with its tiled qmm. Two parts, each under 10 minutes, reports tarred into $OUT:
#   PART=kernels  the small-M kernel (now any row count, 8 rows a block) against
#                 mx.quantized_matmul at the embedded model's shapes and at Qwen3-4B's for
#                 verify-sized row counts; its CUDA tests; then lone and cohort cycles (widths
#                 1, 3, 8) timed on the device without the scheduler: 8-bit as served,
#                 8-bit through the kernel, and unquantized (bench.cycle_kernels --time-cycles)
#   PART=streams  (STREAMS=1,3 by default) serial MTP against fused cohorts (their prefills shared, and each row's
#                 alone: mtp_cohorts_solo_prefill) at 1 and 3 streams through the scheduler,
#                 8-bit as served and 8-bit through the kernel (bench.concurrency), MAX_TOKENS
#                 a stream (default 128; run it after PART=kernels in the same lease, whose
#                 compiled kernels it then finds in $MTPLX_HOME, when MAX_TOKENS is large);
#                 VARIANTS="8bit" runs the served weights alone; ARMS overrides the arms
#                 (default serial_mtp,mtp_cohorts_solo_prefill,mtp_cohorts)
# Usage, from the repository root on the GPU machine (MLX CUDA under /root/site):
#   PART=kernels OUT=$OUT bash docs/benchmarks-data/h200-cohort-qmm.sh
set -u
OUT=${OUT:?set OUT to the folder for the reports}
PART=${PART:?set PART to kernels or streams}
BUDGET=${BUDGET:-560}
export PYTHONPATH=$PWD:${PYTHONPATH:-/root/site} PYTHONUNBUFFERED=1
export MTPLX_HOME=${MTPLX_HOME:-/root/mtplx-home}  # compiled kernels kept across the parts
work=/root/cohort-qmm-$PART
started=$(date +%s)
mkdir -p "$OUT" "$work"

LOGS="$work"
source "$(dirname "$0")/budget-steps.sh"

model=mtplxd/models/embedded
if [ "$PART" = kernels ]; then
  step cuda-tests 80 python3 -m pytest -q -p no:cacheprovider -k "cuda" tests/engine/test_small_m_qmm.py
  step small-m-embedded 70 python3 -m mtplxd.engine.bench.small_m "$work/small-m-embedded.json" \
    --sizes embedded --bits 8 --rows 1,3,4,7,8,14,21,28,56 --repeats 8
  step small-m-4b 60 python3 -m mtplxd.engine.bench.small_m "$work/small-m-4b-verify.json" \
    --sizes qwen3-4b --bits 4,8 --rows 4,7,8,12,21 --repeats 4
  for variant in "8bit" "8bit-kernel" "none"; do
    case $variant in
      8bit) flags=(--quantize auto) ;;
      8bit-kernel) flags=(--quantize auto --small-m-kernel) ;;
      none) flags=(--quantize none) ;;
    esac
    step "cycles-$variant" 110 python3 -m mtplxd.engine.bench.cycle_kernels --model $model --depth 6 \
      --widths 1,3,8 --builds 5 --time-cycles 40 --modes greedy "${flags[@]}" \
      --json-out "$work/cycles-$variant.json"
  done
else
  for variant in ${VARIANTS:-8bit 8bit-kernel}; do
    flags=()
    [ "$variant" = 8bit-kernel ] && flags=(--small-m-kernel)
    step "streams-$variant-${MAX_TOKENS:-128}" "${STEP_CAP:-260}" python3 -m mtplxd.engine.bench.concurrency --model $model --depth 6 \
      --streams "${STREAMS:-1,3}" --arms "${ARMS:-serial_mtp,mtp_cohorts_solo_prefill,mtp_cohorts}" --max-tokens "${MAX_TOKENS:-128}" --repeats "${REPEATS:-3}" "${flags[@]}" \
      --json-out "$work/streams-$variant-${MAX_TOKENS:-128}.json"
  done
fi
tar czf "$OUT/h200-cohort-qmm-$PART.tgz" -C "$work" .
echo "done in $(( $(date +%s) - started ))s"
