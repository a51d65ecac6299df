#!/usr/bin/env bash
# Issue 22: can a quantized matmul laid out for bandwidth lift the quantized 32B? MLX 0.32's
# CUDA 4-bit matvec reads a 32B model's weights at about 20% of the H200's bandwidth, and a
# 6-token verify costs 4-4.4 decode steps (docs/benchmarks.md, "The real-size tables"). The
# small-M kernel's vector layout (small_m_qmm._SOURCE_VECTOR: 16-byte loads, a block per 4
# output columns, warps splitting K) is timed against MLX's and the per-word layout at every
# Qwen3-32B matrix, then installed from 1 row up (decode too) in whole 32B forwards, decode
# steps and cycles beside stock MLX (bench.real_size --small-m-loops). Reports tarred into $OUT.
#   PART=kernels  CUDA tests of both layouts; micro-bench at the Qwen3-32B and Qwen3-4B shapes
#   PART=real     real_size: Qwen3-32B 4-bit and 8-bit, stock and with the kernel installed as
#                 small_m_qmm.route serves it (verify blocks on the mma layout, decode rows of large
#                 matrices on the vector one), with both decode steps' host split, at DTYPES
#                 (4bit,8bit); since 2026-12-07 (fifth session) with the forwards of 1-6 tokens
#                 compiled over fixed buffers as the fused loop verifies (forward_compiled_*)
#   PART=real-graphs  the 32B's decode host split read near-zero wait because MLX's async_eval
#                 blocks past 10 command buffers in flight and a 32B step commits ~15 graphs at
#                 the H200's default limits (100 kernels, 1000 M elements): Qwen3-32B 4-bit,
#                 the kernel as served, depth 3 at T=0.6, once at MLX's default graph limits and
#                 once at MLX_MAX_OPS_PER_BUFFER=4000 MLX_MAX_MB_PER_BUFFER=100000 (a step a few
#                 graphs: the split reads true, and bigger graphs may decode faster)
#   PART=decode-graphs  the decode figures alone (real_size --decode-only), Qwen3-32B at DTYPES
#                 (4bit), stock and with the kernel, at MLX's defaults and with CUDA graphs off
#   PART=step-profile  the device's own time per step (bench.step_profile under Nsight Compute):
#                 SIZE (qwen3-32b) at DTYPES (4bit), AR stock and with the kernel, the depth-3
#                 cycle with the kernel, each beside its unprofiled wall time, and every kernel
#                 of an AR step stock and with the kernel (node mode); STACKED=1: with
#                 the projections that read one input stacked (stacked.py; 2026-12-06: whole
#                 steps did not gain what the products alone did, and the 32B's decode lost)
#                 NORM_ROPE=1: with the query and key norms and rope as one kernel a layer
#                 (qk_norm_rope.py)
#   PART=norm-rope  the query and key norms and rope as one kernel a layer (qk_norm_rope.py,
#                 2026-12-07, fifth session, written without a GPU): its CUDA tests (SKIP_TESTS=1:
#                 none), then SIZE (qwen3-4b) at DTYPES (4bit) with the small-M kernel as served,
#                 256 AR decode steps without and with it in alternating processes (ROUNDS, 2),
#                 128 depth-3 cycles each, and every kernel of an AR step with it under Nsight
#                 (H100, that session: tests passed, 622 kernels a step, whole steps level)
#   PART=widen    stock against the kernel, depths 1-5 at T=0 and 0.6, where it is off by default:
#                 Qwen3-32B 8-bit, Qwen3-4B 4-bit, the hybrid 27B 4-bit (not yet run)
#   PART=unpack   the and-or unpack (small_m_qmm._HEADER: no int-to-float conversion per weight
#                 value): every CUDA test of the kernel, then the micro-bench at the Qwen3-32B
#                 and 4B shapes with both unpacks side by side (shipped widths only), and at one
#                 row the vector layout with 1, 2 and 4 vectors loaded per thread before use
#   PART=unpack-real  real_size with it: Qwen3-32B at DTYPES (default 4bit), stock and kernel,
#                 depths 1 and 3 at T=0 and 0.6, and the greedy decode with the vector layout's
#                 decode threshold at 16M weights (q/o projections too) and 0 (every matrix)
#   PART=divergence  issue 22 point 4: greedy AR against greedy MTP (depth 3) over 2,000 tokens
#                 through the engine's loops, the kernel as served, at SIZE (qwen3-4b, qwen3-32b or
#                 hybrid-27b; one a run: the hybrid's took 122 s in the fused loop) and DTYPES
#                 (4bit; f32 is the rounding control, 2026-12-04 fifth session); since 2026-12-04
#                 every divergence, MTP resynchronised on AR after each; NORM_ROPE=1: with the
#                 query and key norms and rope as one kernel a layer (qk_norm_rope.py); CONTEXT:
#                 from a prompt of that many tokens (512 unless set; 8192: the buffer attention's
#                 mma form, the default from 2,048 slots since 2026-12-07's eighth session)
#   PART=hybrid-parity  issue 22 point 5 for the hybrid, whose single decode figures swing
#                 19-32 ms between processes: bench.ar_parity (our AR and mlx-lm's generate_step
#                 interleaved, CPU time beside wall) on the hybrid 27B at DTYPES (4bit,8bit)
#   PART=hybrid-prefill  the hybrid 27B's prompt through its GDN layers chunked (gdn_chunked.
#                 chunked_prefill, served on CUDA since 2026-12-04) and on mlx-lm's per-token loop:
#                 real_size --prefill-tokens ${TOKENS:-4096} at DTYPES (4bit), its decode figures beside
#                 (since 2026-12-04, third session, with the hybrid's compiled AR step among them,
#                 decode_compiled_greedy_ms: is its host-bound decode cut by one traced graph?)
#   PART=gdn-kernel  the GDN decode-step kernel (model/gdn_kernel.py, 2026-12-04, third session,
#                 written without a GPU): its CUDA tests, then the hybrid 27B's decode at DTYPES
#                 (4bit) with it and with mlx-lm's ops (MTPLX_GDN_KERNEL=0), host split and
#                 compiled step beside each
#   PART=ar-loop  the hybrid 27B's AR decode in the compiled loop (decoding/fused_ar.py, served
#                 for hybrids on CUDA since 2026-12-04, fourth session) and op by op
#                 (MTPLX_FUSED_AR=0), at DTYPES (4bit)
#   PART=compiled-decode  decode in the compiled AR loop (2026-12-04, fifth session), which pays a
#                 custom kernel's host cost once, when traced: SIZE=hybrid-27b (default) its
#                 matrices alone at one row (bench.small_m), then 4-bit with the vector layout
#                 on its decode steps from each weight count in FROM (64M and 16M; ~480 s on a
#                 fresh machine); SIZE=hybrid-27b-dtypes bf16 and 8-bit; SIZE=qwen3-32b compiled
#                 (MTPLX_FUSED_AR=1) against op by op at DTYPES (4bit,8bit), the kernel as served
#   PART=row-invariant  row-invariant routing (small_m_qmm's module docstring, 2026-12-05: every
#                 1..7-row product on the tensor-core layout, decode steps included, so a verify
#                 row rounds as a decode step): its kernel test (each row of an M-row mma
#                 product bit for bit its 1-row product), then the hybrid 27B at DTYPES (4bit):
#                 greedy divergence over TOKENS (300) tokens with it (at most DIVERGENCE_CAP, 330 s),
#                 and decode with it beside MLX's in one process (real_size --decode-only)
#   PART=row-invariant-kernels  the rest of its CUDA tests (greedy MTP = AR on the tiny dense model),
#                 then the hybrid's matrices at 1, 2, 4 and 7 rows (mma beside MLX and the
#                 other layouts, and whether each one's rows equal its 1-row products)
#   PART=routings  the kernel as served and row-invariant side by side in one process (real_size
#                 --row-invariant-beside, 2026-12-05, second session: two processes' decode steps
#                 differed by up to 45%): SIZE (hybrid-27b) at DTYPES (4bit), stock beside both,
#                 depths 1 and 3 at T=0 and 0.6; with TOKENS, then greedy divergence over TOKENS
#                 tokens row-invariant at that size (the 32B's served routing: 32 near-ties in 289);
#                 else the hybrid's matrices at 1 and 4 rows with the mma layout's warps and loads
#                 varied (bench.small_m --mma-variants: its 1-row product lost to MLX's matvec on
#                 the small ones, k_proj 20.3 us against 10.6)
#   PART=mma-shape  the mma layout's shapes in whole hybrid 27B 4-bit decode steps and depth-3
#                 cycles at T=0.6, row-invariant as served, one process (real_size --mma-configs
#                 CONFIGS): the served 8 x 4 pipelined in 2 stages (MMA_STAGES, since 2026-12-05,
#                 fourth session: it beat the plain layout on every large matrix in an H100's
#                 micro-bench) beside the plain 8x4 it replaced and 4x2s4 (the micro-bench's
#                 fastest at 1 row on the hybrid's GDN projections and gate_proj)
#   PART=fusion   the products of one layer that share an input, separate against stacked into
#                 one matrix (bench.fused_products, 2026-12-05, fifth session: the hybrid's decode
#                 step is its products, most of them small matrices read at 18-32%): the hybrid
#                 27B's GDN inputs, MLP gate/up and attention q/k/v, the 32B's MLP and attention,
#                 4- and 8-bit, 1 and 4 rows, on MLX, the mma layout and the mixed routing, and
#                 whether the stacked product's columns are the parts' bit for bit; then the
#                 whole decode steps and depth-3 cycles of SIZE (hybrid-27b) at DTYPES (4bit) with
#                 its MLPs' gate and up, its GDN inputs and its attention's q, k and v stacked
#                 (real_size --stacked, the engine path of MTPLX_STACKED_PROJECTIONS=1);
#                 SIZE=qwen3-32b SIZES=qwen3-32b for the dense model
#   PART=stacked-profile  a stacked step beside the separate one (2026-12-06: one process read
#                 the 32B's stacked decode 12-14% slower; this found it 7% cheaper on the device): SIZE
#                 (qwen3-32b) at DTYPES (4bit) with the kernel as served to AR steps, separate and
#                 stacked alternately (two unprofiled wall samples each, one process each), then
#                 one decode step of each under Nsight Compute per kernel (node mode: the
#                 CSV's grid sizes tell which matrix a product read); DEPTH=3: the depth-3
#                 cycle instead (routed row-invariantly, as served); ROUNDS: wall samples (2)
#   PART=decode-routing  which matrices a dense model's decode step should route to the vector
#                 layout, at today's kernel (the H200 chose 64M weights on 2026-12-03; an H100's
#                 profile, 2026-12-06, found the matrices left on MLX's qmv, q/k/v and o, read at
#                 0.7 TB/s): Qwen3-32B at DTYPES (4bit) and CONTEXT (512) tokens, greedy decode with
#                 the threshold at 32M (q and o too), 0 (every matrix) and 64M (served) again, in one
#                 process; the AR loop as served (compiled up to 1,024-token prompts since 2026-12-06)
#                 unless MTPLX_FUSED_AR says (0: op by op, as served past 1,024 tokens)
#   PART=decode-routing-profile  why the 32B's whole decode steps were 2.5-8 ms slower with q and o on
#                 the vector layout although each of those products alone ran 1.7x faster there
#                 (2026-12-06, third session): SIZE (qwen3-32b) at DTYPES (4bit), the AR loop as served
#                 (compiled, the kernel on its decode steps), the decode threshold at 64M (served)
#                 and 32M (q and o too) alternately, ROUNDS (2) unprofiled wall samples each, then
#                 one step of each under Nsight Compute per kernel
#   PART=attention-split  the buffer attention's forms in whole steps (buffer_attention.py,
#                 MTPLX_BUFFER_ATTENTION): their CUDA tests, then SIZE (qwen3-32b; hybrid-27b: its
#                 attention layers, head size 256) at DTYPES (4bit) with the kernel at CONTEXT
#                 (8192) tokens: the decode figures (stock and with the kernel: real_size
#                 --decode-only), then with the fused loops attending by each of FORMS
#                 (one-pass,split,0; also auto, the default, and two-pass; 0: MLX's masked
#                 attention; any of them ending in +pool, e.g. auto,auto+pool: with the loops'
#                 offsets and the kernels' scale in MLX's managed pool, as before 2026-12-06's
#                 eighth session; or in +in_place, +bias_once, +hoist, any of them: the small-M
#                 kernel's forms of those names on, e.g. CONTEXT=512
#                 FORMS=auto,auto+in_place,auto+in_place+bias_once+hoist) in two rounds in the same process (real_size --attention-forms: the
#                 served AR, the compiled AR loop beside it, the depth-3 cycle at T=0; on
#                 2026-12-06, sixth session, one process per form swung more than the forms
#                 differ; seventh, without --decode-only the forwards and stock cycles took the
#                 whole 480 s step before any form); ~140 s more on a fresh machine without the
#                 PTX cache
#   (attention-split, attention-profile: SKIP_TESTS=1 leaves out their CUDA tests, for a second
#   call in a lease whose first ran them)
#   PART=attention-profile  one layer's attention alone at the 32B's shapes, each form in its own
#                 process under Nsight Compute (bench.attention_profile: the one-pass kernel, the
#                 split and two-pass forms, MLX's attention over the keys seen as an op-by-op
#                 step runs it, and MLX's masked attention over the buffer), 1 and 4 rows, at
#                 CONTEXTS (512 2048 8192): wall per call and the device's time per call
#                 (`-ncu.json`; `-device.json` before 2026-12-06's eighth session); FORMS (one-pass split two-pass mlx masked; split-N[-wW][-pP]:
#                 the split form in N-slot chunks, blocks of W warps, at most P pairs a warp,
#                 e.g. "split-64 split-128-w8-p1"; mma-N[-wW]: the mma form so, N a multiple
#                 of 16 x W, e.g. "mma-128-w8 mma-512"); ARGS="--scalars-in-pool" (any more
#                 attention_profile arguments) with TAG=pool (appended to the files' names);
#                 SHAPE_ARGS="--heads 24 --kv-heads 4 --dim 256" for the hybrid 27B's attention
#   PART=in-place  the vector layout's forms with fewer instructions a weight (small_m_qmm.VECTOR_IN_PLACE
#                 and VECTOR_BIAS_ONCE, 2026-12-06, ninth session: 19% and 23% fewer in a 4-bit pass's
#                 sm_90 SASS, docs/benchmarks-data/sass-mix.py): their CUDA tests (in place: bit for bit
#                 the masked unpack's outputs) and the buffer attention's (split, two-pass, offsets,
#                 padded scalars), then the micro-bench at the Qwen3-32B matrices, 4- and 8-bit, ROWS
#                 (1,4), the three forms side by side (bench.small_m's vector_us_by_form); likewise
#                 the mma layout with its unpack's constants in registers (MMA_HOIST: 9-10% fewer
#                 instructions at one row tile, the same outputs; mma_us_by_hoist)
#   PART=kv-write  the fused loops' KV writes (2026-12-06: a slice_update at an array offset ran
#                 one thread per element of the whole buffer on CUDA, 3.3 ms of the 32B's step;
#                 since then a scatter): Qwen3-32B at DTYPES (4bit), the kernel as served, decode
#                 and depth-3 cycles at T=0 with the scatter, then with slice_update in the same
#                 process (real_size --kv-write-beside), at 512 tokens of context (AR compiled)
#                 and at CONTEXT (8192; AR op by op as served there, the cycles fused)
#   PART=mma-pipelined  the pipelined mma layout's CUDA tests (bit for bit the plain layout's
#                 outputs), then the micro-bench at the hybrid's and the 32B's 4-bit matrices,
#                 1 and 6 rows, every MMA_CONFIGS shape (bench.small_m --mma-variants)
#   PART=hybrid-verify  the hybrid 27B 4-bit with the kernel on verify rows only (decode steps
#                 on MLX's matvec: real_size --kernel-decode-from never; since 2026-12-03 the
#                 default for hybrid models), stock beside it, depths 1 and 3 at T=0 and 0.6
#                 (its decode ran 2.5x slower through the vector layout); since 2026-12-04 the
#                 hybrid's cycles run the fused loop (the report's `loop` says which)
#   PART=mma      the tensor-core layout (small_m_qmm._SOURCE_MMA): its CUDA tests, then the
#                 micro-bench's mma columns with its warps and groups-per-load variants beside MLX
#                 and the other layouts at Qwen3-32B shapes, 1 and 6 rows, then 8-bit at 2, 3, 7
#                 and 8 rows (the 4-bit rows and the 4B ran on 2026-12-03, fifth lease)
#   PART=timeline  why the vector layout's 1-row gate_proj took 37 us in ncu but 66 us a call in
#                 the micro-bench: the products 16 calls evaluated at once (small_m_ncu --together:
#                 host build and wall per call; again with MLX's CUDA graphs off), then the same under Nsight Systems where the
#                 machine has it (the kernels' durations inside MLX's CUDA graphs)
#   PART=ncu      Nsight Compute on the kernel's layouts and MLX's quantized matmul at Qwen3-32B
#                 4-bit gate_proj (1 and 6 rows), down_proj and k_proj (1 row): speed of light,
#                 occupancy, warp stalls, memory (bench.small_m_ncu; issue 22, point 6)
#   PART=read-ceiling  what holds a 1-row product at 56-61% of an H100's DRAM bandwidth (2026-12-07,
#                 second session: the vector and mma layouts alike under Nsight): bench.read_ceiling's
#                 CUDA tests (SKIP_TESTS=1: none), then Nsight Compute at Qwen3-32B 4-bit MATRICES
#                 (gate_proj down_proj q_proj), 1 row: the served layouts, the vector layout at 4 rows a block, its persistent
#                 form (small_m_qmm.VECTOR_PERSISTENT_BLOCKS) in PERSISTENT (264,660: what fits
#                 132 SMs at 8 rows a block, 165 registers, and at 4, 72 registers, 160 threads)
#                 blocks at both heights (PERSISTENT= : none), with UNROLL (e.g. 2,4) 16-byte
#                 vectors a thread a pass at both heights, and readers of the same bytes that
#                 compute nothing (its grid; one flat stream). 2026-12-07, third session: the
#                 persistent form lost everywhere; down_proj's grid is its ceiling (next: UNROLL)
#   PART=graph-limits  what bounds the 4-bit 4B's compiled AR step (2026-12-07, sixth session: 622
#                 kernels and 5.6 Nsight ms a step, a fifth fewer kernels left the 3.9 ms wall level):
#                 SIZE (qwen3-4b) at DTYPES (4bit), the kernel as served, 256 steps a process
#                 (wall and the process's CPU time) with MLX's CUDA graphs as shipped (100 ops, 1000 MB
#                 a graph on sm_90), one graph a step (1000 ops, 100000 MB), small graphs (20 ops) and
#                 none (MLX_USE_CUDA_GRAPHS=0), ROUNDS (2) rounds; then the device's busy time a step
#                 (Nsight, graph workloads) as shipped and at one graph a step. First bench.launch_cost (a
#                 kernel's floor: MLX's rms_norm, a short cuda_kernel and one with a 20 kB source)
#                 with graphs and without
#   PART=arms     configurations alternating in one process (bench.step_arms; 2026-12-07, sixth
#                 session: the 4B's step swung 4.0-6.2 ms between processes, its host the bound):
#                 the 4-bit Qwen3-4B as served (kernel) against stacked projections and one
#                 norm-and-rope kernel a layer, together and apart (fewer kernels: less host
#                 time); the 32B 8-bit as served (since 2026-12-07, eighth session: row-invariant,
#                 its decode steps on the tensor-core layout in the compiled loop, which this PART
#                 then found 0.79-0.85x the mixed routing's time) against the mixed routing (MLX's
#                 decode op by op: kernel+mixed) and MLX's decode compiled (kernel+mixed+compiled-ar);
#                 the 32B 4-bit as served against row-invariant and against stacked + norm-rope.
#                 ROUNDS (4) rounds
# Usage, from the repository root on the GPU machine (MLX CUDA under /root/site):
#   PART=kernels OUT=$OUT bash docs/benchmarks-data/h200-vector-qmm.sh
set -u
OUT=${OUT:?set OUT to the folder for the reports}
PART=${PART:?set PART to kernels, mma, timeline, real, real-graphs, decode-graphs, step-profile, widen, unpack, unpack-real, divergence, hybrid-parity, hybrid-prefill, hybrid-verify, gdn-kernel, ar-loop, compiled-decode, row-invariant, row-invariant-kernels, routings, mma-shape, mma-pipelined, fusion, norm-rope, graph-limits, arms, stacked-profile, decode-routing, decode-routing-profile, kv-write, in-place, attention-split, attention-profile, ncu or read-ceiling}
BUDGET=${BUDGET:-560}
export PYTHONPATH=$PWD:${PYTHONPATH:-/root/site} PYTHONUNBUFFERED=1
export MTPLX_HOME=${MTPLX_HOME:-/root/mtplx-home}
work=/root/vector-qmm-$PART
started=$(date +%s)
mkdir -p "$OUT" "$work"

