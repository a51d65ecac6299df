"""Attention of a few query rows over a fixed-capacity KV buffer, in one CUDA kernel.

Why: the fused cycle (fused.py) attends over whole cache buffers with a mask that hides the
slots past each query's position. MLX has no single kernel for that shape on CUDA: the
verify's K+1 rows go to cuDNN, whose per-call cost on the host is several times a plain
kernel's, and a chained draft step's one masked row falls back to a chain of ordinary ops.
On the H200, where a small model's decode is bound by the host, this kernel made the
embedded model's depth-6 cycle about 15% faster (docs/benchmarks.md, "Attention over the
cache buffer"; `python -m mtplxd.engine.bench.ops OUT.json sdpa` times one call of each).

The kernel computes each query row as MLX's one-pass vector kernel for decoding computes its
one query (`kernel_sdpav_1pass` in mlx/backend/cuda/scaled_dot_product_attention.cu: the
same work split, the same arithmetic in the same order), over the first `offset + i + 1` key
slots for row i. A verify row therefore rounds as the AR decode step over the same keys,
which keeps greedy MTP equal to greedy AR on CUDA while MLX runs AR steps on that kernel
(it does below 256 cached keys; from there its decode steps may go to cuDNN, and the two
can round apart, as they could before). Other backends keep
mx.fast.scaled_dot_product_attention with the mask.

Three more forms. By default (`MTPLX_BUFFER_ATTENTION` unset) buffers of SPLIT_FROM_SLOTS slots
or more take the mma form where its domain holds the head (16-bit, 64-128) and the split form
elsewhere, smaller ones the one-pass kernel (`form_for`); `one-pass`, `split`, `two-pass` or
`mma` asks for that form at every size, "0" turns every buffer kernel off. The one-pass
kernel gives each query row one
block, whose 32 warps walk all of that row's keys one after the other and reduce each key's
score across the warp, and every query head of a GQA group reads the same keys again; so its
time grows with the context (on an H200 a 32B layer took 196 us for one row at 8,192 tokens,
269 for four, where MLX's attention over the keys seen, cuDNN's, took 36 and 139:
docs/benchmarks.md, "The attention's instructions").

The split form (`_SPLIT_SOURCE`) gives a block to each KV head's SPLIT_SLOTS-slot chunk: it
stages the chunk's keys and values in shared memory a tile at a time, once for all the
group's query heads and rows, and each lane scores one staged key whole, so no score needs an
exchange between lanes; a second kernel merges the chunks' parts (`_MERGE_SOURCE`). The
chunks are fixed by the slot index, and a (query head, row) pair's arithmetic depends on
nothing else in the call, so a verify row rounds as the compiled AR step of the same position
(it does not round as the one-pass kernel, so the split form applies to all of a loop's calls
or none: it is read when a loop is traced). A buffer of one chunk keeps the one-pass kernel.
Its kernels also take a fused cohort's batch of rows, each computed as alone.
Its first two kernels spread each query over the lanes and gathered scores by shuffles: they
ran at 137 us (one row) and 308 (four) on that H200, bound by the instructions they issued,
not by memory. This third one took 74 us and 155 on an H100 at 8,192 tokens, where the
one-pass kernel took 196 and 253; at 1,024 tokens it lost, 55 and 85 against 40 and 63, a
block's 4 warps working through their tiles with little to hide their latency
(docs/benchmarks.md, "The split form on an H100"). With its offset in device memory rather
than MLX's managed pool (SCALAR_VECTOR_ELEMENTS) it took 54 and 118 us at 8,192 tokens and
32 and 52 at 1,024, level with the one-pass kernel there at one row: hence the default's
threshold (SPLIT_FROM_SLOTS).

The two-pass form (`_TWO_PASS_SOURCE`) keeps the one-pass kernel's per-key arithmetic but
spreads each row's keys over TWO_PASS_BLOCKS blocks of 8 warps, as MLX's two-pass decode
kernel and cuDNN's split-KV attention do, and merges their parts with the split form's merge.
A block serves up to TWO_PASS_MAX_ROWS rows of one query head, loading each key once for all
of them; a GQA group's keys are read once per query head, as the one-pass kernel does, relying
on L2 for the repeats. A warp's keys are fixed by slot, so a verify row rounds as the 1-row
call at its position here too. On the H200 it took 118 us at one row and 266 at four: the
one-pass kernel's arithmetic per key, spread wider.

The mma form (`_MMA_SOURCE`) computes the split form's parts on the tensor cores: scores and
weighed values of 16 (query head, row) pairs by 16 keys a pass of mma.sync, so a verify's rows
cost little more than a decode step's; the split form's merge adds them. On an H100 (2026-12-07,
eighth session) a Qwen3-32B layer's first pass took 22 us (one row) and 41 (four) at 8,192
tokens where the split form's took 35 and 101, 14 and 18 at 2,048 where it took 22 and 44; the
32B 4-bit's depth-3 cycle at 8,192 tokens 23.8-24.0 ms against 25.5-27.7 (docs/benchmarks.md,
"The buffer attention on the tensor cores timed"; docs/engine.md, "The mma form").
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Callable, Iterator

import mlx.core as mx

from mtplxd.engine.model import custom_kernels
from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

_HEADER = r"""#include <cooperative_groups/reduce.h>

// The sizeof(V) / sizeof(T) elements at `src` (aligned to sizeof(V)) as floats, in one load.
template <typename V, typename T>
__device__ __forceinline__ void load_floats(const T* src, float* dst) {
    const V raw = *reinterpret_cast<const V*>(src);
    const T* packed = reinterpret_cast<const T*>(&raw);
    #pragma unroll
    for (int x = 0; x < (int)(sizeof(V) / sizeof(T)); ++x) dst[x] = static_cast<float>(packed[x]);
}
"""

# Grid: x = query head, y = query row; a block of 32 warps. Warp w takes key slots w, w+32,
# w+64, ... below the row's limit; lane l holds head-dim elements [l*E, l*E+E) of q, k, v and
# of its running output. Scores are in base 2 (q pre-multiplied by scale*log2(e)) and the
# softmax runs online; the 32 warps' partial results are then merged through shared memory.
# Each step, and its order, is that of MLX's decode kernel, so the result rounds the same.
_SOURCE = r"""
    constexpr int WARPS = 32;
    constexpr int E = D / 32;
    __shared__ float warp_max[WARPS];
    __shared__ float warp_sum[WARPS];
    __shared__ float exchange[WARPS][WARPS + 1];

    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int lane = warp.thread_rank();
    const int w = warp.meta_group_rank();

    const int rows = queries_shape[2];
    const int slots = keys_shape[2];
    const int head = blockIdx.x;
    const int row = blockIdx.y;
    const int kv_head = head / (queries_shape[1] / keys_shape[1]);
    const int limit = min(offset[0] + row + 1, slots);  // slots this row may see

    const T* q_row = queries + ((size_t)head * rows + row) * D + lane * E;
    const T* k_slot = keys + ((size_t)kv_head * slots + w) * D + lane * E;
    const T* v_slot = values + ((size_t)kv_head * slots + w) * D + lane * E;
    const float q_scale = (float)((double)scale[0] * 1.4426950408889634);  // * log2(e)

    float qs[E], acc[E];
    for (int e = 0; e < E; ++e) {
        qs[e] = q_scale * static_cast<float>(q_row[e]);
        acc[e] = 0.f;
    }
    float run_max = Limits<float>::finite_min();
    float run_sum = 0.f;
    for (int slot = w; slot < limit; slot += WARPS) {
        float ks[E];
        for (int e = 0; e < E; ++e) ks[e] = k_slot[e];
        float score = 0.f;
        for (int e = 0; e < E; ++e) score += qs[e] * ks[e];
        score = cg::reduce(warp, score, cg::plus<float>());
        const float top = max(run_max, score);
        const float rescale = exp2f(run_max - top);
        const float weight = exp2f(score - top);
        run_max = top;
        run_sum = run_sum * rescale + weight;
        for (int e = 0; e < E; ++e) acc[e] = acc[e] * rescale + weight * static_cast<float>(v_slot[e]);
        k_slot += WARPS * D;
        v_slot += WARPS * D;
    }

    // Merge: lane j of every warp stands for warp j's partial result.
    if (lane == 0) {
        warp_max[w] = run_max;
        warp_sum[w] = run_sum;
    }
    block.sync();
    const float top = cg::reduce(warp, warp_max[lane], cg::greater<float>());
    const float rescale = exp2f(warp_max[lane] - top);
    float total = cg::reduce(warp, warp_sum[lane] * rescale, cg::plus<float>());
    total = total == 0 ? 0 : __frcp_rn(total);
    for (int e = 0; e < E; ++e) {
        exchange[lane][w] = acc[e];  // element lane*E+e of warp w's partial
        block.sync();
        // Now warp w sums element w*E+e over the 32 partials, one per lane.
        acc[e] = cg::reduce(warp, exchange[w][lane] * rescale, cg::plus<float>()) * total;
        block.sync();
    }
    if (lane == 0) {
        T* out_row = out + ((size_t)head * rows + row) * D + w * E;
        for (int e = 0; e < E; ++e) out_row[e] = static_cast<T>(acc[e]);
    }
