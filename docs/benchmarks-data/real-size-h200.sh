#!/usr/bin/env bash
# Issue 22's GPU measurements in one go on the H200 (about 8 minutes), JSON under $OUT:
#   small-m.json               the small-M quantized kernel against mx.quantized_matmul
#                              (4B and 32B shapes, 4/8-bit, M=1..6) with its error on the GPU
#   cuda-tests.log             the CUDA-only tests of the kernel and the chunked GDN verify
#   ar-reference-embedded.json our AR (compiled sampler) beside mlx-lm's generate_step and
#                              beside the sampler as it was, on the embedded model
#   real-size-4b.json          Qwen3-4B dims in bf16, 8-bit, 4-bit (with the kernel's forwards)
#   real-size-32b.json         Qwen3-32B dims in 4-bit and 8-bit
#   real-size-hybrid27b.json   the Qwen3.5/3.6-27B hybrid layout in 4-bit
#   embedded-d6.json           the embedded model's MTP/AR at depth 6 (no regression)
# Usage, from the repository root on the GPU machine (MLX CUDA installed under /root/site):
#   export PYTHONPATH=$PWD:/root/site; OUT=$OUT bash docs/benchmarks-data/real-size-h200.sh
# Each step gets at most what is left of BUDGET seconds (default 480), so the whole run ends
# in time and keeps what it measured: the benches write their JSON as they go.
set -u
OUT=${OUT:?set OUT to the folder for the reports}
BUDGET=${BUDGET:-480}
started=$(date +%s)
mkdir -p "$OUT"

LOGS="$OUT"
STEP_TAIL=25
source "$(dirname "$0")/budget-steps.sh"

python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device())"
step small-m 80 python3 -m mtplxd.engine.bench.small_m "$OUT/small-m.json" --repeats 8
step cuda-tests 90 python3 -m pytest -q -p no:cacheprovider -k "not compiles_for" tests/engine/test_small_m_qmm.py tests/engine/test_gdn_chunked.py
step ar-reference-embedded 70 python3 -m mtplxd.engine.bench.ar_reference --model mtplxd/models/embedded \
  --tokens 128 --repeats 2 --json-out "$OUT/ar-reference-embedded.json"
step real-size-4b 110 python3 -m mtplxd.engine.bench.real_size --sizes qwen3-4b --dtypes bf16,8bit,4bit \
  --small-m-kernel --decode-tokens 32 --cycles 12 --repeats 8 --json-out "$OUT/real-size-4b.json"
step real-size-32b 110 python3 -m mtplxd.engine.bench.real_size --sizes qwen3-32b --dtypes 4bit,8bit \
  --small-m-kernel --decode-tokens 24 --cycles 10 --repeats 6 --json-out "$OUT/real-size-32b.json"
step real-size-hybrid27b 70 python3 -m mtplxd.engine.bench.real_size --sizes hybrid-27b --dtypes 4bit \
  --small-m-kernel --decode-tokens 24 --cycles 10 --repeats 6 --depths 1,3,5 --json-out "$OUT/real-size-hybrid27b.json"
step embedded-d6 60 python3 -m mtplxd.engine.bench --model mtplxd/models/embedded --depth 6 --repeats 1 \
  --max-tokens 128 --json-out "$OUT/embedded-d6.json"
echo "done in $(( $(date +%s) - started ))s"