LOGS="$work"
STEP_TAIL=${STEP_TAIL:-40}
source "$(dirname "$0")/budget-steps.sh"
# Nsight Compute, for the PARTs that profile (the device machines install it off PATH).
command -v ncu >/dev/null || PATH=$PATH:$(ls -d /opt/nvidia/nsight-compute/*/ 2>/dev/null | tail -1)
profile() {  # NAME MODE STEPS ARGS...: the steps of the PART's bench.step_profile command (sp) under ncu, then the summary
  local name=$1 mode=$2 steps=$3; shift 3
  step "$name" 150 ncu --profile-from-start off --graph-profiling "$mode" --metrics gpu__time_duration.sum \
    --csv "${sp[@]}" --steps "$steps" --profiled "$@"
  [ -f "$work/$name.log" ] || return 0  # the step was skipped (ONLY, or the budget spent)
  python3 -m mtplxd.engine.bench.step_profile --summarize "$work/$name.log" --steps "$steps" \
    --json-out "$work/$name.json" || true
}

if [ "$PART" = kernels ]; then
  step cuda-tests 170 python3 -m pytest -q -p no:cacheprovider -k "cuda and (vector or mtp)" tests/engine/test_small_m_qmm.py
  step small-m-32b 200 python3 -m mtplxd.engine.bench.small_m "$work/small-m-32b.json" \
    --sizes qwen3-32b --bits 4,8 --rows 1,2,4,7 --repeats 6
  step small-m-4b 150 python3 -m mtplxd.engine.bench.small_m "$work/small-m-4b.json" \
    --sizes qwen3-4b --bits 4,8 --rows 1,4 --repeats 6
elif [ "$PART" = mma ]; then
  # The greedy MTP = AR test compiles the tiny model's graphs through the kernel: it did not
  # finish in 150 s on 2026-12-03 (the 28 tests before it passed in that time).
  step cuda-tests 300 python3 -m pytest -q -p no:cacheprovider -k "cuda and (mma or greedy)" tests/engine/test_small_m_qmm.py
  step small-m-32b 240 python3 -m mtplxd.engine.bench.small_m "$work/small-m-32b.json" \
    --sizes qwen3-32b --bits 4,8 --rows 1,6 --repeats 6 --shipped-only --mma-variants
  step small-m-32b-8bit 120 python3 -m mtplxd.engine.bench.small_m "$work/small-m-32b-8bit.json" \
    --sizes qwen3-32b --bits 8 --rows 2,3,7,8 --repeats 6 --shipped-only
elif [ "$PART" = real ]; then
  lean=(--depths 1,3 --cycle-temperatures 0.6 --decode-tokens 32 --cycles 10 --repeats 6)
  step real-32b-kernel 400 python3 -m mtplxd.engine.bench.real_size --sizes qwen3-32b --dtypes "${DTYPES:-4bit,8bit}" \
    "${lean[@]}" --small-m-kernel --small-m-loops --json-out "$work/real-size-32b-kernel.json"
elif [ "$PART" = unpack ]; then
  step cuda-tests 200 python3 -m pytest -q -p no:cacheprovider -k "cuda" tests/engine/test_small_m_qmm.py
  step small-m-32b 220 python3 -m mtplxd.engine.bench.small_m "$work/small-m-32b.json" \
    --sizes qwen3-32b --bits 4,8 --rows 1,2,4,6 --repeats 6 --shipped-only
  step small-m-4b 100 python3 -m mtplxd.engine.bench.small_m "$work/small-m-4b.json" \
    --sizes qwen3-4b --bits 4,8 --rows 1,4 --repeats 6 --shipped-only
elif [ "$PART" = unpack-real ]; then
  step "real-32b-${DTYPES:-4bit}" 540 python3 -m mtplxd.engine.bench.real_size --sizes qwen3-32b \
    --dtypes "${DTYPES:-4bit}" --depths 1,3 --cycle-temperatures 0,0.6 --decode-tokens 32 --cycles 10 \
    --repeats 6 --small-m-kernel --small-m-loops --decode-vector-values 16777216,0 \
    --json-out "$work/real-size-32b-${DTYPES:-4bit}.json"
elif [ "$PART" = real-graphs ]; then
  for limits in default 4000/100000; do
    if [ "$limits" = default ]; then env=(); else env=(MLX_MAX_OPS_PER_BUFFER=${limits%/*} MLX_MAX_MB_PER_BUFFER=${limits#*/}); fi
    step "real-32b-graphs-${limits%/*}" 270 env "${env[@]}" python3 -m mtplxd.engine.bench.real_size \
      --sizes qwen3-32b --dtypes 4bit --depths 3 --cycle-temperatures 0.6 --decode-tokens 32 --cycles 10 \
      --repeats 4 --small-m-kernel --small-m-loops --json-out "$work/real-32b-graphs-${limits%/*}.json"
  done