"""


def _edited(source: str, *edits: tuple[str, str]) -> str:
    """`source` with each (old, new) replaced, every old text found exactly once (a kernel
    built from another must fail here, not index wrongly, when that other one changes)."""
    for old, new in edits:
        if source.count(old) != 1:
            raise ValueError(f"kernel source edit: {old!r} found {source.count(old)} times")
        source = source.replace(old, new)
    return source


# The same kernel over W rows of a fused cohort (fused_cohort.py), each at its own offset:
# blockIdx.z is the row, whose queries, buffers and output sit at its own batch index. Every
# row computes as the one-row kernel computes it, so a cohort row rounds as its solo cycle.
_ROWS_SOURCE = _edited(
    _SOURCE,
    ("const int head = blockIdx.x;", "const int head = blockIdx.x;\n    const int batch = blockIdx.z;"),
    ("offset[0] + row + 1", "offset[batch] + row + 1"),
    ("queries + ((size_t)head * rows + row)", "queries + (((size_t)batch * queries_shape[1] + head) * rows + row)"),
    ("keys + ((size_t)kv_head * slots + w)", "keys + (((size_t)batch * keys_shape[1] + kv_head) * slots + w)"),
    ("values + ((size_t)kv_head * slots + w)", "values + (((size_t)batch * keys_shape[1] + kv_head) * slots + w)"),
    ("out + ((size_t)head * rows + row)", "out + (((size_t)batch * queries_shape[1] + head) * rows + row)"))

# The split form's first pass. Grid: x = KV head (of each batch row: a fused cohort's W rows
# take W x KV heads blocks, one offset a row), y = chunk of CHUNK key slots, z = a slice of
# the (query head of the group, row) pairs; a block of WARPS warps. The block stages TILE key
# slots of its KV head at a time in shared memory, read once for every pair of its slice (the
# one-pass kernel reads them once per query head). Warp w serves pairs w, w + WARPS, ...,
# PAIRS of them at most, each with its own online softmax. For one tile, lane s forms the
# whole score of key slot s with each of the warp's pairs (the key's elements converted once
# for all of them, the queries read from shared memory by every lane at once): no exchange
# between lanes. The first form of this kernel spread the query's elements over the lanes and
# gathered each score with a butterfly exchange; on an H200 it issued 2.4 instructions a cycle
# on its integer pipes and took 131 us at one row and 8k tokens (docs/benchmarks.md, "The
# attention's instructions"). Each lane then adds its E elements of the values, weighed,
# in slot order. Each block writes its chunk's running maximum, its sum of weights and its
# unnormalised output (float32) to part_max, part_sum and part_acc, (batch, heads, rows, chunks[, D]);
# a chunk past every row's limit returns at once, and the merge reads, for each row, only the
# chunks below its limit. A pair's arithmetic depends only on its query, its limit and the
# slots of its chunk, never on the other pairs in the call, so a verify row rounds as a 1-row
# call.
_SPLIT_SOURCE = r"""
    constexpr int TILE = 32;  // keys staged at once: scored one a lane
    constexpr int E = D / 32;  // elements of a pair's output a lane holds
    constexpr int VEC = 16 / sizeof(T);  // elements of one 16-byte load
    constexpr int ROW = D + VEC;  // a staged key's stride: 8 lanes' 16-byte loads of 8 keys hit 8 bank groups
    constexpr int VECS = (TILE * D / VEC + WARPS * 32 - 1) / (WARPS * 32);  // a thread's loads a tile, each of K and V
    __shared__ __align__(16) T k_tile[TILE * ROW];
    __shared__ __align__(16) T v_tile[TILE * D];
    __shared__ __align__(16) float q_tile[WARPS * PAIRS * D];
    __shared__ int at_offset;
    __shared__ float at_scale;

    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int lane = warp.thread_rank();
    const int w = warp.meta_group_rank();

    const int rows = queries_shape[2];
    const int kv_heads = keys_shape[1];
    const int slots = keys_shape[2];
    const int group = queries_shape[1] / kv_heads;
    const int pairs = group * rows;
    const int kv_head = blockIdx.x % kv_heads;
    const int batch = blockIdx.x / kv_heads;  // a fused cohort's row (0 for a single stream)
    const int chunk = blockIdx.y;
    const int first = blockIdx.z * WARPS * PAIRS;  // this block's first pair (z: a slice of many)
    const int begin = chunk * CHUNK;
    if (threadIdx.x == 0) {  // SCALARS_ONCE: one read of each scalar a block
        at_offset = offset[batch];
        at_scale = scale[0];
    }
    block.sync();
    const int stop = min(begin + CHUNK, min(at_offset + rows, slots));  // one past the last row's last slot here
    if (begin >= stop) return;  // past every row's keys: the merge reads no part of this chunk
    const float q_scale = (float)((double)at_scale * 1.4426950408889634);  // * log2(e)

    // Warp w serves pairs w, w + WARPS, ...: their queries (scaled, float32) in shared memory,
    // their running maximum, sum and output in registers, lane l holding elements [l*E, l*E+E).
    float acc[PAIRS][E], run_max[PAIRS], run_sum[PAIRS];
    int end[PAIRS];  // one past the last slot of this chunk that pair i sees
    #pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
        const int pair = first + w + i * WARPS;
        const int p = min(pair, pairs - 1);  // a warp past the last pair idles (end = begin)
        const int row = p % rows;
        const T* q_row = queries + (((size_t)batch * queries_shape[1] + kv_head * group + p / rows) * rows + row) * D;
        float* q_at = q_tile + (w + i * WARPS) * D;
        for (int d = lane; d < D; d += 32) q_at[d] = q_scale * static_cast<float>(q_row[d]);
        end[i] = pair < pairs ? min(begin + CHUNK, min(at_offset + row + 1, slots)) : begin;
        #pragma unroll
        for (int e = 0; e < E; ++e) acc[i][e] = 0.f;
        run_max[i] = Limits<float>::finite_min();
        run_sum[i] = 0.f;
    }

    const T* k_head = keys + ((size_t)batch * kv_heads + kv_head) * slots * D;
    const T* v_head = values + ((size_t)batch * kv_heads + kv_head) * slots * D;
    // Staging: each thread holds its 16-byte loads of the next tile in registers (k_next,
    // v_next) while the warps work on this one, so a tile's memory latency hides behind the
    // last tile's arithmetic. Buffers off a 16-byte boundary take a plain loop.
    const bool aligned = ((reinterpret_cast<size_t>(k_head) | reinterpret_cast<size_t>(v_head)) & 15) == 0;
    uint4 k_next[VECS], v_next[VECS];
    auto fetch = [&](int tile) {  // tile's keys and values into this thread's registers
        const int count = min(TILE, stop - tile) * (D / VEC);
        const uint4* k_src = reinterpret_cast<const uint4*>(k_head + (size_t)tile * D);
        const uint4* v_src = reinterpret_cast<const uint4*>(v_head + (size_t)tile * D);
        #pragma unroll
        for (int j = 0; j < VECS; ++j) {
            const int x = threadIdx.x + j * WARPS * 32;
            if (x < count) {
                k_next[j] = k_src[x];
                v_next[j] = v_src[x];
            }
        }
    };
    if (aligned) fetch(begin);
    for (int tile = begin; tile < stop; tile += TILE) {
        const int staged = min(TILE, stop - tile);
        if (aligned) {
            #pragma unroll
            for (int j = 0; j < VECS; ++j) {
                const int x = threadIdx.x + j * WARPS * 32;
                if (x < staged * (D / VEC)) {
                    *reinterpret_cast<uint4*>(k_tile + (x / (D / VEC)) * ROW + (x % (D / VEC)) * VEC) = k_next[j];
                    reinterpret_cast<uint4*>(v_tile)[x] = v_next[j];
                }
            }
            if (tile + TILE < stop) fetch(tile + TILE);  // in flight through this tile's work
        } else {
            for (int x = threadIdx.x; x < staged * D; x += blockDim.x) {
                k_tile[(x / D) * ROW + x % D] = k_head[(size_t)tile * D + x];
                v_tile[x] = v_head[(size_t)tile * D + x];
            }
        }
        block.sync();

        // Scores: lane s scores key tile + s for each of the warp's pairs, the key's elements
        // converted once for all of them, in four running sums (a lane past `staged` scores a
        // stale row, masked below). No exchange between lanes.
        float score[PAIRS];
        {
            float part[PAIRS][4];
            #pragma unroll
            for (int i = 0; i < PAIRS; ++i) part[i][0] = part[i][1] = part[i][2] = part[i][3] = 0.f;
            const T* k_row = k_tile + lane * ROW;
            #pragma unroll 2
            for (int d = 0; d < D; d += VEC) {
                float k[VEC];
                load_floats<uint4>(k_row + d, k);
                #pragma unroll
                for (int i = 0; i < PAIRS; ++i) {
                    if (tile >= end[i]) continue;  // the same for every lane of the warp
                    const float4* q4 = reinterpret_cast<const float4*>(q_tile + (w + i * WARPS) * D + d);
                    #pragma unroll
                    for (int x = 0; x < VEC / 4; ++x) {
                        const float4 q = q4[x];
                        part[i][0] += q.x * k[4 * x];
                        part[i][1] += q.y * k[4 * x + 1];
                        part[i][2] += q.z * k[4 * x + 2];
                        part[i][3] += q.w * k[4 * x + 3];
                    }
                }
            }
            #pragma unroll
            for (int i = 0; i < PAIRS; ++i) score[i] = (part[i][0] + part[i][1]) + (part[i][2] + part[i][3]);
        }

        // Online softmax per pair over the keys it sees here, then the values: lane l adds
        // elements [l*E, l*E+E) of each key the pair sees, weighed, in slot order.
        float weight[PAIRS];
        int seen[PAIRS];
        #pragma unroll
        for (int i = 0; i < PAIRS; ++i) {
            seen[i] = min(end[i] - tile, TILE);  // <= 0: none of this tile
            weight[i] = 0.f;
            if (seen[i] <= 0) continue;
            const bool mine = lane < seen[i];
            const float top = max(run_max[i], cg::reduce(warp, mine ? score[i] : Limits<float>::finite_min(),
                                                         cg::greater<float>()));
            const float rescale = exp2f(run_max[i] - top);
            weight[i] = mine ? exp2f(score[i] - top) : 0.f;
            run_max[i] = top;
            run_sum[i] = run_sum[i] * rescale + cg::reduce(warp, weight[i], cg::plus<float>());
            #pragma unroll
            for (int e = 0; e < E; ++e) acc[i][e] *= rescale;
        }
        for (int s = 0; s < staged; ++s) {
            // This lane's E elements of value s in one load where they make 16 or 8 bytes
            // (a head size of 128 or 256 in 16 bits, 128 in float32), else one by one.
            const T* v_row = v_tile + s * D + lane * E;
            float v[E];
            if (E * sizeof(T) % 16 == 0) {
                #pragma unroll
                for (int j = 0; j < E * (int)sizeof(T) / 16; ++j) load_floats<uint4>(v_row + j * VEC, v + j * VEC);
            } else if (E * sizeof(T) % 8 == 0) {
                #pragma unroll
                for (int j = 0; j < E * (int)sizeof(T) / 8; ++j)
                    load_floats<uint2>(v_row + j * (VEC / 2), v + j * (VEC / 2));
            } else {
                #pragma unroll
                for (int e = 0; e < E; ++e) v[e] = static_cast<float>(v_row[e]);
            }
            #pragma unroll
            for (int i = 0; i < PAIRS; ++i) {
                const float ws = warp.shfl(weight[i], s);
                if (s >= seen[i]) continue;  // the same for every lane of the warp
                #pragma unroll
                for (int e = 0; e < E; ++e) acc[i][e] += ws * v[e];
            }
        }
        block.sync();  // before the next tile overwrites the stage
    }

    #pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
        const int p = first + w + i * WARPS;
        if (p >= pairs) break;
        const size_t part = (((size_t)batch * queries_shape[1] + kv_head * group + p / rows) * rows + p % rows)
                            * gridDim.y + chunk;
        float* acc_out = part_acc + part * D + lane * E;
        #pragma unroll
        for (int e = 0; e < E; ++e) acc_out[e] = acc[i][e];
        if (lane == 0) {
            part_max[part] = run_max[i];
            part_sum[part] = run_sum[i];
        }
    }
"""

# The mma form's first pass (2026-12-07, seventh session; the default from SPLIT_FROM_SLOTS since the eighth):
# the split form's parts, its scores and weighed values on the tensor cores. The split form's
# scalar lanes spend 128 multiply-adds a (pair, key) on each of the scores and the values, so
# its time grows with the pairs a call has (on an H100 at 8,192 tokens a Qwen3-32B layer took
# 54 us at one row, 118 at four, where its 33.5 MB of keys and values read in 10). Here a
# warp multiplies 16 pairs by 16 keys in one pass of mma.sync (m16n8k16: a pair a row of A),
# so a verify's rows cost the same as one.
#
# Grid: x = (batch row, KV head, slice of 16 pairs), the slice fastest so that the blocks of
# one chunk's slices read its keys and values close together in time (from L2 after the
# first); y = chunk of CHUNK key slots; a block of WARPS warps. Warp w takes the chunk's slots
# [w * CHUNK / WARPS, (w + 1) * CHUNK / WARPS) in steps of 16, each step's keys and values
# copied asynchronously into the warp's own double-buffered stage (dynamic shared memory,
# rows padded by 16 bytes so that the lanes' fragment loads hit distinct banks) while it works
# on the previous step's. Per step: scores S = Q K^T (fp32 sums), scaled into base 2 and
# masked (slot <= offset + row), an online softmax per pair (the row's maximum and sum over
# its four lanes by xor shuffles), P rounded to T and O += P V. Slots past the call's last row
# are copied as zeros (no stale value can meet a zero weight as NaN). The warps' results are
# then added in warp order through shared memory and written as the split form's parts, which
# its merge reads (the chunks below each row's limit).
#
# Row-invariance: a pair's arithmetic depends on its query, its limit and the slots alone.
# Keys masked for a pair (past its position; all of them for a pair past the call's) add
# exact zeros: its maximum stays, its rescale is exp2(0) = 1, its weights are 0 and P V adds
# 0 products; so a verify row rounds as the 1-row call at its position, which the compiled AR
# step makes, whichever other pairs share its mma tile.
_MMA_SOURCE = r"""
    constexpr int KT = 16;                   // key slots a warp takes a step
    constexpr int DK = D / 16;               // the scores' k steps over the head size
    constexpr int DN = D / 8;                // the output's 8-column tiles
    constexpr int ROW = D + 8;               // a staged key's (and value's) stride in elements
    constexpr int STAGE = 2 * KT * ROW;      // one stage: KT keys, then their KT values
    constexpr int PER_WARP = CHUNK / WARPS;  // the chunk's slots a warp takes, in order
    extern __shared__ __align__(16) unsigned char mtplx_shared[];
    __shared__ int at_offset;
    __shared__ float at_scale;

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int rows = queries_shape[2];
    const int kv_heads = keys_shape[1];
    const int slots = keys_shape[2];
    const int group = queries_shape[1] / kv_heads;
    const int pairs = group * rows;
    const int slices = (pairs + 15) / 16;
    const int slice = blockIdx.x % slices;
    const int kv_head = (blockIdx.x / slices) % kv_heads;
    const int batch = blockIdx.x / slices / kv_heads;  // a fused cohort's row (0 for a single stream)
    const int chunk = blockIdx.y;
    const int begin = chunk * CHUNK;
    if (threadIdx.x == 0) {  // SCALARS_ONCE
        at_offset = offset[batch];
        at_scale = scale[0];
    }
    __syncthreads();
    const int stop = min(begin + CHUNK, min(at_offset + rows, slots));  // one past the last row's last slot here
    if (begin >= stop) return;  // past every row's keys: the merge reads no part of this chunk
    const float q_scale = (float)((double)at_scale * 1.4426950408889634);  // * log2(e)

    // This lane's two pairs (rows g and g + 8 of the tile): their queries as A fragments, and
    // one past the last slot each sees (0 for a pair past the call's: every key masked). The
    // queries are read 16 bits at a time (once a call): a view MLX passes at an odd element
    // stays a legal read.
    int limit[2];
    uint32_t qa[DK][4];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int p = slice * 16 + g + 8 * h;
        const uint16_t* q = nullptr;
        limit[h] = 0;
        if (p < pairs) {
            q = reinterpret_cast<const uint16_t*>(
                queries + (((size_t)batch * queries_shape[1] + kv_head * group + p / rows) * rows + p % rows) * D);
            limit[h] = min(at_offset + p % rows + 1, slots);
        }
        #pragma unroll
        for (int ks = 0; ks < DK; ++ks) {
            const int lo = 16 * ks + 2 * t, hi = lo + 8;  // elements lo, lo + 1 and hi, hi + 1
            qa[ks][h] = q ? (uint32_t)q[lo] | ((uint32_t)q[lo + 1] << 16) : 0u;
            qa[ks][2 + h] = q ? (uint32_t)q[hi] | ((uint32_t)q[hi + 1] << 16) : 0u;
        }
    }

    float acc[DN][4];  // [n][i]: pair g + 8 (i / 2), dim 8 n + 2t + i % 2
    #pragma unroll
    for (int n = 0; n < DN; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float run_max[2] = {Limits<float>::finite_min(), Limits<float>::finite_min()};
    float run_sum[2] = {0.f, 0.f};

    T* stages = reinterpret_cast<T*>(mtplx_shared) + w * 2 * STAGE;
    const T* k_head = keys + ((size_t)batch * kv_heads + kv_head) * slots * D;
    const T* v_head = values + ((size_t)batch * kv_heads + kv_head) * slots * D;
    const int from = begin + w * PER_WARP;
    const int to = min(from + PER_WARP, stop);
    const int steps = from < to ? (to - from + KT - 1) / KT : 0;
    // Buffers off a 16-byte boundary (a view MLX passes as it is) are staged by plain loads.
    const bool aligned = ((reinterpret_cast<size_t>(k_head) | reinterpret_cast<size_t>(v_head)) & 15) == 0;
    auto stage = [&](int k0, int s) {  // slots k0 .. k0 + KT into stage s, zeros from `to`
        T* k_stage = stages + s * STAGE;
        T* v_stage = k_stage + KT * ROW;
        if (aligned) {
            #pragma unroll
            for (int x = lane; x < KT * D / 8; x += 32) {  // 16-byte copies
                const int key = x / (D / 8), col = (x % (D / 8)) * 8;
                const bool real = k0 + key < to;
                const size_t at = (size_t)(real ? k0 + key : from) * D + col;
                mtplx_cp_async_or_zero(k_stage + key * ROW + col, k_head + at, real);
                mtplx_cp_async_or_zero(v_stage + key * ROW + col, v_head + at, real);
            }
        } else {
            for (int x = lane; x < KT * D; x += 32) {
                const int key = x / D, col = x % D;
                const bool real = k0 + key < to;
                k_stage[key * ROW + col] = real ? k_head[(size_t)(k0 + key) * D + col] : static_cast<T>(0.f);
                v_stage[key * ROW + col] = real ? v_head[(size_t)(k0 + key) * D + col] : static_cast<T>(0.f);
            }
        }
        mtplx_cp_async_commit();
    };
    if (steps > 0) stage(from, 0);
    for (int i = 0; i < steps; ++i) {
        const int k0 = from + i * KT;
        if (i + 1 < steps) {
            stage(k0 + KT, (i + 1) & 1);
            mtplx_cp_async_wait<1>();
        } else {
            mtplx_cp_async_wait<0>();
        }
        __syncwarp();
        const T* k_stage = stages + (i & 1) * STAGE;
        const uint16_t* v_stage = reinterpret_cast<const uint16_t*>(k_stage + KT * ROW);

        // Scores of keys k0 + 8 n + 2t (+ 1): s[n][i] for pair g + 8 (i / 2).
        float s[2][4];
        #pragma unroll
        for (int n = 0; n < 2; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            const uint32_t* k_row = reinterpret_cast<const uint32_t*>(k_stage + (n * 8 + g) * ROW);
            #pragma unroll
            for (int ks = 0; ks < DK; ++ks)
                mtplx_mma<BF16>(s[n], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], k_row[ks * 8 + t], k_row[ks * 8 + 4 + t]);
        }

        // The online softmax of each of the lane's pairs over this step's keys.
        uint32_t pa[4];  // P as the A fragment of the values' mma: pair g + 8 (j % 2), keys 8 (j / 2) + 2t, + 1
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float top = Limits<float>::finite_min();
            #pragma unroll
            for (int n = 0; n < 2; ++n) {
                #pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const bool seen = k0 + n * 8 + 2 * t + j < limit[h];
                    s[n][2 * h + j] = seen ? s[n][2 * h + j] * q_scale : Limits<float>::finite_min();
                    top = max(top, s[n][2 * h + j]);
                }
            }
            top = max(top, __shfl_xor_sync(0xffffffffu, top, 1));
            top = max(top, __shfl_xor_sync(0xffffffffu, top, 2));
            top = max(run_max[h], top);
            const float rescale = exp2f(run_max[h] - top);
            float sum = 0.f;
            #pragma unroll
            for (int n = 0; n < 2; ++n) {
                #pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const bool seen = k0 + n * 8 + 2 * t + j < limit[h];
                    s[n][2 * h + j] = seen ? exp2f(s[n][2 * h + j] - top) : 0.f;
                    sum += s[n][2 * h + j];
                }
                pa[2 * n + h] = mtplx_pack2<T>(s[n][2 * h], s[n][2 * h + 1]);
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            run_max[h] = top;
            run_sum[h] = run_sum[h] * rescale + sum;
            #pragma unroll
            for (int n = 0; n < DN; ++n) {
                acc[n][2 * h] *= rescale;
                acc[n][2 * h + 1] *= rescale;
            }
        }

        // O += P V: B fragments of values (key 2t, 2t + 1 | 2t + 8, 2t + 9; dim 8 n + g).
        #pragma unroll
        for (int n = 0; n < DN; ++n) {
            const uint16_t* v_col = v_stage + n * 8 + g;
            const uint32_t b0 = (uint32_t)v_col[(2 * t) * ROW] | ((uint32_t)v_col[(2 * t + 1) * ROW] << 16);
            const uint32_t b1 = (uint32_t)v_col[(2 * t + 8) * ROW] | ((uint32_t)v_col[(2 * t + 9) * ROW] << 16);
            mtplx_mma<BF16>(acc[n], pa[0], pa[1], pa[2], pa[3], b0, b1);
        }
        __syncwarp();  // the stage is free for the copy two steps on
    }

    // The warps' results added in warp order: the stages' space now holds them.
    __syncthreads();
    float* warp_acc = reinterpret_cast<float*>(mtplx_shared);  // [WARPS][16][D]
    float* warp_max = warp_acc + WARPS * 16 * D;                // [WARPS][16]
    float* warp_sum = warp_max + WARPS * 16;
    #pragma unroll
    for (int n = 0; n < DN; ++n) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) warp_acc[(w * 16 + g + 8 * (i / 2)) * D + n * 8 + 2 * t + i % 2] = acc[n][i];
    }
    if (t == 0) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            warp_max[w * 16 + g + 8 * h] = run_max[h];
            warp_sum[w * 16 + g + 8 * h] = run_sum[h];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 16 * D; e += WARPS * 32) {
        const int m = e / D, d = e % D;
        const int p = slice * 16 + m;
        if (p >= pairs) break;  // e grows with m: the rest are past the last pair too
        float top = Limits<float>::finite_min();
        #pragma unroll
        for (int x = 0; x < WARPS; ++x) top = max(top, warp_max[x * 16 + m]);
        float total = 0.f;
        #pragma unroll
        for (int x = 0; x < WARPS; ++x) total += warp_acc[(x * 16 + m) * D + d] * exp2f(warp_max[x * 16 + m] - top);
        const size_t part = (((size_t)batch * queries_shape[1] + kv_head * group + p / rows) * rows + p % rows)
                            * gridDim.y + chunk;
        part_acc[part * D + d] = total;
        if (d == 0) {
            float weights = 0.f;
            #pragma unroll
            for (int x = 0; x < WARPS; ++x) weights += warp_sum[x * 16 + m] * exp2f(warp_max[x * 16 + m] - top);
            part_max[part] = top;
            part_sum[part] = weights;
        }
    }