elif [ "$PART" = decode-graphs ]; then
  # Where the 32B's decode time goes: at 4000 ops a graph the host split still read host 21.3
  # ms against a wait of 0.02 ms with only 6.2 ms of it Python building the step, and both
  # decodes got slower (ours 23.8 ms, mlx-lm's 29.8): the rest is MLX encoding the step into
  # CUDA graphs. The decode figures alone (real_size --decode-only), stock and with the
  # kernel, at MLX's defaults and with CUDA graphs off (each kernel launched as it is encoded).
  for setting in default no-graphs; do
    if [ "$setting" = default ]; then env=(); else env=(MLX_USE_CUDA_GRAPHS=0); fi
    step "decode-32b-${DTYPES:-4bit}-$setting" $([ "$setting" = default ] && echo 200 || echo 170) env "${env[@]}" python3 -m mtplxd.engine.bench.real_size \
      --sizes qwen3-32b --dtypes "${DTYPES:-4bit}" --decode-only --decode-tokens 32 --repeats 4 \
      --small-m-kernel --json-out "$work/decode-32b-${DTYPES:-4bit}-$setting.json"
  done
elif [ "$PART" = step-profile ]; then
  # The device's own time for a step (bench.step_profile): each run's steps profiled by
  # Nsight Compute, one workload per CUDA graph (graph mode) or per kernel (node mode), then
  # summed per step beside the same steps' unprofiled wall time. Reserve ~150 s on a fresh
  # machine: the first process compiles MLX's kernels. SIZE (qwen3-32b) at DTYPES (4bit).
  sp=(python3 -m mtplxd.engine.bench.step_profile --size "${SIZE:-qwen3-32b}" --dtype "${DTYPES:-4bit}"
      ${STACKED:+--stacked} ${NORM_ROPE:+--qk-norm-rope})
  step wall-ar 150 "${sp[@]}" --steps 16 --json-out "$work/wall-ar.json"
  step wall-ar-kernel 100 "${sp[@]}" --steps 16 --small-m-kernel --json-out "$work/wall-ar-kernel.json"
  step wall-cycle3-kernel 100 "${sp[@]}" --steps 16 --depth 3 --small-m-kernel --json-out "$work/wall-cycle3-kernel.json"
  profile ncu-ar-graphs graph 4
  profile ncu-ar-kernel-graphs graph 4 --small-m-kernel
  profile ncu-cycle3-kernel-graphs graph 4 --depth 3 --small-m-kernel
  profile ncu-ar-nodes node 1
  profile ncu-ar-kernel-nodes node 1 --small-m-kernel