"""

# Two floats rounded to T (16 bits) and packed as one 32-bit mma fragment register, the
# first in the low half.
_MMA_HEADER = r"""
template <typename T>
__device__ __forceinline__ uint32_t mtplx_pack2(float lo, float hi) {
    const T a = static_cast<T>(lo), b = static_cast<T>(hi);
    return (uint32_t)*reinterpret_cast<const uint16_t*>(&a) | ((uint32_t)*reinterpret_cast<const uint16_t*>(&b) << 16);
}
"""

# The merge of either form's parts: a block of 8 warps per (batch row, head, row). CHUNK > 0 (the split
# form): part c holds slots [c*CHUNK, c*CHUNK + CHUNK), and only the parts below the row's
# limit are read (the first pass skips the rest); 0 (the two-pass form): every part. Warp w
# adds parts w, w+8, ... each weighed by exp2(its maximum - the largest), lane l elements
# [l*E, l*E+E); then the 8 warps' sums are added in warp order and multiplied by one
# reciprocal of the weights' sum, as the one-pass kernel ends. The order depends on the number
# of parts read alone: a row's result does not depend on the other rows or on the capacity.
_MERGE_SOURCE = r"""
    constexpr int WARPS = 8;
    constexpr int E = D / 32;
    __shared__ float warp_top[WARPS];
    __shared__ float warp_sum[WARPS];
    __shared__ float warp_acc[WARPS][D];
    __shared__ int at_offset;

    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int lane = warp.thread_rank();
    const int w = warp.meta_group_rank();

    const int heads = part_max_shape[1];
    const int rows = part_max_shape[2];
    const int parts = part_max_shape[3];
    const int head = blockIdx.x;  // of all the batch rows' heads: batch * heads + head
    const int row = blockIdx.y;
    if (CHUNK > 0) {  // SCALARS_ONCE: one read of the offset a block
        if (threadIdx.x == 0) at_offset = offset[head / heads];
        block.sync();
    }
    const int count = CHUNK > 0 ? min(parts, (at_offset + row + CHUNK) / CHUNK) : parts;
    const size_t base = ((size_t)head * rows + row) * parts;

    float top = Limits<float>::finite_min();
    for (int c = threadIdx.x; c < count; c += WARPS * 32) top = max(top, part_max[base + c]);
    top = cg::reduce(warp, top, cg::greater<float>());
    if (lane == 0) warp_top[w] = top;
    block.sync();
    top = warp_top[0];
    #pragma unroll
    for (int i = 1; i < WARPS; ++i) top = max(top, warp_top[i]);

    float sum = 0.f, acc[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = 0.f;
    #pragma unroll 4  // loads of several parts in flight at once; the sums keep part order
    for (int c = w; c < count; c += WARPS) {
        const float weight = exp2f(part_max[base + c] - top);
        sum += part_sum[base + c] * weight;
        const float* at = part_acc + (base + c) * D + lane * E;
        #pragma unroll
        for (int e = 0; e < E; ++e) acc[e] += at[e] * weight;
    }
    if (lane == 0) warp_sum[w] = sum;
    #pragma unroll
    for (int e = 0; e < E; ++e) warp_acc[w][lane * E + e] = acc[e];
    block.sync();
    for (int d = threadIdx.x; d < D; d += WARPS * 32) {
        float total = 0.f, out_acc = 0.f;
        #pragma unroll
        for (int i = 0; i < WARPS; ++i) {
            total += warp_sum[i];
            out_acc += warp_acc[i][d];
        }
        total = total == 0 ? 0 : __frcp_rn(total);
        out[((size_t)head * rows + row) * D + d] = static_cast<T>(out_acc * total);
    }
"""

# The two-pass form's first pass (`MTPLX_BUFFER_ATTENTION=two-pass`): the one-pass kernel's
# per-key arithmetic spread over many more blocks, as MLX's two-pass decode kernel and cuDNN's
# split-KV attention spread it. Grid: x = query head, y = a group of ROWS query rows, z = one
# of BLOCKS blocks of 8 warps. Warp w of block b takes key slots b*8 + w, then every BLOCKS*8
# slots after (a 32B layer at 8k: 33 keys a warp, in 2,048 blocks for a decode step, where the
# one-pass kernel's 64 blocks walk 264 a warp). A warp loads each of its keys once for all the
# block's rows (a verify's 4 rows read the keys once a query head, not 4 times) and issues two
# keys' loads before the arithmetic of either; each row's arithmetic runs key by key in slot
# order over the keys below its limit, as in the one-pass kernel. Then, row by row, the
# block's 8 warps merge in warp order into one part (max, sum of weights, unnormalised output;
# float32) for the merge kernel, which adds the BLOCKS parts in block order. A row's keys, and
# their order, depend on the slot alone, never on the other rows of the block, so a verify row
# rounds as the 1-row call at its position, and a buffer's capacity changes nothing (slots
# past the last row's limit are never read).
_TWO_PASS_SOURCE = r"""
    constexpr int WARPS = 8;
    constexpr int E = D / 32;
    constexpr int STRIDE = BLOCKS * WARPS;  // slots from one of a warp's keys to its next
    __shared__ float warp_max[WARPS][ROWS];
    __shared__ float warp_sum[WARPS][ROWS];
    __shared__ float warp_acc[WARPS][D];

    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int lane = warp.thread_rank();
    const int w = warp.meta_group_rank();

    const int rows = queries_shape[2];
    const int slots = keys_shape[2];
    const int head = blockIdx.x;
    const int first = blockIdx.y * ROWS;  // this block's first row
    const int active = min(ROWS, rows - first);
    const int part = blockIdx.z;
    const int kv_head = head / (queries_shape[1] / keys_shape[1]);

    const T* k_head = keys + (size_t)kv_head * slots * D + lane * E;
    const T* v_head = values + (size_t)kv_head * slots * D + lane * E;
    const float q_scale = (float)((double)scale[0] * 1.4426950408889634);  // * log2(e)

    float qs[ROWS][E], acc[ROWS][E], run_max[ROWS], run_sum[ROWS];
    int limit[ROWS];  // slots row r may see (0 for a row past the last)
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int row = min(first + r, rows - 1);
        const T* q_row = queries + ((size_t)head * rows + row) * D + lane * E;
        for (int e = 0; e < E; ++e) {
            qs[r][e] = q_scale * static_cast<float>(q_row[e]);
            acc[r][e] = 0.f;
        }
        run_max[r] = Limits<float>::finite_min();
        run_sum[r] = 0.f;
        limit[r] = r < active ? min(offset[0] + first + r + 1, slots) : 0;
    }
    const int last = min(offset[0] + first + active, slots);  // the last row's limit
    auto attend = [&](int slot, const float* ks, const float* vs) {  // one key, each row that sees it
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (slot >= limit[r]) continue;  // the same for every lane of the warp
            float score = 0.f;
            for (int e = 0; e < E; ++e) score += qs[r][e] * ks[e];
            score = cg::reduce(warp, score, cg::plus<float>());
            const float top = max(run_max[r], score);
            const float rescale = exp2f(run_max[r] - top);
            const float weight = exp2f(score - top);
            run_max[r] = top;
            run_sum[r] = run_sum[r] * rescale + weight;
            for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * rescale + weight * vs[e];
        }
    };
    int slot = part * WARPS + w;
    for (; slot + STRIDE < last; slot += 2 * STRIDE) {
        float k0[E], v0[E], k1[E], v1[E];
        const T* k_at = k_head + (size_t)slot * D;
        const T* v_at = v_head + (size_t)slot * D;
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            k0[e] = static_cast<float>(k_at[e]);
            v0[e] = static_cast<float>(v_at[e]);
            k1[e] = static_cast<float>(k_at[(size_t)STRIDE * D + e]);
            v1[e] = static_cast<float>(v_at[(size_t)STRIDE * D + e]);
        }
        attend(slot, k0, v0);
        attend(slot + STRIDE, k1, v1);
    }
    if (slot < last) {
        float k0[E], v0[E];
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            k0[e] = static_cast<float>(k_head[(size_t)slot * D + e]);
            v0[e] = static_cast<float>(v_head[(size_t)slot * D + e]);
        }
        attend(slot, k0, v0);
    }

    // Each row's part: its warps' results weighed by exp2(warp max - block max), in warp order.
    if (lane == 0) {
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            warp_max[w][r] = run_max[r];
            warp_sum[w][r] = run_sum[r];
        }
    }
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (r >= active) break;  // the same for the whole block
        for (int e = 0; e < E; ++e) warp_acc[w][lane * E + e] = acc[r][e];
        block.sync();
        float top = Limits<float>::finite_min();
        for (int i = 0; i < WARPS; ++i) top = max(top, warp_max[i][r]);
        const size_t out_at = ((size_t)head * rows + first + r) * gridDim.z + part;
        for (int d = threadIdx.x; d < D; d += WARPS * 32) {
            float total = 0.f;
            for (int i = 0; i < WARPS; ++i) total += warp_acc[i][d] * exp2f(warp_max[i][r] - top);
            part_acc[out_at * D + d] = total;
        }
        if (threadIdx.x == 0) {
            float total = 0.f;
            for (int i = 0; i < WARPS; ++i) total += warp_sum[i][r] * exp2f(warp_max[i][r] - top);
            part_max[out_at] = top;
            part_sum[out_at] = total;
        }
        block.sync();  // before the next row's outputs overwrite warp_acc
    }