elif [ "$PART" = graph-limits ]; then
  sp=(python3 -m mtplxd.engine.bench.step_profile --size "${SIZE:-qwen3-4b}" --dtype "${DTYPES:-4bit}" --small-m-kernel)
  declare -A limits=([shipped]="" [one-graph]="MLX_MAX_OPS_PER_BUFFER=1000 MLX_MAX_MB_PER_BUFFER=100000"
                     [small-graphs]="MLX_MAX_OPS_PER_BUFFER=20" [no-graphs]="MLX_USE_CUDA_GRAPHS=0")
  step launch-tests 60 python3 -m pytest -q -p no:cacheprovider tests/engine/test_bench_launch_cost.py
  for name in shipped no-graphs; do
    step "launch-cost-$name" 60 env ${limits[$name]} python3 -m mtplxd.engine.bench.launch_cost \
      --json-out "$work/launch-cost-$name.json"
  done
  for r in $(seq "${ROUNDS:-2}"); do
    for name in shipped one-graph small-graphs no-graphs; do
      step "wall-$name-$r" 90 env ${limits[$name]} "${sp[@]}" --steps 256 --json-out "$work/wall-$name-$r.json"
    done
  done
  profile ncu-shipped-graphs graph 4
  sp=(env MLX_MAX_OPS_PER_BUFFER=1000 MLX_MAX_MB_PER_BUFFER=100000 "${sp[@]}")
  profile ncu-one-graph-graphs graph 4
elif [ "$PART" = arms ]; then
  sa=(python3 -m mtplxd.engine.bench.step_arms --rounds "${ROUNDS:-4}")
  step arms-4b 200 "${sa[@]}" --size qwen3-4b --dtype 4bit --steps 256 \
    --arms kernel,kernel+stacked+norm-rope,kernel+stacked,kernel+norm-rope --json-out "$work/arms-4b.json"
  step arms-32b-8bit 200 "${sa[@]}" --size qwen3-32b --dtype 8bit --steps 64 \
    --arms kernel,kernel+mixed,kernel+mixed+compiled-ar --json-out "$work/arms-32b-8bit.json"
  step arms-32b-4bit 200 "${sa[@]}" --size qwen3-32b --dtype 4bit --steps 64 \
    --arms kernel,kernel+row-invariant,kernel+stacked+norm-rope --json-out "$work/arms-32b-4bit.json"
elif [ "$PART" = norm-rope ]; then
  [ -n "${SKIP_TESTS:-}" ] || step cuda-tests 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_qk_norm_rope.py
  sp=(python3 -m mtplxd.engine.bench.step_profile --size "${SIZE:-qwen3-4b}" --dtype "${DTYPES:-4bit}" --small-m-kernel)
  for r in $(seq "${ROUNDS:-2}"); do
    step "wall-ar-off-$r" 90 "${sp[@]}" --steps 256 --json-out "$work/wall-ar-off-$r.json"
    step "wall-ar-on-$r" 90 "${sp[@]}" --steps 256 --qk-norm-rope --json-out "$work/wall-ar-on-$r.json"
  done
  step wall-cycle3-on 90 "${sp[@]}" --depth 3 --steps 128 --qk-norm-rope --json-out "$work/wall-cycle3-on.json"
  step wall-cycle3-off 90 "${sp[@]}" --depth 3 --steps 128 --json-out "$work/wall-cycle3-off.json"
  profile ncu-ar-on-nodes node 1 --qk-norm-rope
elif [ "$PART" = divergence ]; then
  step "divergence-${SIZE:?set SIZE}-${DTYPES:-4bit}" 560 python3 -m mtplxd.engine.bench.real_size \
    --sizes "$SIZE" --dtypes "${DTYPES:-4bit}" --depths "" --cycle-temperatures 0 --decode-tokens 16 \
    --repeats 2 --divergence-tokens "${TOKENS:-2000}" ${NORM_ROPE:+--qk-norm-rope} ${CONTEXT:+--context "$CONTEXT"} \
    --json-out "$work/divergence-$SIZE-${DTYPES:-4bit}${NORM_ROPE:+-norm-rope}${CONTEXT:+-$CONTEXT}.json"