"""

# Key slots a block of the split form takes: 4 tiles of 32. At 8,448 slots (8k tokens of
# context) a KV head has 66 chunks, so a Qwen3-32B layer (8 KV heads) runs 528 blocks of 4
# warps, four for each of an H200's SMs, and a 1-row step's parts (64 heads x 130 floats a
# chunk, 2.2 MB) stay a sixteenth of the keys and values it reads.
SPLIT_SLOTS = 128
SPLIT_WARPS = 4  # warps a block of the split form's first pass has (its WARPS template)
SPLIT_MAX_PAIRS = 4  # pairs a warp of it serves at most where shared memory allows (split_max_pairs)
SPLIT_SHARED_BYTES = 48 * 1024  # the static shared memory a block may declare
# The default form's threshold (KERNEL_ENV unset): a form of parts for buffers of
# SPLIT_FROM_SLOTS slots or more (the split form until the mma form below), the one-pass
# kernel below. On an H100 (2026-12-06, eighth session), with the kernels' scalars in device
# memory (below), a Qwen3-32B layer at 8,192 tokens took 54 us (one row)
# and 118 (four) split, 190 and 240 in one pass; at 1,024 tokens 32 and 52 split, 32 and 46 in
# one pass (docs/benchmarks.md, "The offset in device memory"): the lines cross near 1,000
# tokens at one row and 1,400 at four; buffers grow 256 slots at a time (fused.capacity_for),
# so one of 2,048 slots holds some 1,600 tokens or more. The hybrid's head size of 256 (24
# query heads, 4 KV heads) gained more: 63 us against 368 at 8,192 tokens, 48 against 55 at
# 1,024. Whole steps at 8,192 tokens agreed (the 32B 4-bit's compiled AR step 14.9-15.1 ms
# split against 23.2-23.3 in one pass, its depth-3 cycle 24.9-26.6 against 30.0-38.3).
# Since the eighth session of 2026-12-07 the mma form takes those buffers where it holds the
# head (`form_for`): on an H100 it was 1.5-2.4x faster than the split form at 2,048 and 8,192
# tokens, one and four rows. Below, one-pass against mma is untimed side by side.
SPLIT_FROM_SLOTS = 2048
# MLX (0.32.4, CUDA) keeps arrays of 8 bytes or less in a pool of managed memory that the GPU
# reaches through a mapping, and a kernel reading its offset or scale from there paid for it:
# on an H100 the split form's merge took 15.9 us at 8,192 tokens with the offset made on the
# host and 7.6 with it in device memory (23.1 and 8.9 at four rows, 13.4 and 5.3 at 1,024
# tokens), its first pass 3-5 us less, the one-pass kernel 6-7 less (docs/benchmarks.md,
# "The offset in device memory"). So every kernel here takes its offsets and scale as vectors
# of SCALAR_VECTOR_ELEMENTS or more (16 bytes: past the pool), which MLX allocates in device
# memory (`kernel_offsets`, `kernel_scale`), and the fused loops' caches hold their offsets as
# views of those vectors (`in_device_memory`), so that mlx-lm's RoPE and the KV write read
# them from there too (untimed: the next lease's `+pool` forms in real_size time it). The
# split form's kernels also read each scalar once a block into shared memory, not once a warp
# (SCALARS_ONCE in their sources).
SCALAR_VECTOR_ELEMENTS = 4
TWO_PASS_WARPS = 8  # warps a block of the two-pass form's first pass has (WARPS in _TWO_PASS_SOURCE)
MERGE_WARPS = 8  # warps a block of the merge has (WARPS in _MERGE_SOURCE)


def split_max_pairs(dim: int, itemsize: int, warps: int | None = None) -> int:
    """Pairs a warp of the split form serves at most (PAIRS; more take more blocks): the
    largest of SPLIT_MAX_PAIRS, its half, ... down to 1 whose queries (float32, `warps` x
    PAIRS of them) fit SPLIT_SHARED_BYTES beside the staged tile of keys (rows padded by 16
    bytes) and values, and 2 at most where a key row passes 256 bytes (NVRTC for sm_90: 154
    registers at a head size of 256 in 16 bits and 2 pairs; 172 at 128 in float32 and 4). At
    4 warps: 4 for a head size of 128 in 16 bits, 2 for 256 (41.5 KB)."""
    warps = warps or SPLIT_WARPS
    staged = 32 * (dim * itemsize + 16) + 32 * dim * itemsize
    pairs = SPLIT_MAX_PAIRS if dim * itemsize <= 256 else min(SPLIT_MAX_PAIRS, 2)
    while pairs > 1 and staged + warps * pairs * dim * 4 + 8 > SPLIT_SHARED_BYTES:
        pairs //= 2
    return pairs


TWO_PASS_BLOCKS = 32  # blocks of keys per query head (and group of rows) in the two-pass form (MLX's count)
# Rows a two-pass block serves at most (ROWS): each row's query and output stay in registers
# (NVRTC for sm_90: 40 registers at 1 row of 128 in bf16, 80 at 4, 125 at 8; a head size of
# 256 takes half as many rows, 128 registers at 4).
TWO_PASS_MAX_ROWS = 8
# The mma form (_MMA_SOURCE): key slots a block takes (one part a chunk for the merge: a
# 1-row step at 8,192 tokens writes 32 a head, half the split form's) and its warps, each
# taking MMA_SLOTS / MMA_WARPS slots of them; 16-bit heads of up to 128 (acc holds a lane's
# D / 2 output floats: 64 registers at 128).
MMA_SLOTS = 256
MMA_WARPS = 4
MMA_MAX_DIM = 128
# Which buffer kernel the fused loops attend with: "0" none (MLX's masked attention), one of
# FORMS for that form at every buffer size, else ("", "1", "auto") the default: mma (split for
# the heads it does not take) from SPLIT_FROM_SLOTS slots, one-pass below (`form_for`).
KERNEL_ENV = "MTPLX_BUFFER_ATTENTION"
FORMS = ("one-pass", "split", "two-pass", "mma")
AUTO = "auto"

_usable: bool | None = None
_rows_usable: bool | None = None
_split_usable: bool | None = None
_two_pass_usable: bool | None = None
_mma_usable: bool | None = None
_warned_values: set[str] = set()
_last_offsets: tuple[mx.array, mx.array] | None = None  # kernel_offsets' (offset, padded) of the last call


def kernel_offsets(offset: mx.array) -> mx.array:
    """`offset` (a scalar, or one per batch row) as the int32 vector the kernels read, its
    values repeated to SCALAR_VECTOR_ELEMENTS or more so that it lies in device memory (the
    comment at SCALAR_VECTOR_ELEMENTS says why; the kernels read element `batch` only, and a
    tile is one copy where a zero pad is two kernels). A forward's layers pass one offset array
    (fused.static_caches, fused_cohort's shared offsets), so the padded vector of the last
    offset seen is kept: one copy a forward, not one a layer."""
    global _last_offsets
    if _last_offsets is not None and _last_offsets[0] is offset:
        return _last_offsets[1]
    at = offset.astype(mx.int32).reshape(-1)
    if at.size < SCALAR_VECTOR_ELEMENTS:
        at = mx.tile(at, -(-SCALAR_VECTOR_ELEMENTS // at.size))
    _last_offsets = (offset, at)
    return at


def in_device_memory(offset: mx.array) -> mx.array:
    """`offset` (int32: a cache position, or one per batch row) as a view of its padded vector
    (`kernel_offsets`): the same values, which every kernel reading them then reads from device
    memory, mlx-lm's RoPE and the cache's KV write as well as this module's kernels (which take
    the padded vector itself: it is kept for this view). The fused loops' caches hold their
    offsets so (fused.static_caches, fused_cohort.rows_caches). Other dtypes pass through."""
    global _last_offsets
    if offset.dtype != mx.int32:
        return offset
    padded = kernel_offsets(offset)
    view = padded[:offset.size].reshape(offset.shape)
    _last_offsets = (view, padded)
    return view


@contextlib.contextmanager
def scalars_in_pool(wanted: bool = True) -> Iterator[None]:
    """With `wanted`, the offsets and scale stay one-element arrays inside
    (SCALAR_VECTOR_ELEMENTS = 1), which MLX keeps in its managed pool, as before 2026-12-06's
    eighth session; the padded vectors back after (benches: attention_profile
    --scalars-in-pool, real_size's `+pool` forms). A traced loop keeps the layout it saw:
    callers drop the compiled graphs on both sides. The padded offset kept for the last
    offset array is dropped on both sides."""
    global SCALAR_VECTOR_ELEMENTS, _last_offsets
    shipped = SCALAR_VECTOR_ELEMENTS
    if wanted:
        SCALAR_VECTOR_ELEMENTS = 1
    _last_offsets = None
    try:
        yield
    finally:
        SCALAR_VECTOR_ELEMENTS, _last_offsets = shipped, None


def kernel_scale(scale: float) -> mx.array:
    """The softmax scale as the float32 vector the kernels read (element 0), long enough to
    lie in device memory (`kernel_offsets`): made on the host, so a traced graph holds it as a
    constant rather than a kernel that fills it."""
    return mx.array([scale] * SCALAR_VECTOR_ELEMENTS, mx.float32)


@functools.cache
def _buffer_kernel():
    return custom_kernels.cuda_kernel(
        name="mtplx_buffer_attention", input_names=["queries", "keys", "values", "offset", "scale"],
        output_names=["out"], source=_SOURCE, header=_HEADER)


def buffer_attention(queries: mx.array, keys: mx.array, values: mx.array, offset: mx.array,
                     scale: float) -> mx.array:
    """softmax(q k^T * scale) v with query row i seeing key slots 0..offset+i.

    queries (1, Hq, L, D); keys and values (1, Hkv, S, D) buffers; `offset` an int scalar
    array (the cache position of query row 0). CUDA only: see `usable`.
    """
    form = form_for(queries, keys)
    batched = _batched_form(form)
    if batched is not None:
        return batched(queries, keys, values, offset, scale)
    if form == "two-pass" and two_pass_usable():
        return two_pass_buffer_attention(queries, keys, values, offset, scale)
    return one_pass_buffer_attention(queries, keys, values, offset, scale)


def _batched_form(form: str) -> Callable[..., mx.array] | None:
    """The attention of `form` where it takes a single stream's row and a cohort's W rows
    alike and its kernels passed their probe (the mma and split forms; the split form where
    the mma form's probe failed: the same parts, computed without the tensor cores), else None."""
    if form == "mma" and mma_usable():
        return mma_buffer_attention
    if form in ("mma", "split") and split_usable():
        return split_buffer_attention
    return None


def one_pass_buffer_attention(queries: mx.array, keys: mx.array, values: mx.array, offset: mx.array,
                              scale: float) -> mx.array:
    """`buffer_attention` by the one-pass kernel, whatever the split form's setting."""
    _, heads, rows, dim = queries.shape
    return _buffer_kernel()(
        inputs=[queries, keys, values, kernel_offsets(offset), kernel_scale(scale)],
        template=[("T", queries.dtype), ("D", dim)],
        grid=(heads * 1024, rows, 1), threadgroup=(1024, 1, 1),
        output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]


@functools.cache
def _first_pass_kernel(name: str, source: str):
    """A kernel writing partial results (`_attend_in_parts`): the split or two-pass form's."""
    return custom_kernels.cuda_kernel(name=name, input_names=["queries", "keys", "values", "offset", "scale"],
                                      output_names=["part_max", "part_sum", "part_acc"], source=source,
                                      header=_HEADER)


@functools.cache
def _merge_kernel():
    return custom_kernels.cuda_kernel(name="mtplx_buffer_attention_merge",
                                      input_names=["part_max", "part_sum", "part_acc", "offset"],
                                      output_names=["out"], source=_MERGE_SOURCE, header=_HEADER)


def _attend_in_parts(first_pass, queries: mx.array, keys: mx.array, values: mx.array,
                     offset: mx.array, scale: float, parts: int, template: list,
                     grid: tuple[int, int, int], warps: int, chunk: int) -> mx.array:
    """`first_pass` (blocks of `warps` warps, `template` after T and D) writing `parts`
    partial results per batch row, query head and row, then `_MERGE_SOURCE` adding them
    (`chunk` slots a part, the split form's, or 0: every part, the two-pass form's).
    `offset`: a scalar, or one per batch row."""
    batch, heads, rows, dim = queries.shape
    at = kernel_offsets(offset)
    partial = first_pass(
        inputs=[queries, keys, values, at, kernel_scale(scale)],
        template=[("T", queries.dtype), ("D", dim), *template], grid=grid,
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(batch, heads, rows, parts)] * 2 + [(batch, heads, rows, parts, dim)],
        output_dtypes=[mx.float32] * 3)
    return _merge_kernel()(inputs=[*partial, at], template=[("T", queries.dtype), ("D", dim), ("CHUNK", chunk)],
                           grid=(batch * heads * 32 * MERGE_WARPS, rows, 1), threadgroup=(32 * MERGE_WARPS, 1, 1),
                           output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]


def split_buffer_attention(queries: mx.array, keys: mx.array, values: mx.array, offset: mx.array,
                           scale: float) -> mx.array:
    """`buffer_attention` in the split form (the module docstring): a block per SPLIT_SLOTS
    key slots of each KV head, serving its query heads' rows (a slice of them per block where
    they pass SPLIT_WARPS x `split_max_pairs`), then a merge in chunk order. Also a fused
    cohort's W rows (queries (W, Hq, L, D), buffers (W, Hkv, S, D), `offset` (W,)): each
    batch row computes as it would alone. CUDA only, within `split_shape_supported`: see
    `split_usable`."""
    batch, heads, rows, dim = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    chunks = -(-slots // SPLIT_SLOTS)
    pairs = heads // kv_heads * rows
    per_warp = min(-(-pairs // SPLIT_WARPS), split_max_pairs(dim, queries.dtype.size))
    slices = -(-pairs // (SPLIT_WARPS * per_warp))
    return _attend_in_parts(
        _first_pass_kernel("mtplx_buffer_attention_split", _SPLIT_SOURCE), queries, keys, values,
        offset, scale, chunks, [("CHUNK", SPLIT_SLOTS), ("PAIRS", per_warp), ("WARPS", SPLIT_WARPS)],
        (batch * kv_heads * 32 * SPLIT_WARPS, chunks, slices), SPLIT_WARPS, SPLIT_SLOTS)


def two_pass_buffer_attention(queries: mx.array, keys: mx.array, values: mx.array, offset: mx.array,
                              scale: float) -> mx.array:
    """`buffer_attention` in the two-pass form (`_TWO_PASS_SOURCE`): TWO_PASS_BLOCKS blocks
    per query head and group of up to TWO_PASS_MAX_ROWS rows, each over every
    TWO_PASS_BLOCKS-th group of 8 key slots, then the merge in block order. CUDA only, within
    `shape_supported`: see `two_pass_usable`."""
    _, heads, rows, dim = queries.shape
    per_block = min(rows, TWO_PASS_MAX_ROWS if dim <= 128 else TWO_PASS_MAX_ROWS // 2)
    return _attend_in_parts(
        _first_pass_kernel("mtplx_buffer_attention_two_pass", _TWO_PASS_SOURCE), queries, keys,
        values, offset, scale, TWO_PASS_BLOCKS, [("BLOCKS", TWO_PASS_BLOCKS), ("ROWS", per_block)],
        (heads * 32 * TWO_PASS_WARPS, -(-rows // per_block), TWO_PASS_BLOCKS), TWO_PASS_WARPS, 0)


def mma_shared_bytes(dim: int, itemsize: int, warps: int | None = None) -> int:
    """The mma form's dynamic shared memory for blocks of `warps` warps (MMA_WARPS unless
    told): their double-buffered stages (16 keys and 16 values, rows padded by 16 bytes), which
    then hold the warps' results for the block's sum."""
    warps = warps or MMA_WARPS
    stages = warps * 2 * 2 * 16 * (dim + 8) * itemsize
    results = warps * 16 * (dim + 2) * 4
    return max(stages, results)


@functools.cache
def _mma_kernel(shared_bytes: int):
    return custom_kernels.cuda_kernel(
        name="mtplx_buffer_attention_mma", input_names=["queries", "keys", "values", "offset", "scale"],
        output_names=["part_max", "part_sum", "part_acc"], source=_MMA_SOURCE,
        header=custom_kernels.TENSOR_CORE_HEADER + _HEADER + _MMA_HEADER, shared_memory=shared_bytes)


def mma_buffer_attention(queries: mx.array, keys: mx.array, values: mx.array, offset: mx.array,
                         scale: float) -> mx.array:
    """`buffer_attention` in the mma form (`_MMA_SOURCE`): a block of MMA_WARPS warps per
    MMA_SLOTS key slots of each KV head and 16 of its (query head, row) pairs, scores and
    weighed values on the tensor cores, then the split form's merge. Also a fused cohort's W
    rows, each computed as alone. CUDA only, within `mma_shape_supported`: see `mma_usable`."""
    batch, heads, rows, dim = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    chunks = -(-slots // MMA_SLOTS)
    slices = -(-(heads // kv_heads * rows) // 16)
    return _attend_in_parts(
        _mma_kernel(mma_shared_bytes(dim, queries.dtype.size)), queries, keys, values, offset, scale, chunks,
        [("CHUNK", MMA_SLOTS), ("WARPS", MMA_WARPS), ("BF16", queries.dtype == mx.bfloat16)],
        (batch * kv_heads * slices * 32 * MMA_WARPS, chunks, 1), MMA_WARPS, MMA_SLOTS)


def mma_shape_supported(queries: mx.array, keys: mx.array) -> bool:
    """The mma form's domain, within `rows_shape_supported`'s (a head size a multiple of 32):
    16-bit queries and buffers (the tensor cores' inputs), a head size up to MMA_MAX_DIM."""
    dim = queries.shape[-1]
    return (rows_shape_supported(queries, keys) and queries.dtype in (mx.bfloat16, mx.float16)
            and keys.dtype == queries.dtype and dim % 16 == 0 and dim <= MMA_MAX_DIM)


def split_shape_supported(queries: mx.array, keys: mx.array) -> bool:
    """The split form's domain, within `rows_shape_supported`'s (a single stream's batch of
    one or a cohort's W rows): a key row of 512 bytes at most (a head size of 256 in 16 bits,
    128 in float32), so that a staged tile of keys and values and the queries of
    `split_max_pairs` pairs a warp fit 48 KB of shared memory."""
    return rows_shape_supported(queries, keys) and queries.shape[-1] * queries.dtype.size <= 512


def form_wanted() -> str | None:
    """The buffer kernel's form KERNEL_ENV asks for: None for "0" (no kernel), one of FORMS,
    else AUTO (unset, "1", "auto"; an unknown value is logged): `form_for` picks by shape."""
    value = os.environ.get(KERNEL_ENV, "").strip().lower()
    if value == "0":
        return None
    if value in FORMS:
        return value
    if value not in ("", "1", AUTO) and value not in _warned_values:  # read per layer traced: say it once
        _warned_values.add(value)
        custom_kernels.log.warning("%s=%r is not 0, auto or one of %s; using auto", KERNEL_ENV, value,
                                   ", ".join(FORMS))
    return AUTO


def form_for(queries: mx.array, keys: mx.array) -> str:
    """The form a call of these shapes asks for (`form_wanted`, AUTO resolved): by default
    for buffers of SPLIT_FROM_SLOTS slots or more the mma form, or the split form where
    `mma_shape_supported` does not hold (a head of 256, float32), else one-pass; a buffer of
    one chunk, or a shape outside `split_shape_supported`, keeps one-pass whatever was
    asked. Fixed by the shapes, so a traced loop takes one form for all its calls (a
    capacity bucket is one shape)."""
    form = form_wanted() or "one-pass"
    if form == AUTO:
        form = "mma" if keys.shape[2] >= SPLIT_FROM_SLOTS else "one-pass"
    if form == "mma":
        if mma_shape_supported(queries, keys):
            return "mma" if keys.shape[2] > MMA_SLOTS else "one-pass"
        form = "split"  # (a head of 256, float32): the split form's rule below
    if form == "split" and not (keys.shape[2] > SPLIT_SLOTS and split_shape_supported(queries, keys)):
        return "one-pass"
    return form


@functools.cache
def _rows_buffer_kernel():
    return custom_kernels.cuda_kernel(
        name="mtplx_rows_buffer_attention", input_names=["queries", "keys", "values", "offset", "scale"],
        output_names=["out"], source=_ROWS_SOURCE, header=_HEADER)


def rows_buffer_attention(queries: mx.array, keys: mx.array, values: mx.array,
                          offsets: mx.array, scale: float) -> mx.array:
    """`buffer_attention` for W rows: queries (W, Hq, L, D), buffers (W, Hkv, S, D), row w's
    query i seeing key slots 0..offsets[w]+i, each row in the form a single stream with its
    buffer's capacity takes (`form_for`: mma or split from SPLIT_FROM_SLOTS by default; the
    two-pass form has no W-row kernel, so there the one-pass one serves), so a cohort row
    rounds as its solo cycle wherever their buffers take one form. CUDA only: see `rows_usable`."""
    batched = _batched_form(form_for(queries, keys))
    if batched is not None:
        return batched(queries, keys, values, offsets, scale)
    batch, heads, rows, dim = queries.shape
    return _rows_buffer_kernel()(
        inputs=[queries, keys, values, kernel_offsets(offsets), kernel_scale(scale)],
        template=[("T", queries.dtype), ("D", dim)],
        grid=(heads * 1024, rows, batch), threadgroup=(1024, 1, 1),
        output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]


def rows_shape_supported(queries: mx.array, keys: mx.array) -> bool:
    """`shape_supported` for any number of rows (one buffer per row)."""
    return (queries.shape[0] == keys.shape[0] and queries.shape[-1] % 32 == 0
            and queries.shape[-1] <= 256 and queries.shape[1] % keys.shape[1] == 0
            and queries.dtype in (mx.bfloat16, mx.float16, mx.float32))


def shape_supported(queries: mx.array, keys: mx.array) -> bool:
    """The kernel's domain: batch 1, a head size that 32 lanes split evenly, whole GQA groups."""
    return (queries.shape[0] == 1 and keys.shape[0] == 1 and queries.shape[-1] % 32 == 0
            and queries.shape[-1] <= 256 and queries.shape[1] % keys.shape[1] == 0
            and queries.dtype in (mx.bfloat16, mx.float16, mx.float32))


def usable() -> bool:
    """True on CUDA once the kernel has compiled and matched mx.fast's attention on a probe,
    unless `MTPLX_BUFFER_ATTENTION=0` (`kernel_wanted`).

    The probe runs once per process; any failure (no CUDA, a JIT error) leaves the caller on
    mx.fast.scaled_dot_product_attention, and is logged. KERNEL_ENV is read at each call (a
    traced loop keeps what it saw; a bench may switch forms between traces).
    """
    global _usable
    if not kernel_wanted():
        return False
    if _usable is None:
        _usable = fixed_shapes_wanted() and _probe()
    return _usable


def kernel_wanted() -> bool:
    """False where KERNEL_ENV is "0": the fused loops then attend with MLX's masked attention
    on CUDA too (benches, and a way out should the kernel misbehave on some GPU)."""
    return form_wanted() is not None


def split_usable() -> bool:
    """`usable` for the split form: on CUDA once both of its kernels compiled and matched
    mx.fast's masked attention on a probe whose rows see several chunks (checked once per
    process, before any graph is traced: `fused.route_static_cache_attention`)."""
    global _split_usable
    if _split_usable is None:
        _split_usable = fixed_shapes_wanted() and custom_kernels.probe(
            "split buffer attention", _split_probe_error, 0.05, "the one-pass buffer kernel")
    return _split_usable


def two_pass_usable() -> bool:
    """`usable` for the two-pass form: on CUDA once its kernels compiled and matched mx.fast's
    masked attention on a probe whose rows reach past the first round of blocks (once per
    process, before any graph is traced: `prepare_form`)."""
    global _two_pass_usable
    if _two_pass_usable is None:
        _two_pass_usable = fixed_shapes_wanted() and custom_kernels.probe(
            "two-pass buffer attention", _two_pass_probe_error, 0.05, "the one-pass buffer kernel")
    return _two_pass_usable


def mma_usable() -> bool:
    """`usable` for the mma form: on CUDA once its kernel compiled and, with the split form's
    merge, matched mx.fast's masked attention on a probe whose rows see several chunks (once
    per process, before any graph is traced: `prepare_form`)."""
    global _mma_usable
    if _mma_usable is None:
        _mma_usable = fixed_shapes_wanted() and custom_kernels.probe(
            "mma buffer attention", _mma_probe_error, 0.05, "the one-pass buffer kernel")
    return _mma_usable


def prepare_form() -> bool:
    """Probe the form KERNEL_ENV asks for (its kernels compile and agree), once per process:
    whether it will serve. The one-pass kernel is `usable`'s."""
    return usable() and _form_usable(form_wanted())


def _form_usable(form: str | None) -> bool:
    """Whether `form`'s own kernels passed their probe (the one-pass kernel: `usable`'s; AUTO:
    the mma or split form's, which it takes for large buffers; both probed before a trace)."""
    if form == AUTO:
        mma, split = mma_usable(), split_usable()
        return mma or split
    if form == "split":
        return split_usable()
    if form == "mma":
        return mma_usable()
    return two_pass_usable() if form == "two-pass" else True


def path_name() -> str:
    """What /health and status say about the fused loops' attention (`cache_attention`)."""
    if not usable():
        return "mlx scaled_dot_product_attention"
    form = form_wanted()
    if form == AUTO and _form_usable(form):
        tensor_cores = (f"on the tensor cores in {MMA_SLOTS}-slot chunks per KV head (16-bit heads of "
                        f"up to {MMA_MAX_DIM}), else " if mma_usable() else "")
        return (f"buffer CUDA kernel: one pass below {SPLIT_FROM_SLOTS} slots, from there {tensor_cores}"
                f"split into {SPLIT_SLOTS}-slot chunks per KV head")
    if form == "split" and _form_usable(form):
        return f"buffer CUDA kernel, split into {SPLIT_SLOTS}-slot chunks per KV head"
    if form == "mma" and _form_usable(form):
        return f"buffer CUDA kernel on the tensor cores, {MMA_SLOTS}-slot chunks per KV head"
    if form == "two-pass" and _form_usable(form):
        return f"buffer CUDA kernel, two passes over {TWO_PASS_BLOCKS} key blocks per query head"
    return "buffer CUDA kernel"


def rows_usable() -> bool:
    """`usable` for the W-row kernel: on CUDA once it compiled and matched mx.fast's masked
    attention on a probe of rows at different offsets (checked once per process)."""
    global _rows_usable
    if _rows_usable is None:
        _rows_usable = kernel_wanted() and fixed_shapes_wanted() and custom_kernels.probe(
            "rows buffer attention", _rows_probe_error, 0.05, "mx.fast attention")
    return _rows_usable


def _masked_error(attend: Callable[..., mx.array], offsets: list[int], slots: int) -> float:
    """The largest difference between `attend(q, k, v, offsets, scale)` and mx.fast's masked
    attention on random bf16 inputs: one batch row per offset, three query rows each."""
    batch, rows, dim = len(offsets), 3, 64
    q = mx.random.normal((batch, 4, rows, dim), key=mx.random.key(0)).astype(mx.bfloat16)
    k = mx.random.normal((batch, 2, slots, dim), key=mx.random.key(1)).astype(mx.bfloat16)
    v = mx.random.normal((batch, 2, slots, dim), key=mx.random.key(2)).astype(mx.bfloat16)
    at = mx.array(offsets, mx.int32)
    mask = mx.arange(slots) <= at[:, None, None, None] + mx.arange(rows)[:, None]
    scale = 1 / math.sqrt(dim)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    got = attend(q, k, v, at, scale)
    return mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item()


def _rows_probe_error() -> float:
    return _masked_error(rows_buffer_attention, [20, 0, 33], 40)


def _probe_error() -> float:
    return _masked_error(lambda q, k, v, at, scale: one_pass_buffer_attention(q, k, v, at[0], scale), [20], 40)


def _split_probe_error() -> float:  # two batch rows: one sees two chunks, one the first alone
    return _masked_error(split_buffer_attention, [SPLIT_SLOTS + 100, 30], 2 * SPLIT_SLOTS + 40)


def _mma_probe_error() -> float:  # as the split form's: one row past its first chunk, one inside it
    return _masked_error(mma_buffer_attention, [MMA_SLOTS + 100, 30], 2 * MMA_SLOTS + 40)


def _two_pass_probe_error() -> float:  # its rows reach past the first 256 slots (all blocks' first keys)
    return _masked_error(lambda q, k, v, at, scale: two_pass_buffer_attention(q, k, v, at[0], scale),
                         [2 * TWO_PASS_BLOCKS * 8 + 30], 3 * TWO_PASS_BLOCKS * 8)


def _probe() -> bool:
    return custom_kernels.probe("buffer attention", _probe_error, 0.05, "mx.fast attention")