elif [ "$PART" = hybrid-parity ]; then
  step hybrid-parity 540 python3 -m mtplxd.engine.bench.ar_parity --size hybrid-27b \
    --dtypes "${DTYPES:-4bit,8bit}" --tokens 64 --repeats 6 --budget-s $(( BUDGET - 80 )) \
    --json-out "$work/hybrid-parity.json"
elif [ "$PART" = hybrid-prefill ]; then
  step "hybrid-prefill-${DTYPES:-4bit}" 540 python3 -m mtplxd.engine.bench.real_size --sizes hybrid-27b \
    --dtypes "${DTYPES:-4bit}" --decode-only --decode-tokens 16 --repeats 2 --prefill-tokens "${TOKENS:-4096}" \
    --json-out "$work/hybrid-prefill-${DTYPES:-4bit}.json"
elif [ "$PART" = gdn-kernel ]; then
  step gdn-kernel-tests 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gdn_kernel.py
  # mlx-lm's ops first: the first 27B process of a machine compiles MLX's kernels for ~170 s
  # (on 2026-12-04, fourth session, the kernel went first and its step was cut at 170 s).
  for setting in ops kernel; do
    step "gdn-decode-${DTYPES:-4bit}-$setting" $([ "$setting" = ops ] && echo 280 || echo 170) env MTPLX_GDN_KERNEL=$([ "$setting" = kernel ] && echo 1 || echo 0) \
      python3 -m mtplxd.engine.bench.real_size --sizes hybrid-27b --dtypes "${DTYPES:-4bit}" --decode-only \
      --decode-tokens 32 --repeats 4 --json-out "$work/gdn-decode-${DTYPES:-4bit}-$setting.json"
  done
elif [ "$PART" = ar-loop ]; then
  # The hybrid's AR request as served since 2026-12-04 (fourth session): the compiled loop
  # (fused_ar.py), then the op-by-op loop (MTPLX_FUSED_AR=0), both with the GDN kernel.
  for setting in compiled op-by-op; do
    step "ar-loop-${DTYPES:-4bit}-$setting" $([ "$setting" = compiled ] && echo 280 || echo 170) \
      env MTPLX_FUSED_AR=$([ "$setting" = compiled ] && echo 1 || echo 0) \
      python3 -m mtplxd.engine.bench.real_size --sizes hybrid-27b --dtypes "${DTYPES:-4bit}" --decode-only \
      --decode-tokens 32 --repeats 4 --json-out "$work/ar-loop-${DTYPES:-4bit}-$setting.json"
  done
elif [ "$PART" = compiled-decode ]; then
  # Decode in the compiled AR loop. SIZE=hybrid-27b (served compiled on CUDA): 4-bit with its
  # decode steps on the vector layout from each weight count in FROM (64M: its MLP and lm_head;
  # 16M: its GDN and attention projections too), MLX's matvec beside it in each process;
  # SIZE=hybrid-27b-dtypes: bf16 and 8-bit. SIZE=qwen3-32b: the compiled loop
  # (MTPLX_FUSED_AR=1) against op by op (=0), 4-bit and 8-bit, the kernel as served.
  if [ "${SIZE:-hybrid-27b}" = hybrid-27b ]; then
    # Each of the hybrid's matrices alone at one row: which the vector layout beats MLX's matvec on.
    step small-m-hybrid 90 python3 -m mtplxd.engine.bench.small_m "$work/small-m-hybrid.json" \
      --sizes hybrid-27b --bits 4 --rows 1 --repeats 6 --shipped-only
    for from in ${FROM:-67108864 16777216}; do
      step "compiled-decode-hybrid-4bit-$from" 280 python3 -m mtplxd.engine.bench.real_size --sizes hybrid-27b \
        --dtypes 4bit --decode-only --decode-tokens 32 --repeats 4 --small-m-kernel --kernel-decode-from "$from" \
        --json-out "$work/compiled-decode-hybrid-4bit-$from.json"
    done
  elif [ "$SIZE" = hybrid-27b-dtypes ]; then
    step compiled-decode-hybrid-bf16-8bit 300 python3 -m mtplxd.engine.bench.real_size --sizes hybrid-27b \
      --dtypes bf16,8bit --decode-only --decode-tokens 32 --repeats 4 --json-out "$work/compiled-decode-hybrid-bf16-8bit.json"
  else
    for setting in 1 0; do
      step "compiled-decode-$SIZE-ar$setting" 280 env MTPLX_FUSED_AR=$setting python3 -m mtplxd.engine.bench.real_size \
        --sizes "$SIZE" --dtypes "${DTYPES:-4bit,8bit}" --decode-only --decode-tokens 32 --repeats 4 \
        --small-m-kernel --json-out "$work/compiled-decode-$SIZE-ar$setting.json"
    done
  fi
elif [ "$PART" = row-invariant ]; then
  step cuda-test 90 python3 -m pytest -q -p no:cacheprovider -k "cuda_mma_layout_is_row_invariant" \
    tests/engine/test_small_m_qmm.py
  step "divergence-hybrid-${DTYPES:-4bit}-row-invariant" "${DIVERGENCE_CAP:-330}" python3 -m mtplxd.engine.bench.real_size \
    --sizes hybrid-27b --dtypes "${DTYPES:-4bit}" --depths "" --cycle-temperatures 0 --decode-tokens 16 \
    --repeats 2 --divergence-tokens "${TOKENS:-300}" --row-invariant \
    --json-out "$work/divergence-hybrid-${DTYPES:-4bit}-row-invariant.json"
  step "decode-hybrid-${DTYPES:-4bit}-row-invariant" 200 python3 -m mtplxd.engine.bench.real_size \
    --sizes hybrid-27b --dtypes "${DTYPES:-4bit}" --decode-only --decode-tokens 32 --repeats 4 \
    --small-m-kernel --row-invariant --json-out "$work/decode-hybrid-${DTYPES:-4bit}-row-invariant.json"
elif [ "$PART" = row-invariant-kernels ]; then
  step cuda-tests 200 python3 -m pytest -q -p no:cacheprovider -k "cuda and row_invariant" tests/engine/test_small_m_qmm.py
  step small-m-hybrid-rows 300 python3 -m mtplxd.engine.bench.small_m "$work/small-m-hybrid-rows.json" \
    --sizes hybrid-27b --bits 4,8 --rows 1,2,4,7 --repeats 6 --shipped-only
elif [ "$PART" = routings ]; then
  size=${SIZE:-hybrid-27b}
  step "routings-$size-${DTYPES:-4bit}" 400 python3 -m mtplxd.engine.bench.real_size --sizes "$size" \
    --dtypes "${DTYPES:-4bit}" --depths 1,3 --cycle-temperatures 0,0.6 --decode-tokens 32 --cycles 10 \
    --repeats 4 --small-m-kernel --small-m-loops --row-invariant-beside \
    --json-out "$work/routings-$size-${DTYPES:-4bit}.json"
  if [ -n "${TOKENS:-}" ]; then
    step "divergence-$size-${DTYPES:-4bit}-row-invariant" 330 python3 -m mtplxd.engine.bench.real_size \
      --sizes "$size" --dtypes "${DTYPES:-4bit}" --depths "" --cycle-temperatures 0 --decode-tokens 16 \
      --repeats 2 --divergence-tokens "$TOKENS" --row-invariant \
      --json-out "$work/divergence-$size-${DTYPES:-4bit}-row-invariant.json"
  else
    step small-m-hybrid-mma-variants 150 python3 -m mtplxd.engine.bench.small_m \
      "$work/small-m-hybrid-mma-variants.json" --sizes hybrid-27b --bits 4 --rows 1,4 --repeats 6 \
      --shipped-only --mma-variants
  fi
elif [ "$PART" = mma-shape ]; then
  step mma-shape-hybrid-4bit 480 python3 -m mtplxd.engine.bench.real_size --sizes hybrid-27b --dtypes 4bit \
    --depths 3 --cycle-temperatures 0.6 --decode-tokens 32 --cycles 10 --repeats 3 --small-m-kernel \
    --small-m-loops --row-invariant --mma-configs "${CONFIGS:-8x4,4x2s4}" \
    --json-out "$work/mma-shape-hybrid-4bit.json"
elif [ "$PART" = fusion ]; then
  step fused-products 240 python3 -m mtplxd.engine.bench.fused_products "$work/fused-products.json" \
    --sizes "${SIZES:-hybrid-27b,qwen3-32b}" --bits "${BITS:-4,8}" --rows 1,4 --repeats 10
  size=${SIZE:-hybrid-27b}  # its served routing: row-invariant for the hybrid, in cycles for a dense model
  step "stacked-$size-${DTYPES:-4bit}" 330 python3 -m mtplxd.engine.bench.real_size --sizes "$size" \
    --dtypes "${DTYPES:-4bit}" --depths 3 --cycle-temperatures 0.6 --decode-tokens 32 --cycles 10 --repeats 3 \
    --small-m-kernel --small-m-loops $([ "$size" = hybrid-27b ] && echo --row-invariant) --stacked \
    --json-out "$work/stacked-$size-${DTYPES:-4bit}.json"
elif [ "$PART" = stacked-profile ]; then
  depth=${DEPTH:-0}
  tag=$([ "$depth" = 0 ] && echo ar || echo "cycle$depth")
  sp=(python3 -m mtplxd.engine.bench.step_profile --size "${SIZE:-qwen3-32b}" --dtype "${DTYPES:-4bit}"
      --small-m-kernel --depth "$depth")
  for round in $(seq 1 "${ROUNDS:-2}"); do
    step "wall-$tag-separate-$round" 150 "${sp[@]}" --steps 32 --json-out "$work/wall-$tag-separate-$round.json"
    step "wall-$tag-stacked-$round" 120 "${sp[@]}" --stacked --steps 32 --json-out "$work/wall-$tag-stacked-$round.json"
  done
  profile "ncu-$tag-nodes-separate" node 1
  profile "ncu-$tag-nodes-stacked" node 1 --stacked
elif [ "$PART" = decode-routing ]; then
  name="decode-routing-32b-${DTYPES:-4bit}-${CONTEXT:-512}-ar${MTPLX_FUSED_AR:-served}"
  step "$name" 330 python3 -m mtplxd.engine.bench.real_size --sizes qwen3-32b --context "${CONTEXT:-512}" \
    --dtypes "${DTYPES:-4bit}" --depths "" --cycle-temperatures 0 --decode-tokens 32 --repeats 2 \
    --small-m-kernel --small-m-loops --decode-vector-values 33554432,0,67108864 --json-out "$work/$name.json"
elif [ "$PART" = decode-routing-profile ]; then
  sp=(python3 -m mtplxd.engine.bench.step_profile --size "${SIZE:-qwen3-32b}" --dtype "${DTYPES:-4bit}"
      --small-m-kernel --depth 0)
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for values in 67108864 33554432; do
      step "wall-ar-$values-$round" 120 "${sp[@]}" --decode-vector-values "$values" --steps 32 \
        --json-out "$work/wall-ar-$values-$round.json"
    done
  done
  for values in 67108864 33554432; do
    profile "ncu-ar-nodes-$values" node 1 --decode-vector-values "$values"
  done
elif [ "$PART" = attention-split ]; then
  [ -n "${SKIP_TESTS:-}" ] || step cuda-tests 150 python3 -m pytest -q -p no:cacheprovider -k "split or two_pass or mma or offset or scalars" \
    tests/engine/test_buffer_attention.py tests/engine/test_bench_attention_profile.py
  name="attention-forms-${SIZE:-qwen3-32b}-${DTYPES:-4bit}-${CONTEXT:-8192}"
  step "$name" 480 python3 -m mtplxd.engine.bench.real_size --sizes "${SIZE:-qwen3-32b}" --dtypes "${DTYPES:-4bit}" \
    --context "${CONTEXT:-8192}" --depths 3 --cycle-temperatures 0 --decode-tokens 32 --cycles 10 --repeats 2 \
    --small-m-kernel --decode-only --attention-forms "${FORMS:-one-pass,split,0}" --json-out "$work/$name.json"
elif [ "$PART" = attention-profile ]; then
  [ -n "${SKIP_TESTS:-}" ] || step cuda-tests 150 python3 -m pytest -q -p no:cacheprovider -k "split or two_pass or mma or offset or scalars" \
    tests/engine/test_buffer_attention.py tests/engine/test_bench_attention_profile.py
  for context in ${CONTEXTS:-512 2048 8192}; do
    for rows in 1 4; do
      for pick in ${FORMS:-one-pass split two-pass mlx masked}; do  # split-N[-wW][-pP], mma-N[-wW]: their knobs
        form=${pick%%-[0-9]*}
        knobs=()  # else the shipped chunk, warps and pairs
        IFS=- read -ra parts <<< "${pick#"$form"}"
        for part in "${parts[@]}"; do
          case $part in
            w*) knobs+=(--"$form"-warps "${part#w}") ;;
            p*) knobs+=(--split-pairs "${part#p}") ;;
            [0-9]*) knobs+=(--"$form"-slots "$part") ;;
          esac
        done
        name="attention-$pick-$context-$rows${TAG:+-$TAG}"
        step "$name" 60 ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \
          python3 -m mtplxd.engine.bench.attention_profile --form "$form" --context "$context" --rows "$rows" \
          "${knobs[@]}" ${SHAPE_ARGS:-} ${ARGS:-} --calls 16 --profiled --json-out "$work/$name.json"
        [ ! -f "$work/$name.log" ] || python3 -m mtplxd.engine.bench.step_profile --summarize "$work/$name.log" \
          --steps 16 --json-out "$work/$name-ncu.json" || true  # (no log: the budget skipped the step)
      done
    done
  done
elif [ "$PART" = in-place ]; then
  step attention-tests 150 python3 -m pytest -q -p no:cacheprovider -k "split or two_pass or mma or offset or scalars" \
    tests/engine/test_buffer_attention.py tests/engine/test_bench_attention_profile.py
  step cuda-tests 160 python3 -m pytest -q -p no:cacheprovider -k "cuda and (in_place or bit_for_bit)" \
    tests/engine/test_small_m_qmm.py
  step small-m-32b 240 python3 -m mtplxd.engine.bench.small_m "$work/small-m-32b.json" \
    --sizes qwen3-32b --bits 4,8 --rows "${ROWS:-1,4}" --repeats 6 --shipped-only
elif [ "$PART" = kv-write ]; then
  for context in 512 "${CONTEXT:-8192}"; do
    step "kv-write-32b-${DTYPES:-4bit}-$context" 270 python3 -m mtplxd.engine.bench.real_size --sizes qwen3-32b \
      --dtypes "${DTYPES:-4bit}" --context "$context" --depths 3 --cycle-temperatures 0 --decode-tokens 32 \
      --cycles 10 --repeats 2 --small-m-kernel --small-m-loops --kv-write-beside \
      --json-out "$work/kv-write-32b-${DTYPES:-4bit}-$context.json"
  done
elif [ "$PART" = mma-pipelined ]; then
  step cuda-tests 150 python3 -m pytest -q -p no:cacheprovider -k "cuda and (pipelined or row_invariant)" \
    tests/engine/test_small_m_qmm.py
  step small-m-mma-configs 240 python3 -m mtplxd.engine.bench.small_m "$work/small-m-mma-configs.json" \
    --sizes hybrid-27b,qwen3-32b --bits 4 --rows 1,6 --repeats 6 --shipped-only --mma-variants
elif [ "$PART" = hybrid-verify ]; then
  step hybrid-verify-only 540 python3 -m mtplxd.engine.bench.real_size --sizes hybrid-27b --dtypes 4bit \
    --depths 1,3 --cycle-temperatures 0,0.6 --decode-tokens 32 --cycles 10 --repeats 6 \
    --small-m-kernel --small-m-loops --kernel-decode-from never --json-out "$work/hybrid-verify-only.json"
elif [ "$PART" = timeline ]; then
  together=(python3 -m mtplxd.engine.bench.small_m_ncu --size qwen3-32b --matrix gate_proj --bits 4
            --rows 1,6 --calls 5 --together 16)
  step together 90 "${together[@]}"
  step together-no-graphs 90 env MLX_USE_CUDA_GRAPHS=0 "${together[@]}"  # each kernel its own launch
  command -v nsys >/dev/null || PATH=$PATH:$(ls -d /opt/nvidia/nsight-systems/*/bin 2>/dev/null | tail -1)
  if command -v nsys >/dev/null; then
    step nsys 150 nsys profile --cuda-graph-trace=node --stats=true --force-overwrite true \
      -o /root/nsys-together "${together[@]}"  # the report stays there: it can pass 16 MiB
  else
    echo "no nsys on this machine: $(ls /opt/nvidia 2>/dev/null | tr '\n' ' ')"
  fi
elif [ "$PART" = ncu ]; then
  sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
            --section MemoryWorkloadAnalysis --section SchedulerStats)
  for shape in "gate_proj 1,6" "down_proj 1" "k_proj 1"; do
    set -- $shape
    step "ncu-$1" 150 ncu --clock-control none -k regex:'small_m|qmv|qmm|gemv|affine' "${sections[@]}" \
      python3 -m mtplxd.engine.bench.small_m_ncu --size qwen3-32b --matrix "$1" --bits 4 --rows "$2" --calls 2
  done
elif [ "$PART" = read-ceiling ]; then
  [ -n "${SKIP_TESTS:-}" ] || step cuda-tests 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_bench_read_ceiling.py \
    tests/engine/test_small_m_qmm.py -k "read or persistent"
  sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
            --section MemoryWorkloadAnalysis --section SchedulerStats)
  for matrix in ${MATRICES:-gate_proj down_proj q_proj}; do
    step "ncu-read-$matrix" 150 ncu --clock-control none -k regex:'small_m_qmm_(vector|mma)|read_ceiling' \
      "${sections[@]}" python3 -m mtplxd.engine.bench.small_m_ncu --size qwen3-32b --matrix "$matrix" \
      --bits 4 --rows 1 --calls 1 --vector-rows 4 --persistent-blocks "${PERSISTENT-264,660}" \
      ${UNROLL:+--unroll "$UNROLL"} --read-ceiling
  done
else
  # PART=widen: where the kernel is off by default and not yet timed whole (32B 8-bit, the
  # 4B and the hybrid 27B at 4-bit), stock and kernel side by side, all depths, both
  # temperatures: what small_m_qmm.default_wanted would need to cover them.
  wide=(--depths 1,2,3,4,5 --cycle-temperatures 0,0.6 --decode-tokens 32 --cycles 10 --repeats 6
        --small-m-kernel --small-m-loops)
  step widen-32b-8bit 200 python3 -m mtplxd.engine.bench.real_size --sizes qwen3-32b --dtypes 8bit \
    "${wide[@]}" --json-out "$work/widen-32b-8bit.json"
  step widen-4b-4bit 150 python3 -m mtplxd.engine.bench.real_size --sizes qwen3-4b --dtypes 4bit \
    "${wide[@]}" --json-out "$work/widen-4b-4bit.json"
  step widen-hybrid-4bit 200 python3 -m mtplxd.engine.bench.real_size --sizes hybrid-27b --dtypes 4bit \
    "${wide[@]}" --json-out "$work/widen-hybrid-4bit.json"
fi
tar czf "$OUT/h200-vector-qmm-$PART.tgz" -C "$work" .
echo "done in $(( $(date +%s) - started ))s"
