"""Quantized matmuls of a few rows (M = 1..7) in one CUDA kernel that reads the weights once
per ROW_CHUNK rows.

Why: a verify of K+1 tokens multiplies K+1 rows by every weight matrix. Such a product is
bound by reading the weights, so K+1 rows should cost about what one row costs; on the H200
MLX's CUDA quantized matmul costs about M times one row (a 4-bit matvec of 4 rows took 4x
one row), which makes a 6-token verify of a 4-bit 32B model cost 4.2 decode steps, and MTP
cannot win there (docs/benchmarks.md, "Real sizes"). This kernel streams each weight word
once and applies it to all M rows.

Layout (MLX affine quantization, `mx.quantize(w, group_size=64, bits)`): `w` (N, K*bits/32)
uint32, value i of a word in bits [i*bits, (i+1)*bits); `scales` and `biases` (N, K/64);
W[n, k] = scales[n, k/64] * q + biases[n, k/64]. A warp owns ROWS_PER_WARP output columns;
each lane takes one word of each at a time, the matching slice of the block's input rows (at
most ROW_CHUNK of them) stays in its registers for all of them, and per word it adds
scale * sum(x q) + bias * sum(x) (the sum of x is shared by the columns). The warp's partial
sums are reduced at the end. More rows than ROW_CHUNK take a second row of blocks (grid y),
which reads the weights again. The kernel takes any row count, but from MLX_TILED_ROWS rows
(a fused cohort's verify: W rows of K+1 tokens) MLX's own tiled qmm serves the product: on
the H200 it was faster there than every layout of the kernel.
Two more layouts of the same product: "vector" (16-byte loads, for decode steps of large
matrices, _SOURCE_VECTOR) and "mma" (the tensor cores, for short verify blocks of large
matrices, _SOURCE_MMA); `route` picks one per product. The mma layout has a pipelined
form (_SOURCE_MMA_PIPELINED: its loads through shared memory, fewer registers; the same
outputs bit for bit), served wherever it fits (MMA_STAGES). Both serve forms with fewer
instructions a weight and the same outputs bit for bit: the vector layout unpacks its weights
in place (VECTOR_IN_PLACE), the mma layout keeps its unpack's constants in registers
(MMA_HOIST). The vector layout also has a persistent form for one-row products, fewer blocks
each with its next loads in flight while it computes (VECTOR_PERSISTENT_BLOCKS; opt-in and
off: slower on an H100, the same outputs bit for bit).

`reference` spells the same arithmetic in plain MLX ops (the CPU runs it; a test compares it
with mx.quantized_matmul, which pins the layout the kernel reads). Where the kernel is not
usable (Metal, CPU, a failed compile, a probe that disagrees) everything stays on
mx.quantized_matmul, and `path_name()` says which is active (`/health`, `mtplxctl status`).
By default it serves only the models where whole forwards measured it faster on the H200:
4- and 8-bit models with matrices of a 27B/32B model's size (`default_wanted`); a hybrid
model (Gated DeltaNet) or a dense 8-bit one row-invariantly (below: `row_invariant_wanted`),
a dense 4-bit one so in its MTP cycles (`cycle_row_invariant_wanted`); and, since an H100
measured it (2026-12-07), a dense 4-bit model of Qwen3-4B's size for its decode steps (its MTP
cycles keep the mixed routing); elsewhere it is off (on the embedded model it made decoding
slower).
`load_model(path, small_m_kernel=True or False)` decides instead (the benches'
`--small-m-kernel`).

Row-invariant routing (`install(row_invariant=True)`; the default for a hybrid of that size,
and inside a dense one's MTP cycles; `MTPLX_ROW_INVARIANT=1` or `0` decides for any model;
the benches' `--row-invariant`):
every product of 1 to MAX_ROWS 16-bit rows takes the mma layout, decode steps and small
matrices included. All those row counts run one compiled instance of it (one 8-row tile),
and a tensor-core product's output element depends only on its own weight row and input row,
so a verify's row rounds exactly as the decode step's product of that row: on CUDA, greedy
MTP then equals greedy AR wherever the rest of the step is row-invariant too (the buffer
attention, the GDN kernels and the norms are). The mixed routing mixes layouts by row count
(MLX's matvec or the vector layout for a decode step, the mma layout for a verify block),
whose roundings differ; a random 64-layer hybrid 27B at 4-bit amplifies that into
divergences at gaps well above a near-tie (docs/benchmarks.md, "Where issue 22's targets
stand"). On the H200 that model went from 32 divergences in 40-43 greedy tokens to none in
2,000 with it, its depth-3 cycles as fast as the mixed routing's in the same process; its
decode steps (an AR request's) ran 3-34% slower there than MLX's matvec, and 8% faster in
another process ("Both routings in one process"). Since 2026-12-05 (fifth session, an H100) an 8-bit hybrid takes it too: in one process its
depth-3 cycles took 1.66 / 1.44 decode steps (T=0 / 0.6) against the mixed routing's 2.04 /
1.78, its decode steps level (16.6 against 16.4 ms), and greedy MTP equalled AR over 300
tokens. A dense 8-bit model takes it too since the eighth session of 2026-12-07 (an H100:
the 32B's AR decode step 0.79-0.85x the mixed routing's time in each of four rounds, in the
compiled AR loop). A dense 4-bit model routes row-invariantly inside its MTP cycles only
(`cycle_routed`): its AR decode steps keep the mixed routing, which reads them at least as
fast (Qwen3-32B 4-bit on the H100: 13.5-14.7 ms against 19.3-20.8 row-invariant op by op;
1.04x compiled, 2026-12-07), while its cycles are cheaper row-invariant (depth 3: 1.26-1.38
decode steps at T=0 against 1.60-1.68; 8-bit 1.31 against 1.56). Its greedy divergences
were near-ties either way (32 in 289 tokens mixed, 18 in 300 row-invariant, all within 0.031).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any, Callable, Generator, Iterator

import mlx.core as mx
import mlx.nn as nn

from mtplxd.engine.model import custom_kernels
from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

# MLX 0.32 serves 8 rows and more with its tiled qmm (fewer with its matvec, about rows x one
# row). On the H200 the tiled qmm beat every layout of the kernel from there, on every
# Qwen3-32B 4-bit matrix: 8 and 16 rows of gate_proj 75 and 71 us against the mma layout's 78
# and 103 and the word layout's 354 and 671; k_proj 19 and 18 against 28 and 27 (mma) and 43
# and 51 (word) (docs/benchmarks.md, "The 32B with the tensor-core layout"). So the kernel
# serves verify blocks of up to MAX_ROWS rows, and cohorts' wider verifies and prefill go to MLX.
MLX_TILED_ROWS = 8
MAX_ROWS = MLX_TILED_ROWS - 1
ROW_CHUNK = 8  # input rows one block keeps in registers; more take more blocks along y
# Fewest rows the kernel takes, per bit width: below them MLX's own matvec is faster (H200,
# docs/benchmarks.md: the kernel wins at 4-bit from 3 rows, at 8-bit from 4), so decode
# steps keep MLX's path and verify blocks take the kernel.
MIN_ROWS = {4: 3, 8: 4}
GROUP_SIZE = 64
BITS = (4, 8)
ROWS_PER_WARP = 4  # output columns a warp computes together (x slices reused across them)
WARPS_PER_BLOCK = 8

# The weights' values as floats without an int-to-float conversion. On sm_90 a conversion
# runs at a quarter of the rate of an add (16 a clock per SM); a 4-bit 32B decode step converts
# 32 G values, 7.7 ms of conversions at the H200's rate against 4.2 ms to read them. Taking
# them out measured level on the H200 (micro-bench median 1.00: the loads, not the
# instructions, hold the kernel back), and the unpack stays for its fewer instructions.
# Each value is masked in place into the mantissa of a float whose exponent
# gives its lowest bit the weight 1 (one and-or), and that float's leading power of two is
# subtracted (one add): `((word & 0xF0) | 0x49000000)` is 2^19 + q as a float, exactly, for the
# second nibble. The result is the same float the conversion gives, so the outputs are
# bit-for-bit those of the converting kernel. Half a word at a time keeps every value's bits
# below the exponent.
_HEADER = r"""#include <cooperative_groups/reduce.h>
template <int BITS>
__device__ __forceinline__ void mtplx_unpack_word(uint32_t word, float (&q)[32 / BITS]) {
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const uint32_t h = half ? word >> 16 : word;
        if constexpr (BITS == 4) {
            q[4 * half + 0] = __uint_as_float((h & 0x000Fu) | 0x4B000000u) - 8388608.f;  // 2^23
            q[4 * half + 1] = __uint_as_float((h & 0x00F0u) | 0x49000000u) - 524288.f;   // 2^19
            q[4 * half + 2] = __uint_as_float((h & 0x0F00u) | 0x47000000u) - 32768.f;    // 2^15
            q[4 * half + 3] = __uint_as_float((h & 0xF000u) | 0x45000000u) - 2048.f;     // 2^11
        } else {
            q[2 * half + 0] = __uint_as_float((h & 0x00FFu) | 0x4B000000u) - 8388608.f;  // 2^23
            q[2 * half + 1] = __uint_as_float((h & 0xFF00u) | 0x47000000u) - 32768.f;    // 2^15
        }
    }
}
// mtplx_unpack_word's values each times 2^(BITS j), j the value's place in its half-word, in
// fewer instructions: every value is masked in place under one exponent, 2^23's, then 2^23 is
// subtracted ((word & 0xF0) | 0x4B000000 is 2^23 + 16 q). The and-or above needs a mask and a
// magic for each place, and an and-or takes one constant operand, so the compiler made the
// other afresh before each value (a register each would hold it: 233 of the vector layout's
// 1,422 instructions a 4-bit pass at one row, sm_90 SASS); here the one magic stays in a
// register (`magic`, from the caller) and each place's mask is the immediate. The caller scales
// each input by 2^-(BITS j), which is exact while the scaled input stays a normal float, so
// every product x q is the same float (if subnormals flush, an input under 2^-114 loses its
// product, under 2^-110, where the masked form keeps it; the CUDA tests draw normal inputs).
template <int BITS>
__device__ __forceinline__ void mtplx_unpack_word_in_place(uint32_t word, float (&q)[32 / BITS], uint32_t magic) {
    constexpr int PER_HALF = 16 / BITS;
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const uint32_t h = half ? word >> 16 : word;
        #pragma unroll
        for (int j = 0; j < PER_HALF; ++j)
            q[PER_HALF * half + j] = __uint_as_float((h & (MASK << (BITS * j))) | magic) - 8388608.f;  // 2^23
    }
}
// The input scale that matches value i of a word under mtplx_unpack_word_in_place: 2^-(BITS j).
template <int BITS>
__device__ __forceinline__ constexpr float mtplx_in_place_scale(int i) {
    return 1.f / static_cast<float>(1u << (BITS * (i % (16 / BITS))));
}
template <int BITS>
__device__ __forceinline__ void mtplx_convert_word(uint32_t word, float (&q)[32 / BITS]) {
    #pragma unroll
    for (int i = 0; i < 32 / BITS; ++i) q[i] = static_cast<float>((word >> (i * BITS)) & ((1u << BITS) - 1u));
}
// The unpack's nibble mask and the sums' all-ones A fragment. Each is a constant that an and-or
// or an mma takes only from a register, so the compiler makes it afresh before every use (sm_90
// SASS, docs/benchmarks-data/sass-mix.py: 36 of the pipelined layout's 410 instructions a
// 4-group pass at one tile, 4-bit). With HOIST they come from behind a test the compiler cannot
// decide (N is positive) and stay in registers: 374 instructions, the same arithmetic.
struct MtplxMmaConstants { uint32_t mask, ones; };
template <bool BF16, bool HOIST>
__device__ __forceinline__ MtplxMmaConstants mtplx_mma_constants(int N) {
    constexpr uint32_t ONES = BF16 ? 0x3F803F80u : 0x3C003C00u;   // 1.0 in both halves
    if constexpr (HOIST) return {N > 0 ? 0x000F000Fu : 0u, N > 0 ? ONES : 0u};
    else return {0x000F000Fu, ONES};
}
// One group of GS inputs through the mma layout: a warp's weight rows a (column n0 + g) and b
// (n0 + g + 8), this lane's TW words of each (`wa`, `wb`) with their scales and biases, against
// MT tiles of 8 input rows from row m0 (the lane's inputs from k0); adds the group's products to
// acc[mt] (d[0], d[1]: column a, rows 2t, 2t+1 of the tile; d[2], d[3]: column b); `c` from
// mtplx_mma_constants.
template <bool BF16, int BITS, int GS, int MT, typename T>
__device__ __forceinline__ void mtplx_mma_group(float (&acc)[MT][4], const uint32_t* wa, const uint32_t* wb,
                                                float sa, float sb, float ba, float bb, const T* x, int K,
                                                int k0, int m0, int rows, int g, MtplxMmaConstants c) {
    constexpr int TW = GS / (32 / BITS) / 4;            // words of a group per lane: 2 (4-bit), 4 (8-bit)
    constexpr uint32_t MAGIC = BF16 ? 0x43004300u : 0x64006400u;  // 128 / 1024 in both halves
    constexpr float OFFSET_SUM = (BF16 ? 128.f : 1024.f) * (BITS == 8 ? 17.f : 1.f);
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int m = mt * 8 + g;
        uint4 xv[2] = {};                       // the lane's 16 inputs of row m in this group
        if (m < rows) {
            const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)(m0 + m) * K + k0);
            xv[0] = src[0];
            xv[1] = src[1];
        }
        const uint32_t* xw = reinterpret_cast<const uint32_t*>(xv);  // 8 pairs of inputs
        float d[4] = {0.f, 0.f, 0.f, 0.f}, dh[4] = {0.f, 0.f, 0.f, 0.f}, s[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int j = 0; j < TW; ++j) {
            if constexpr (BITS == 4) {
                // word j: values 8j..8j+7; steps take the pairs (0,4), (1,5) and (2,6), (3,7)
                #pragma unroll
                for (int step = 0; step < 2; ++step) {
                    const uint32_t lo = xw[4 * j + step], hi = xw[4 * j + step + 2];
                    const uint32_t b0 = __byte_perm(lo, hi, 0x5410), b1 = __byte_perm(lo, hi, 0x7632);
                    const int sh = 8 * step;
                    mtplx_mma<BF16>(d, ((wa[j] >> sh) & c.mask) | MAGIC, ((wb[j] >> sh) & c.mask) | MAGIC,
                                    ((wa[j] >> (sh + 4)) & c.mask) | MAGIC,
                                    ((wb[j] >> (sh + 4)) & c.mask) | MAGIC, b0, b1);
                    mtplx_mma<BF16>(s, c.ones, c.ones, c.ones, c.ones, b0, b1);
                }
            } else {
                // word j: values 4j..4j+3, pairs (0,2), (1,3); low nibbles, then high
                const uint32_t lo = xw[2 * j], hi = xw[2 * j + 1];
                const uint32_t b0 = __byte_perm(lo, hi, 0x5410), b1 = __byte_perm(lo, hi, 0x7632);
                mtplx_mma<BF16>(d, (wa[j] & c.mask) | MAGIC, (wb[j] & c.mask) | MAGIC,
                                ((wa[j] >> 8) & c.mask) | MAGIC, ((wb[j] >> 8) & c.mask) | MAGIC,
                                b0, b1);
                mtplx_mma<BF16>(dh, ((wa[j] >> 4) & c.mask) | MAGIC, ((wb[j] >> 4) & c.mask) | MAGIC,
                                ((wa[j] >> 12) & c.mask) | MAGIC,
                                ((wb[j] >> 12) & c.mask) | MAGIC, b0, b1);
                mtplx_mma<BF16>(s, c.ones, c.ones, c.ones, c.ones, b0, b1);
            }
        }
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float sc = i < 2 ? sa : sb;
            const float bi = i < 2 ? ba : bb;
            const float D = BITS == 8 ? d[i] + 16.f * dh[i] : d[i];
            acc[mt][i] += sc * (D - OFFSET_SUM * s[i]) + bi * s[i];
        }
    }
}
// The mma layout's end: each warp's sums (acc, as mtplx_mma_group leaves them) into `partial`,
// then the block's outputs, the warps' sums added in warp order (columns n0.., rows m0..).
template <int KW, int MT, typename T>
__device__ __forceinline__ void mtplx_mma_store(float (*partial)[MT][16][8], const float (&acc)[MT][4], T* out,
                                                int N, int n0, int m0, int rows) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) partial[wid][mt][g + (i >> 1) * 8][2 * t + (i & 1)] = acc[mt][i];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < MT * 16 * 8; e += blockDim.x) {
        const int c = e % 16, r = (e / 16) % 8, mt = e / 128;    // consecutive threads: consecutive columns
        const int n = n0 + c, m = mt * 8 + r;
        if (n >= N || m >= rows) continue;
        float total = 0.f;
        #pragma unroll
        for (int i = 0; i < KW; ++i) total += partial[i][mt][c][r];
        out[(size_t)(m0 + m) * N + n] = static_cast<T>(total);
    }
}
"""

_SOURCE = r"""
    constexpr int VALS = 32 / BITS;              // values in one uint32 word
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int lane = warp.thread_rank();
    const int warp_id = blockIdx.x * (blockDim.x / 32) + warp.meta_group_rank();

    const int N = w_shape[0];
    const int words = w_shape[1];                // words per weight row
    const int K = words * VALS;
    const int groups = K / GS;
    const int n0 = warp_id * R;
    if (n0 >= N) return;
    const int m0 = blockIdx.y * M;               // this block's first input row
    const int rows = x_shape[0] - m0 < M ? x_shape[0] - m0 : M;

    float acc[R][M];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    }

    for (int word = lane; word < words; word += 32) {
        const int k = word * VALS;
        float xs[M][VALS];
        float xsum[M];
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            float s = 0.f;
            for (int i = 0; i < VALS; ++i) {
                xs[m][i] = m < rows ? static_cast<float>(x[(size_t)(m0 + m) * K + k + i]) : 0.f;
                s += xs[m][i];
            }
            xsum[m] = s;
        }
        const int g = k / GS;
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            const int n = n0 + r;
            if (n >= N) break;
            const uint32_t packed = w[(size_t)n * words + word];
            const float scale = static_cast<float>(scales[(size_t)n * groups + g]);
            const float bias = static_cast<float>(biases[(size_t)n * groups + g]);
            float q[VALS];
            if constexpr (CONVERT) mtplx_convert_word<BITS>(packed, q); else mtplx_unpack_word<BITS>(packed, q);
            for (int m = 0; m < M; ++m) {
                float dot = 0.f;
                for (int i = 0; i < VALS; ++i) dot += xs[m][i] * q[i];
                acc[r][m] += scale * dot + bias * xsum[m];
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        const int n = n0 + r;
        for (int m = 0; m < M; ++m) {
            const float total = cg::reduce(warp, acc[r][m], cg::plus<float>());
            if (lane == 0 && n < N && m < rows) out[(size_t)(m0 + m) * N + n] = static_cast<T>(total);
        }
    }
"""

# The same product, laid out for bandwidth (a weight matrix bigger than the L2 cache, where
# the per-word kernel above reads 4 bytes per lane per load): a block owns R output columns and
# its warps split K between them; each thread loads 16 bytes (VEC words) of every one of its R
# weight rows at once, so R 16-byte loads are in flight per thread, and the warps' partial sums
# meet in shared memory. VEC words never straddle a group (a group is 8 words at 4-bit, 16 at
# 8-bit), so each load has one scale and one bias.
_SOURCE_VECTOR = r"""
    constexpr int VALS = 32 / BITS;
    constexpr int VEC = 4;                       // words per 16-byte load
    constexpr int MAX_WARPS = 8;
    struct alignas(sizeof(T) * VALS) XLoad { T v[VALS]; };  // one word's inputs, one load
    __shared__ float partial[MAX_WARPS][R][M];
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int lane = warp.thread_rank();
    const int wid = warp.meta_group_rank();
    const int nwarps = blockDim.x / 32;

    const int N = w_shape[0];
    const int words = w_shape[1];
    const int K = words * VALS;
    const int groups = K / GS;
    const int vecs = words / VEC;
    const int m0 = blockIdx.y * M;
    const int rows = x_shape[0] - m0 < M ? x_shape[0] - m0 : M;
    const int pass_vecs = blockDim.x * U;        // vectors of a row one pass covers

    float acc[R][M];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    }

    // 2^23's bits for the in-place unpack, behind a test the compiler cannot decide (N is
    // positive), so that it keeps them in one register rather than making them per value.
    const uint32_t magic = N > 0 ? 0x4B000000u : 0u;

    // One pass: U 16-byte vectors of each of the R rows from n0 per thread, all loaded before
    // any is used (more bytes in flight per thread); thread t takes vectors t, t + blockDim.x,
    // ... in that order whatever U is, so at one block size U changes no sum's order.
    struct Pass { uint4 packed[U][R]; float scale[U][R], bias[U][R]; };
    auto load = [&](Pass& p, const int n0, const int base) {
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            // Past the end: a real vector is read, never used.
            const int v = min(base + u * (int)blockDim.x + (int)threadIdx.x, vecs - 1);
            const int g = v * VEC * VALS / GS;
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const int n = n0 + r < N ? n0 + r : N - 1;   // past the edge: read a real row, never store it
                if constexpr (IN_PLACE) {  // 32-bit indices: 46 fewer instructions a pass than 64-bit
                    p.packed[u][r] = reinterpret_cast<const uint4*>(w)[n * vecs + v];
                    p.scale[u][r] = static_cast<float>(scales[n * groups + g]);
                    p.bias[u][r] = static_cast<float>(biases[n * groups + g]);
                } else {
                    p.packed[u][r] = reinterpret_cast<const uint4*>(w + (size_t)n * words)[v];
                    p.scale[u][r] = static_cast<float>(scales[(size_t)n * groups + g]);
                    p.bias[u][r] = static_cast<float>(biases[(size_t)n * groups + g]);
                }
            }
        }
    };
    auto use = [&](const Pass& p, const int base) {
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int v = base + u * (int)blockDim.x + (int)threadIdx.x;
            if (v >= vecs) break;
            const int k = v * VEC * VALS;
            float vsum[M];                       // BIAS_ONCE: the vector's inputs summed
            #pragma unroll
            for (int m = 0; m < M; ++m) vsum[m] = 0.f;
            #pragma unroll
            for (int j = 0; j < VEC; ++j) {
                float xs[M][VALS];
                float xsum[M];
                #pragma unroll
                for (int m = 0; m < M; ++m) {
                    // One load of the word's VALS inputs (16 bytes at 4-bit, 8 at 8-bit in 16-bit
                    // floats): a load per value made the loads, not the weights, the limit.
                    XLoad raw{};
                    if (m < rows) raw = *reinterpret_cast<const XLoad*>(x + (size_t)(m0 + m) * K + k + j * VALS);
                    const T* vals = reinterpret_cast<const T*>(&raw);
                    float s = 0.f;
                    #pragma unroll
                    for (int i = 0; i < VALS; ++i) {
                        const float v = static_cast<float>(vals[i]);
                        s += v;
                        xs[m][i] = IN_PLACE && !CONVERT ? v * mtplx_in_place_scale<BITS>(i) : v;
                    }
                    xsum[m] = s;
                    vsum[m] += s;
                }
                #pragma unroll
                for (int r = 0; r < R; ++r) {
                    const uint32_t word = reinterpret_cast<const uint32_t*>(&p.packed[u][r])[j];
                    float q[VALS];
                    if constexpr (CONVERT) mtplx_convert_word<BITS>(word, q);
                    else if constexpr (IN_PLACE) mtplx_unpack_word_in_place<BITS>(word, q, magic);
                    else mtplx_unpack_word<BITS>(word, q);
                    #pragma unroll
                    for (int m = 0; m < M; ++m) {
                        float dot = 0.f;
                        #pragma unroll
                        for (int i = 0; i < VALS; ++i) dot += xs[m][i] * q[i];
                        acc[r][m] += BIAS_ONCE ? p.scale[u][r] * dot : p.scale[u][r] * dot + p.bias[u][r] * xsum[m];
                    }
                }
            }
            if constexpr (BIAS_ONCE) {
                // The vector's VEC words share one group, so one bias: applied once to their
                // inputs' sum rather than per word (a multiply a word and row fewer).
                #pragma unroll
                for (int r = 0; r < R; ++r) {
                    #pragma unroll
                    for (int m = 0; m < M; ++m) acc[r][m] += p.bias[u][r] * vsum[m];
                }
            }
        }
    };
    // The block's sums of its R columns from n0, across warps through shared memory, out.
    auto store = [&](const int n0) {
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                const float total = cg::reduce(warp, acc[r][m], cg::plus<float>());
                if (lane == 0) partial[wid][r][m] = total;
            }
        }
        block.sync();
        for (int t = threadIdx.x; t < R * M; t += blockDim.x) {
            const int r = t / M, m = t % M, n = n0 + r;
            if (n >= N || m >= rows) continue;
            float total = 0.f;
            for (int i = 0; i < nwarps; ++i) total += partial[i][r][m];
            out[(size_t)(m0 + m) * N + n] = static_cast<T>(total);
        }
    };

    if constexpr (!PERSISTENT) {                 // a block per R columns
        const int n0 = blockIdx.x * R;
        for (int base = 0; base < vecs; base += pass_vecs) {
            Pass p;
            load(p, n0, base);
            use(p, base);
        }
        store(n0);
    } else {
        // Fewer blocks than column blocks (VECTOR_PERSISTENT_BLOCKS), each striding over them,
        // the next pass's loads (of this column block or the next) issued before this pass's
        // arithmetic: no last wave of blocks part empty, and loads in flight while a block
        // computes. Each thread's sums run in the order above: the same outputs bit for bit.
        const int column_blocks = (N + R - 1) / R;
        int column_block = blockIdx.x, base = 0;
        Pass now, next;
        if (column_block < column_blocks) load(now, column_block * R, 0);
        while (column_block < column_blocks) {
            int next_block = column_block, next_base = base + pass_vecs;
            if (next_base >= vecs) {
                next_base = 0;
                next_block += gridDim.x;
            }
            if (next_block < column_blocks) load(next, next_block * R, next_base);
            use(now, base);
            if (next_base == 0) {                // this column block is done
                store(column_block * R);
                #pragma unroll
                for (int r = 0; r < R; ++r) {
                    #pragma unroll
                    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
                }
                block.sync();                    // `partial` read by all before its next write
            }
            now = next;
            column_block = next_block;
            base = next_base;
        }
    }
"""
# The same product on the tensor cores, for 1 to 32 rows a read of the weights. The vector
# layout's multiply-adds run on the CUDA cores, 6 a weight at 6 rows, with every row's sums in
# registers (248 a thread at 6 rows, 7.8% occupancy): Nsight Compute found its 6-row product
# issue-bound at 4.7x its 1-row time (docs/benchmarks.md, "a profile of the quantized
# matmuls"). Here a warp computes a 16-column x 8-row tile per mma.sync (m16n8k16): the
# weights are A (16 output columns x 16 k), the input rows B (16 k x 8 rows), so 1..8 rows cost
# one mma and up to MT tiles of 8 rows share each dequantized A.
#
# No dequantization arithmetic: a 4-bit value q is masked into the mantissa of a 16-bit float
# whose lowest bit weighs 1, which is OFFSET + q exactly (bf16 0x4300 | q = 128 + q, half
# 0x6400 | q = 1024 + q); an 8-bit value is two such nibble planes (q = lo + 16 hi). Per group
# of 64 k (one scale and bias per output column), with S = sum of x over the group (the same
# mma with A all ones):
#   sum_k x (s q + b) = s (D - OFFSET_SUM S) + b S,   D = sum_p 16^p sum_k x (OFFSET + q_p)
# in float32 (each mma's products are exact, its sums float32). The subtraction cancels up to
# log2(OFFSET_SUM) of D's 24 bits (7 for 4-bit bf16, up to 14 for 8-bit float16 inputs); the
# probe and the CUDA tests hold each input type's outputs to the float32 truth as the other
# layouts' are held (bf16 on the H200: 2.1-2.9e-3 of the largest output, as theirs).
#
# A mma's 16 k must share a group, so lane t (of the 4 in a row's quad) takes 16 values of
# each group, at t*16 (4-bit: 8 bytes, 8-bit: 16 bytes of the row). Pairs of values are taken
# as the mask gives them: 4-bit (i, i+4) of a word (shift 4i, mask 0x000F000F), 8-bit (i, i+2);
# the input pairs are permuted to match (one byte_perm each). Which slot of the mma a value
# takes does not matter so long as its weight and its input take the same one.
# KW warps split the groups of K (U groups loaded before any is used) and meet in shared memory.
_SOURCE_MMA = r"""
    constexpr int VALS = 32 / BITS;                     // values in a word
    constexpr int TW = GS / VALS / 4;                   // words of a group per lane: 2 (4-bit), 4 (8-bit)
    constexpr int ROWS = 8 * MT;
    struct alignas(4 * TW) WLoad { uint32_t v[TW]; };  // a lane's words of one group, one load
    __shared__ float partial[KW][MT][16][8];

    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int N = w_shape[0];
    const int words = w_shape[1];
    const int K = words * VALS;
    const int groups = K / GS;
    const int n0 = blockIdx.x * 16;
    const MtplxMmaConstants constants = mtplx_mma_constants<BF16, HOIST>(N);
    const int m0 = blockIdx.y * ROWS;
    const int rows = x_shape[0] - m0 < ROWS ? x_shape[0] - m0 : ROWS;
    const int na = min(n0 + g, N - 1), nb = min(n0 + g + 8, N - 1);  // past the edge: read a real row, never store it

    float acc[MT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;
    }

    for (int base = wid * U; base < groups; base += KW * U) {
        WLoad qa[U], qb[U];
        float sa[U], sb[U], ba[U], bb[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int gi = min(base + u, groups - 1);
            qa[u] = *reinterpret_cast<const WLoad*>(w + (size_t)na * words + gi * (GS / VALS) + t * TW);
            qb[u] = *reinterpret_cast<const WLoad*>(w + (size_t)nb * words + gi * (GS / VALS) + t * TW);
            sa[u] = static_cast<float>(scales[(size_t)na * groups + gi]);
            sb[u] = static_cast<float>(scales[(size_t)nb * groups + gi]);
            ba[u] = static_cast<float>(biases[(size_t)na * groups + gi]);
            bb[u] = static_cast<float>(biases[(size_t)nb * groups + gi]);
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int gi = base + u;
            if (gi >= groups) break;                    // the same for the whole warp
            mtplx_mma_group<BF16, BITS, GS, MT>(acc, qa[u].v, qb[u].v, sa[u], sb[u], ba[u], bb[u], x, K,
                                                gi * GS + t * (GS / 4), m0, rows, g, constants);
        }
    }
    mtplx_mma_store<KW, MT>(partial, acc, out, N, n0, m0, rows);
"""

# The mma layout with its weights copied into shared memory S batches ahead (cp.async), so a
# warp has S - 1 batches of U groups in flight while it multiplies one, in few registers (the
# plain layout holds its U groups' words, scales and biases in registers: 106 a thread at
# 4-bit, U = 4, so 25% occupancy on the H200 under Nsight). Each warp runs its own pipeline
# over the same groups, in the same order, with the same arithmetic (mtplx_mma_group) as the
# plain layout at the same KW and U, so its outputs equal the plain layout's bit for bit and
# it is as row-invariant. It needs K's groups a whole number of U, U of 2, 4 or 8, and 16-bit
# scales and biases (a row's U scales in one 4-, 8- or 16-byte copy): `pipelined_stages`.
_SOURCE_MMA_PIPELINED = r"""
    constexpr int VALS = 32 / BITS;                     // values in a word
    constexpr int TW = GS / VALS / 4;                   // words of a group per lane: 2 (4-bit), 4 (8-bit)
    constexpr int GW = GS / VALS;                       // words of a group of one weight row
    constexpr int PIECES = GW / 4;                      // 16-byte copies of them
    constexpr int ROWS = 8 * MT;
    // A warp's stage: U groups of its 16 weight rows, then the rows' U scales and U biases.
    constexpr int STAGE_WORDS = U * 16 * GW + 16 * U;
    constexpr int PARTIAL_WORDS = KW * MT * 16 * 8;     // the warps' sums at the end reuse the stages
    constexpr int SMEM_WORDS = KW * S * STAGE_WORDS > PARTIAL_WORDS ? KW * S * STAGE_WORDS : PARTIAL_WORDS;
    __shared__ __align__(16) uint32_t smem[SMEM_WORDS];
    static_assert(sizeof(*scales) == 2 && sizeof(*biases) == 2, "a row's U scales are one copy of 2U bytes");

    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int N = w_shape[0];
    const int words = w_shape[1];
    const int K = words * VALS;
    const int groups = K / GS;                          // a whole number of U (pipelined_stages)
    const int n0 = blockIdx.x * 16;
    const MtplxMmaConstants constants = mtplx_mma_constants<BF16, HOIST>(N);
    const int m0 = blockIdx.y * ROWS;
    const int rows = x_shape[0] - m0 < ROWS ? x_shape[0] - m0 : ROWS;
    uint32_t* const stages = smem + wid * S * STAGE_WORDS;

    // Batch b (the U groups from (b * KW + wid) * U, as the plain layout's loop takes them) into
    // stage b % S: lane l copies 16-byte pieces of the weights (two lanes a row's group at
    // 4-bit), lanes 0-15 then row l's U scales, 16-31 row l - 16's U biases. Past the last
    // batch it copies nothing but still commits, so a wait counts batches alike every time.
    auto issue = [&](int b) {
        const int base = (b * KW + wid) * U;
        if (base < groups) {
            uint32_t* const stage = stages + (b % S) * STAGE_WORDS;
            #pragma unroll
            for (int i = 0; i < U * 16 * PIECES / 32; ++i) {
                const int c = i * 32 + lane;
                const int u = c / (16 * PIECES), r = (c / PIECES) % 16, piece = c % PIECES;
                const int n = min(n0 + r, N - 1);       // past the edge: read a real row, never store it
                mtplx_cp_async<16>(stage + (u * 16 + r) * GW + piece * 4,
                                   w + (size_t)n * words + (size_t)(base + u) * GW + piece * 4);
            }
            const int n = min(n0 + (lane & 15), N - 1);
            mtplx_cp_async<2 * U>(reinterpret_cast<char*>(stage + U * 16 * GW) + lane * U * sizeof(*scales),
                                  (lane < 16 ? scales : biases) + (size_t)n * groups + base);
        }
        mtplx_cp_async_commit();
    };

    float acc[MT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;
    }

    #pragma unroll
    for (int b = 0; b < S - 1; ++b) issue(b);
    for (int b = 0; (b * KW + wid) * U < groups; ++b) {
        issue(b + S - 1);                               // into the stage batch b - 1 was read from
        mtplx_cp_async_wait<S - 1>();                   // batch b has landed (this lane's copies)
        __syncwarp();                                   // and every lane's
        const uint32_t* const stage = stages + (b % S) * STAGE_WORDS;
        const auto sb = reinterpret_cast<decltype(scales)>(stage + U * 16 * GW);  // scales, then biases
        const int base = (b * KW + wid) * U;
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            mtplx_mma_group<BF16, BITS, GS, MT>(
                acc, stage + (u * 16 + g) * GW + t * TW, stage + (u * 16 + g + 8) * GW + t * TW,
                static_cast<float>(sb[g * U + u]), static_cast<float>(sb[(g + 8) * U + u]),
                static_cast<float>(sb[(16 + g) * U + u]), static_cast<float>(sb[(24 + g) * U + u]), x, K,
                (base + u) * GS + t * (GS / 4), m0, rows, g, constants);
        }
        __syncwarp();                                   // every lane is done with the stage before its refill
    }
    mtplx_cp_async_wait<0>();
    __syncthreads();                                    // every warp is done with its stages
    mtplx_mma_store<KW, MT>(reinterpret_cast<float (*)[MT][16][8]>(smem), acc, out, N, n0, m0, rows);
"""

LAYOUTS = ("word", "vector", "mma")
MMA_WARPS = 8  # warps of a block of the mma layout, splitting the groups of K between them
MMA_MAX_TILES = 4  # 8-row tiles a block takes (32 rows a read of the weights); more take grid y
MMA_GROUPS_PER_LOAD = {4: 4, 8: 2}  # groups a lane loads before using any (32 bytes of each row)
MMA_DTYPES = (mx.bfloat16, mx.float16)
# Stages of the pipelined mma layout (_SOURCE_MMA_PIPELINED): at most this many batches of
# groups a warp keeps in shared memory, S - 1 of them in flight; 0 runs the plain layout.
# Where it fits, its outputs are the plain layout's bit for bit. On an H100 (2026-12-05,
# bench.small_m --mma-variants) 2 stages at 8 x 4 beat the plain layout on every matrix of the
# hybrid 27B and the 32B from 40M weights, at 1 row and at 6 (lm_head at 1 row: 297 and 193
# us against 494 and 313), and lost 1-3 us on the small k_proj. Whole models: not yet measured
# (`bench.real_size --mma-configs 8x4,8x4s2`).
MMA_STAGES = 2
# A block of the mma layout launches at any register count a thread up to this many warps
# (256 threads x 255 registers fit an SM's 65,536). A thread's registers grow with the row
# tiles and the groups it loads: 16 warps (512 threads, at most 128 registers each) over 4 row
# tiles failed to launch on an H100 ("too many resources requested for launch": the pipelined
# layout on 2026-12-05, the plain one at 8-bit on 2026-12-07, which needs 134 registers there
# in sm_90 SASS at 2 groups a load). So a larger block (the micro-bench's 16 warps) runs the
# plain layout over one row tile, where a thread needs at most 118 (4 groups a load).
MMA_WARPS_ANY_REGISTERS = 8
# The mma layout's unpack mask and all-ones fragment kept in registers (_HEADER's
# mtplx_mma_constants): the same outputs in 9-10% fewer instructions at one row tile in sm_90
# SASS (pipelined 4-bit: 374 against 410 a 4-group pass, 64 registers against 60; 8-bit 293
# against 324; the plain layout 444 against 491), level at four tiles (911 against 901).
# Served since 2026-12-07: on an H100 (bench.small_m, the 32B's six matrices at 4 and 8 bits,
# 1 and 4 rows) it was faster than the constants made before each use on 21 of 24 products
# (median 4%; gate_proj 4-bit 1 row 44.8 against 47.6 us, lm_head 187 against 194), the same
# outputs bit for bit there and in the CUDA tests (docs/benchmarks.md, "The fewer-instruction
# forms timed").
MMA_HOIST = True
SHARED_MEMORY_BYTES = 48 * 1024  # a block's static shared memory
VECTOR_ROWS = 8  # output columns a block of the vector layout computes together (H200: 8 beat 2 and 4)
VECTOR_MAX_THREADS = 256
# Two ways to fewer instructions a weight in the vector layout, where Nsight Compute found a
# decode step's product issuing an instruction every 1.35 cycles per scheduler at 42% of DRAM
# bandwidth (docs/benchmarks.md, "a profile of the quantized matmuls"). Counted in sm_90 SASS
# (docs/benchmarks-data/sass-mix.py), the loop over one 16-byte vector of each of 8 rows at one
# row, 4-bit: 1,422 instructions masked (served until 2026-12-07); 1,154 unpacked in place
# (_HEADER's mtplx_unpack_word_in_place) with its loads indexed in 32 bits (under 2^31 words;
# `small_m_matmul` checks), the same outputs bit for bit; 1,102 with the bias once a vector too
# (sums in another order); 8-bit 843, 691, 638; 80 registers or fewer each. Timed on an H100
# (2026-12-07, docs/benchmarks.md "The fewer-instruction forms timed"): at one row all three
# level within the run's noise (in place 0.77-1.07x the masked form's time, median 1.02: not
# issue-bound there on the H100's lower bandwidth), at 4 rows 0.64-1.09x (median 0.94); whole
# 32B 4-bit decode steps in place 12.0-13.7 ms (median 12.2) against 12.9-17.3 (13.5) in two
# processes. In place is served: the same outputs bit for bit (CUDA tests, both bit widths and
# input types). Bias once stays off: no faster in whole steps (14.5-14.6 against in place's
# 12.2-13.7 in one process) and it moves the rounding.
VECTOR_IN_PLACE = True
VECTOR_BIAS_ONCE = False
# Blocks of the vector layout's persistent form (None, served: a block per VECTOR_ROWS columns).
# Under Nsight on an H100 (2026-12-07, second session) the 1-row gate_proj's 3,200 blocks ran at
# 4 an SM in 6.06 waves (the last 6% full), each block loading its pass and then computing it,
# at 56-58% of DRAM bandwidth. The persistent form runs this many blocks, each striding over
# the column blocks with the next pass's loads in flight during this one's arithmetic; the
# same outputs bit for bit. One-row products only (at 8 rows a block it holds two passes in
# 165 registers at one row and spills at six; 72 at 4 rows a block). Timed under Nsight on an
# H100 (2026-12-07, third session; docs/benchmarks.md "What a 1-row product's fetch can reach"):
# slower everywhere, 1.25-1.55x the served form's time (gate_proj 49.7-52.6 against 39.6 us,
# down_proj 54.8 against 36.5), its occupancy halved by the registers: it stays opt-in
# (`small_m_matmul(persistent_blocks=...)`, bench.small_m_ncu --persistent-blocks), off.
VECTOR_PERSISTENT_BLOCKS: int | None = None
# Weights (N x K) from which a decode step's product (under MIN_ROWS rows) takes the vector
# layout: on the H200 it beat MLX's matvec on Qwen3-32B's down/gate/up projections and both
# lm_heads at 4-bit (0.59-0.80x), and lost on the small ones (k_proj, a 4B layer's matrices).
# From 64M down to 32M on 2026-12-06 (q_proj and o_proj, 42M, now take it): on an H100 the
# 32B 4-bit's whole decode steps ran 13.19 ms against 14.56 in the compiled AR loop (512
# tokens) and 18.06 against 19.07 op by op (4,096), in one process each; the device's time
# per step 18.94 against 20.60 ms (docs/benchmarks.md, "The attention, layer by layer").
# From 32M down to 16M on 2026-12-07 (a Qwen3-4B's MLP, 25M, now takes it, and with it the
# 4-bit 4B is served by `default_wanted` and decodes in the compiled AR loop): on an H100 its
# decode steps took 4.4-6.3 ms (median 5.10, seven processes) against 5.1-7.8 (median 7.38)
# with MLX's matvec op by op, faster in each of seven pairs; under Nsight its MLP's products
# took 1.62 device ms a step against MLX's 2.46 (docs/benchmarks.md, "The 4B's decode steps on
# the kernel"). A Qwen3-8B's q/o (exactly 16M) take it too: untimed there.
LARGE_MATRIX_VALUES = 16 * 2**20
# Weights from which such a decode step's 1-row product of 16-bit inputs takes the mma layout
# rather than the vector layout; None (served): never. On an H100 (2026-12-07, bench.small_m)
# the pipelined mma layout at one row beat the vector layout on the 32B's 4-bit gate_proj,
# down_proj and lm_head alone (44.8-51.3 against 56.8-60.4 us; lm_head 187 against 220) and
# tied on q_proj and o_proj (42M); on 2026-12-05 it tied on gate_proj (58.2 against 58.5). A
# product routed so rounds as the verify's rows of it do. Timed whole on an H100 (2026-12-07,
# second session; real_size's `+mma_decode` form, 64M: the 32B's MLP and lm_head): 32B 4-bit
# decode median 14.8 ms against 15.5 as served, ten rounds in five processes, paired rounds
# -4.1..+4.2 ms (faster in 6 of 10): within the noise. Under Nsight the two layouts' 1-row
# products took the same device time (gate_proj 39.4-39.8 us against the vector layout's
# 39.3-40.9; down_proj 41.4-41.8 against 37.2-37.9): the micro-bench's lead was the host's.
# So off.
DECODE_MMA_VALUES: int | None = None
# Verify blocks (MIN_ROWS..VECTOR_MAX_ROWS rows) take the vector layout from this many weights:
# on the H200 (docs/benchmarks-data/h200-vector-qmm-2026-12-02/lease2) it beat the word layout
# at 4 and 7 rows on every Qwen3-32B matrix of 42M weights or more, 4- and 8-bit (4-bit, 7
# rows: 0.29-0.53x MLX's time against the word layout's 0.48-0.61x), and was level or behind
# on the 5M k_proj. More rows than VECTOR_MAX_ROWS[bits] keep the word layout: the vector
# layout holds a row's accumulators in registers, and for sm_90 ptxas spills at 4-bit from 7
# rows (255 registers; 8 bytes at 7 rows, 16 at 8) and at 8-bit from 9 (checked by a test).
VERIFY_VECTOR_VALUES = 40 * 2**20
VECTOR_MAX_ROWS = {4: 6, 8: 7}
# Blocks of 2 to MAX_ROWS rows of those matrices take the mma layout instead when their
# inputs are 16-bit floats (every served model's): on the H200 a 6-row product of Qwen3-32B's
# gate_proj took 82 us through it against 208 for the vector layout and 444 for MLX at 4-bit
# (106, 241 and 339 at 8-bit), 1.05x its own 1-row time (1.17x at 8-bit), while MLX's matvec
# costs about rows x one row (docs/benchmarks.md, "The tensor-core layout"). At 2 and 3 rows
# (4-bit) it led every layout on the 32B's matrices from 40M weights (gate_proj 71 and 86 us
# against MLX's 163 and 231, the vector layout's 89 and 115); 7 rows sit between its 6-row
# and 8-row times (82 and 78 us), where MLX's matvec costs 7 of its 1-row products.

# Opt-in to row-invariant routing for a load (module docstring) where `install` is not told.
ROW_INVARIANT_ENV = "MTPLX_ROW_INVARIANT"
# Set while this thread runs a solo MTP decoder's cycle (`cycle_routed`): layers marked
# `cycle_row_invariant` route row-invariantly then. Per thread: each thread traces its own
# compiled graphs (decoding/compiled.py).
_cycle = threading.local()

_usable: bool | None = None
_mma_usable: bool | None = None  # probed apart: a GPU without bf16 mma.sync keeps the other layouts


@functools.cache
def _small_m_kernel(layout: str = "word"):
    source = {"vector": _SOURCE_VECTOR, "mma": _SOURCE_MMA, "mma_pipelined": _SOURCE_MMA_PIPELINED}.get(layout, _SOURCE)
    return custom_kernels.cuda_kernel(name=f"mtplx_small_m_qmm_{layout}", input_names=["x", "w", "scales", "biases"],
                                      output_names=["out"], source=source,
                                      header=custom_kernels.TENSOR_CORE_HEADER + _HEADER)


def small_m_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int,
                   rows_per_warp: int | None = None, layout: str | None = None,
                   convert: bool = False, unroll: int | None = None, warps: int | None = None,
                   stages: int | None = None, in_place: bool | None = None,
                   bias_once: bool | None = None, hoist: bool | None = None,
                   persistent_blocks: int | None = None) -> mx.array:
    """x (..., K) times the dequantized W (N, K) transposed: (..., N), as
    mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=64, bits=bits).
    CUDA only (see `usable`); any number of rows, ROW_CHUNK at a time per block.
    `layout`: "word" (a warp per ROWS_PER_WARP columns, a word per lane per load) or
    "vector" (a block per VECTOR_ROWS columns, 16 bytes per thread per load, warps splitting
    K); None takes "word". `rows_per_warp`: output columns per warp, or per block in the
    vector layout (the micro-bench tries several). `convert`: unpack the weights with an
    int-to-float conversion per value (the kernel before _HEADER's and-or unpack: the same
    outputs, kept for the micro-bench's side-by-side). `unroll` (vector layout): 16-byte
    vectors of each weight row a thread loads before using any, in a block of 1/unroll the
    threads (the micro-bench's question: do more bytes in flight per thread read faster? The
    fewer threads split K differently, so outputs round apart from unroll 1's by a little);
    None is 1. `in_place` (vector layout): unpack the weights in place and index them in 32
    bits (VECTOR_IN_PLACE when None; the same outputs bit for bit in fewer instructions; a
    matrix of 2^31 words or more keeps the 64-bit form); `bias_once`: apply a group's
    bias once a 16-byte vector rather than per word (VECTOR_BIAS_ONCE when None);
    `persistent_blocks`: that many blocks striding over the column blocks, the next pass's
    loads issued before this one's arithmetic (when None: VECTOR_PERSISTENT_BLOCKS for a
    one-row product; 0 or None: a block per column block; the same outputs either way).
    "mma" (bfloat16/float16 inputs: the tensor cores, a block per 16 columns and up to
    32 rows, see _SOURCE_MMA) takes `warps` (MMA_WARPS) warps a block and `unroll` groups a
    lane loads before using any (MMA_GROUPS_PER_LOAD), pipelined through `stages`
    (MMA_STAGES) stages of shared memory where that fits (`pipelined_stages`), its unpack's
    constants kept in registers with `hoist` (MMA_HOIST when None; the same outputs)."""
    layout = layout or "word"
    rows = kernel_rows(x)
    M, N = x.size // x.shape[-1], w.shape[0]
    out_shape = (*x.shape[:-1], N)
    if layout == "mma":
        return _mma_matmul(rows, w, scales, biases, bits, warps, unroll, stages, out_shape,
                           MMA_HOIST if hoist is None else hoist)
    unroll = unroll or 1
    chunk = min(M, ROW_CHUNK)  # the kernel's M: rows per block
    persistent = False
    if layout == "vector":
        per_block = rows_per_warp or VECTOR_ROWS
        if persistent_blocks is None:  # served on one-row products only (it spills at 6 rows)
            persistent_blocks = VECTOR_PERSISTENT_BLOCKS if M == 1 else 0
        threads, blocks, persistent = vector_grid(w, per_block, unroll, persistent_blocks)
    else:
        per_block = rows_per_warp or ROWS_PER_WARP
        threads = WARPS_PER_BLOCK * 32
        blocks = _ceil_div(_ceil_div(N, per_block), WARPS_PER_BLOCK)
    out = _small_m_kernel(layout)(
        inputs=[rows, w, scales, biases],
        template=[("T", x.dtype), ("M", chunk), ("BITS", bits), ("GS", GROUP_SIZE), ("R", per_block),
                  ("CONVERT", convert), ("U", unroll),
                  ("IN_PLACE", (VECTOR_IN_PLACE if in_place is None else in_place) and w.size < 2**31),
                  ("BIAS_ONCE", VECTOR_BIAS_ONCE if bias_once is None else bias_once),
                  ("PERSISTENT", persistent)],
        grid=(blocks * threads, _ceil_div(M, chunk), 1), threadgroup=(threads, 1, 1),
        output_shapes=[out_shape], output_dtypes=[x.dtype])[0]
    return out


def vector_grid(w: mx.array, rows_per_block: int, unroll: int = 1,
                persistent_blocks: int | None = None) -> tuple[int, int, bool]:
    """(threads a block, blocks, persistent) of the vector layout over the packed weights `w`
    (N, words): a block per `rows_per_block` output columns, its threads splitting a row's
    16-byte vectors, `unroll` of them a thread per pass (bench.read_ceiling reads in the same
    grid); or, where `persistent_blocks` is fewer than those blocks, that many, each striding
    over them (the kernel's PERSISTENT form)."""
    vecs = w.shape[1] // 4  # 16-byte loads per weight row
    threads = min(VECTOR_MAX_THREADS, max(32, _ceil_div(vecs, 32 * unroll) * 32))
    blocks = _ceil_div(w.shape[0], rows_per_block)
    if persistent_blocks and persistent_blocks < blocks:
        return threads, persistent_blocks, True
    return threads, blocks, False


def kernel_rows(x: mx.array) -> mx.array:
    """x as the kernels' rows: x itself where its first dimension already counts them (every
    other leading dimension 1, as in a decode step's (1, 1, K)), else reshaped to (M, K). The
    kernels read only `x_shape[0]` and x's row-contiguous memory, the same either way, and
    write their (M, N) outputs straight into the caller's shape. Why: on CUDA a reshape is one
    more primitive for the host to build and run each call, and an op-by-op step is
    host-bound: the 32B's step with the kernel had 642 of them among 2,895 primitives (about
    9 us of host time a primitive on an H200's host; docs/benchmarks.md, "The attention's
    instructions")."""
    if x.ndim >= 2 and all(d == 1 for d in x.shape[1:-1]):
        return x
    return x.reshape(-1, x.shape[-1])


def _mma_matmul(rows: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int,
                warps: int | None, groups_per_load: int | None, stages: int | None,
                out_shape: tuple[int, ...], hoist: bool = False) -> mx.array:
    """The mma layout on `kernel_rows` (M rows of K): a block per 16 output columns and up to
    MMA_MAX_TILES tiles of 8 rows (one in a block of over MMA_WARPS_ANY_REGISTERS warps),
    `warps` (MMA_WARPS) warps splitting K's groups, each loading `groups_per_load` groups
    before using any, through `stages` (MMA_STAGES) stages of shared memory where they fit,
    its unpack's constants in registers with `hoist` (mtplx_mma_constants); the output in
    `out_shape`."""
    if rows.dtype not in MMA_DTYPES:
        raise ValueError(f"the mma layout takes bfloat16 or float16 inputs, not {rows.dtype}")
    M, N = rows.size // rows.shape[-1], w.shape[0]
    warps = warps or MMA_WARPS
    tiles = min(MMA_MAX_TILES if warps <= MMA_WARPS_ANY_REGISTERS else 1, _ceil_div(M, 8))
    groups_per_load = groups_per_load or MMA_GROUPS_PER_LOAD[bits]
    stages = pipelined_stages(bits, warps, groups_per_load, rows.shape[-1] // GROUP_SIZE,
                              MMA_STAGES if stages is None else stages)
    if scales.dtype.size != 2 or biases.dtype.size != 2:
        stages = 0  # the pipelined form copies a row's scales of a batch as 16-bit values
    template = [("T", rows.dtype), ("BF16", rows.dtype == mx.bfloat16), ("BITS", bits), ("GS", GROUP_SIZE),
                ("MT", tiles), ("KW", warps), ("U", groups_per_load), ("HOIST", hoist)]
    kernel = _small_m_kernel("mma_pipelined" if stages else "mma")
    return kernel(inputs=[rows, w, scales, biases], template=template + ([("S", stages)] if stages else []),
                  grid=(_ceil_div(N, 16) * 32 * warps, _ceil_div(M, 8 * tiles), 1), threadgroup=(32 * warps, 1, 1),
                  output_shapes=[out_shape], output_dtypes=[rows.dtype])[0]


def pipelined_stages(bits: int, warps: int, groups_per_load: int, groups: int, stages: int) -> int:
    """The stages the pipelined mma layout runs with when asked for `stages`: the most, up to
    `stages`, whose shared memory fits a block (each warp keeps `stages` batches of
    `groups_per_load` groups of its 16 weight rows, with their scales and biases); 0 (the
    plain layout) below 2 stages, or where a row's scales of one batch are no single 4-, 8- or
    16-byte copy (`groups_per_load` of 2, 4 or 8 dividing the matrix's `groups`). It depends
    on the matrix and the shape only, never on the rows, so every row count of a matrix takes
    one layout. A block of more than MMA_WARPS_ANY_REGISTERS warps runs the plain layout."""
    if groups_per_load not in (2, 4, 8) or groups % groups_per_load or warps > MMA_WARPS_ANY_REGISTERS:
        return 0
    stage_bytes = groups_per_load * 16 * (GROUP_SIZE * bits // 8) + 16 * groups_per_load * 4
    fitting = min(stages, SHARED_MEMORY_BYTES // (warps * stage_bytes))
    return fitting if fitting >= 2 else 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def reference(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """The kernel's arithmetic in plain MLX ops (any backend): unpack each word's values,
    then scale * sum(x q) + bias * sum(x) per group, summed over the groups."""
    lead, K = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, K).astype(mx.float32)
    vals = 32 // bits
    shifts = mx.arange(vals, dtype=mx.uint32) * bits
    q = ((w[..., None] >> shifts) & ((1 << bits) - 1)).astype(mx.float32)  # (N, words, vals)
    N = w.shape[0]
    q = q.reshape(N, K // GROUP_SIZE, GROUP_SIZE)  # (N, groups, 64)
    xg = rows.reshape(-1, K // GROUP_SIZE, GROUP_SIZE)  # (M, groups, 64)
    dots = mx.einsum("mgi,ngi->mng", xg, q)
    sums = mx.sum(xg, axis=-1)[:, None, :]  # (M, 1, groups)
    out = mx.sum(scales.astype(mx.float32)[None] * dots + biases.astype(mx.float32)[None] * sums, axis=-1)
    return out.astype(x.dtype).reshape(*lead, N)


def route(x: mx.array, layer: Any) -> str | None:
    """Which layout of the kernel serves `layer`(x), or None for mx.quantized_matmul:
    - MLX_TILED_ROWS rows or more (a cohort's verify, prefill): MLX's tiled qmm;
    - 2..MAX_ROWS rows of bf16/float16 inputs on a matrix of at least VERIFY_VECTOR_VALUES
      weights: "mma" (the tensor cores: 6 rows cost 1.05-1.17x one row, where MLX's matvec
      costs about rows x one row, so from 2 rows on);
    - MIN_ROWS[bits]..MAX_ROWS rows (verify blocks) otherwise: up to VECTOR_MAX_ROWS[bits]
      rows on such a matrix "vector" (float32 inputs, or no mma), else "word";
    - fewer rows (decode steps): "vector" on a matrix of at least LARGE_MATRIX_VALUES
      weights, where its 16-byte loads beat MLX's matvec (H200, docs/benchmarks.md), unless
      the layer's `kernel_decode` is False (`install` sets it: a hybrid model's); "mma" there
      instead on a matrix of at least DECODE_MMA_VALUES weights (opt-in) with 16-bit inputs;
    the rest stays on MLX. A layer marked `row_invariant` (`install`), or `cycle_row_invariant`
    inside an MTP cycle (`cycle_routed`), sends every 1..MAX_ROWS rows of 16-bit inputs to
    "mma", whatever the matrix (the module docstring says why). Both
    need affine 4- or 8-bit weights in groups of 64, a floating input and K a whole number of
    groups."""
    if not (getattr(layer, "mode", "affine") == "affine" and layer.bits in BITS
            and layer.group_size == GROUP_SIZE and x.ndim and x.shape[-1] % GROUP_SIZE == 0
            and x.dtype in (mx.bfloat16, mx.float16, mx.float32)
            and getattr(layer, "biases", None) is not None):
        return None
    rows = x.size // x.shape[-1]
    if rows > MAX_ROWS:
        return None
    if _routed_row_invariant(layer) and x.dtype in MMA_DTYPES and _mma_usable is not False:
        return "mma"  # one layout at every row count: a verify row rounds as a decode step
    values = layer["weight"].shape[0] * x.shape[-1]
    large = values >= VERIFY_VECTOR_VALUES
    if rows >= 2 and large and x.dtype in MMA_DTYPES and _mma_usable is not False:
        return "mma"
    if rows >= MIN_ROWS[layer.bits]:
        return "vector" if large and rows <= VECTOR_MAX_ROWS[layer.bits] else "word"
    if rows >= 1 and values >= LARGE_MATRIX_VALUES and getattr(layer, "kernel_decode", True):
        return "mma" if _decode_on_mma(values, x) else "vector"
    return None


def _decode_on_mma(values: int, x: mx.array) -> bool:
    """Whether a decode step's product of a matrix of `values` weights takes the mma layout
    (DECODE_MMA_VALUES)."""
    return (DECODE_MMA_VALUES is not None and values >= DECODE_MMA_VALUES and x.dtype in MMA_DTYPES
            and _mma_usable is not False)


def _routed_row_invariant(layer: Any) -> bool:
    return getattr(layer, "row_invariant", False) or (
        getattr(layer, "cycle_row_invariant", False) and in_mtp_cycle())


def in_mtp_cycle() -> bool:
    """Whether this thread is running a solo MTP decoder's cycle (`cycle_routed`)."""
    return getattr(_cycle, "active", False)


def cycle_routed(cycles: Generator[Any, Any, Any]) -> Generator[Any, Any, Any]:
    """`cycles` (a solo MTP decoder's generator) with each of its resumes run as an MTP cycle
    (`in_mtp_cycle`), so layers marked `cycle_row_invariant` route row-invariantly there,
    in the graphs the cycle traces too, while an AR request's decode steps keep the mixed
    routing. Only the resume is marked: the scheduler steps other requests between cycles."""
    sent = None
    try:
        while True:
            with marked_as_cycle():
                try:
                    item = cycles.send(sent)
                except StopIteration as stop:
                    return stop.value
            sent = yield item
    finally:
        with marked_as_cycle():  # closing writes the committed state back
            cycles.close()


def routed_as_cycles(method: Callable[..., Generator[Any, Any, Any]]) -> Callable[..., Generator[Any, Any, Any]]:
    """A decoder's `cycles` generator method whose generators are `cycle_routed`."""
    @functools.wraps(method)
    def cycles(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        return cycle_routed(method(*args, **kwargs))
    return cycles


@contextlib.contextmanager
def marked_as_cycle() -> Iterator[None]:
    """Run the block as an MTP cycle on this thread (`in_mtp_cycle`): what `cycle_routed`
    does around each resume, for a bench that times a cycle's pieces alone."""
    outer = in_mtp_cycle()
    _cycle.active = True
    try:
        yield
    finally:
        _cycle.active = outer


def supported(x: mx.array, layer: Any) -> bool:
    """True when the kernel serves `layer`(x) (see `route`)."""
    return route(x, layer) is not None


class SmallMQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose few-row products go through the kernel (install() swaps a
    model's QuantizedLinear modules to this class; parameters and names are unchanged)."""

    def __call__(self, x: mx.array) -> mx.array:
        layout = route(x, self)
        if layout is None:
            return super().__call__(x)
        out = small_m_matmul(x, self["weight"], self["scales"], self["biases"], self.bits, layout=layout)
        if "bias" in self:
            out = out + self["bias"]
        return out


def default_wanted(model: nn.Module) -> bool:
    """Whether the kernel serves `model` unless asked otherwise: a model whose verify blocks
    gain (`verify_wanted`), or a dense 4-bit model (`decode_wanted`) with matrices of at least
    LARGE_MATRIX_VALUES weights, whose decode steps gain (Qwen3-4B on an H100: 5.10 ms a step
    against 7.38, its depth-3 cycles level at 12.7 against 13.1; LARGE_MATRIX_VALUES says
    more). Off elsewhere: on the embedded model (8-bit, small) the kernel made decoding
    slower."""
    decode_gains = decode_wanted(model) and _largest_values(model) >= LARGE_MATRIX_VALUES
    return verify_wanted(model) or decode_gains


def verify_wanted(model: nn.Module) -> bool:
    """Whether `model`'s verify blocks take the kernel: its quantized linear layers all 4-bit
    or all 8-bit, some holding at least VERIFY_VECTOR_VALUES weights (a 27B/32B model's q/o
    and MLP projections). That is where whole forwards measured it faster on the H200
    (docs/benchmarks.md, "The small-M kernel in whole 32B forwards", "Whole models with the
    kernel, 2026-12-03" and "The hybrid's verify with the kernel, decode steps on MLX"):
    Qwen3-32B 4-bit, a depth-3 cycle 2.16-2.29 decode steps against MLX's 3.91-4.28; 8-bit,
    3.05-3.16 against 3.82-4.24, the decode level; the hybrid 27B 4-bit with its decode steps
    left on MLX (`decode_wanted`), a depth-3 cycle 54 ms against 79. At Qwen3-4B size the
    cycles were level."""
    bits = _quantized_bits(model)
    return len(bits) == 1 and bits <= set(BITS) and _largest_values(model) >= VERIFY_VECTOR_VALUES


def _unswitched(model: nn.Module) -> list[nn.QuantizedLinear]:
    """`model`'s quantized linear layers not yet switched to the kernel (`install`)."""
    return [m for _, m in model.named_modules() if type(m) is nn.QuantizedLinear]


def _largest_values(model: nn.Module) -> int:
    """The most weights any of `model`'s unswitched quantized linear layers holds."""
    return max((m["weight"].shape[0] * m["weight"].shape[1] * 32 // m.bits
                for m in _unswitched(model)), default=0)


def decode_wanted(model: nn.Module) -> bool:
    """Whether a decode step's products take the kernel (the vector layout, on matrices of
    LARGE_MATRIX_VALUES weights) in `model`: in a dense 4-bit model only. Not in a hybrid model
    (Gated DeltaNet layers), whose decode steps took 34-48 ms through it on the H200 against
    MLX's 20-29; not at 8-bit, where a 1-row product of the 32B's gate_proj took 83 us through
    it against MLX's 74, and the 32B's 1-token forward 29.5 ms against 26.5 (its verify blocks
    gain in both: `verify_wanted`)."""
    return not _hybrid(model) and _quantized_bits(model) == {4}


def row_invariant_wanted(model: nn.Module | None = None) -> bool:
    """Whether `install` routes `model` row-invariantly unless told: MTPLX_ROW_INVARIANT "1"
    or "0" decides; else a model whose verify blocks take the kernel (`verify_wanted`) that is
    a hybrid (Gated DeltaNet) or 8-bit.
    A hybrid 27B at 4-bit went from 32 greedy divergences in 40-43 tokens (mixed routing) to
    none in 2,000, its cycles as fast as the mixed routing's in the same process (H200, depth
    3: 29.0 / 28.9 ms at T=0 / 0.6 against 29.9 / 32.0; docs/benchmarks.md, "Both routings in
    one process"); at 8-bit since an H100 measured it (module docstring).
    A dense 8-bit 32B's AR decode step took 15.7 ms so (every product on the mma layout, in the
    compiled AR loop) against 19.4 in the mixed routing (op by op, its decode products on
    MLX's matvec: `decode_wanted`) and 18.6 with MLX's matvec compiled, 0.79-0.85x in each of
    four rounds in one process (H100, 2026-12-07, eighth session; docs/benchmarks.md, "The
    buffer attention on the tensor cores timed"); its MTP cycles were routed so already.
    Not dense 4-bit models, whose AR decode steps took the vector layout at least as fast
    (the 32B in that process: 1.04x with row-invariant routing, slower in three rounds of four;
    before, 13.5-14.7 ms against 19.3-20.8 op by op): they route row-invariantly inside their
    MTP cycles only (`cycle_row_invariant_wanted`)."""
    if (asked := _row_invariant_asked()) is not None:
        return asked
    return model is not None and verify_wanted(model) and (_hybrid(model) or _quantized_bits(model) == {8})


def cycle_row_invariant_wanted(model: nn.Module | None = None) -> bool:
    """Whether `install` routes `model` row-invariantly inside its MTP cycles
    (`cycle_routed`) unless told: MTPLX_ROW_INVARIANT "1" or "0" decides; else any model
    whose verify blocks take the kernel (`verify_wanted`). A dense Qwen3-32B's depth-3 cycle
    took 1.26-1.38 decode steps so at 4-bit against the mixed routing's 1.60-1.68, and 1.31
    against 1.56 at 8-bit (H100, T=0, one process each, 2026-12-05), while its AR decode steps
    keep the mixed routing's speed. A 4B-class model, served for its decode steps only, keeps
    the mixed routing in its cycles: so they measured level with the kernel off (12.7 against
    13.1 ms at depth 3, H100, 2026-12-07); row-invariant there is untimed."""
    if (asked := _row_invariant_asked()) is not None:
        return asked
    return model is not None and verify_wanted(model)


def _row_invariant_asked() -> bool | None:
    """MTPLX_ROW_INVARIANT's answer ("1" True, "0" False), or None where it says neither."""
    asked = os.environ.get(ROW_INVARIANT_ENV, "")
    return asked == "1" if asked in ("0", "1") else None


def _hybrid(model: nn.Module) -> bool:
    return any("GatedDeltaNet" in type(m).__name__ for _, m in model.named_modules())


def _quantized_bits(model: nn.Module) -> set[int]:
    return {m.bits for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}


def install(model: nn.Module, *, force: bool | None = None, decode: bool | None = None,
            row_invariant: bool | None = None, cycle_row_invariant: bool | None = None) -> int:
    """Route `model`'s quantized linear layers through the kernel where it is usable.

    `force` None follows `default_wanted(model)`, or installs wherever routing is
    row-invariant (asking for it asks for the kernel); True or False decides. `decode` None
    follows `decode_wanted(model)` for the decode steps' products; True or False decides.
    `row_invariant` True sends every 1..MAX_ROWS-row product to the mma layout (`route`);
    None follows `row_invariant_wanted(model)`. `cycle_row_invariant` does so inside MTP
    cycles only (`cycle_routed`); None follows `cycle_row_invariant_wanted(model)`. Returns how
    many layers were switched (0 off CUDA, when off, or when the probe fails: the stock ops
    stay).
    """
    invariant = row_invariant_wanted(model) if row_invariant is None else row_invariant
    in_cycles = cycle_row_invariant_wanted(model) if cycle_row_invariant is None else cycle_row_invariant
    wanted = (invariant or default_wanted(model)) if force is None else force
    if not wanted or not usable():
        return 0
    mma_usable()  # probed here, outside any traced graph; `route` reads the outcome
    kernel_decode = decode_wanted(model) if decode is None else decode
    switched = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear:
            module.__class__ = SmallMQuantizedLinear
            module.kernel_decode = kernel_decode
            module.row_invariant = invariant
            module.cycle_row_invariant = invariant or in_cycles
            switched += 1
    _routing_changed()
    return switched


def uninstall(model: nn.Module) -> int:
    """Put `model`'s kernel layers back on MLX's QuantizedLinear (benches time both); returns
    how many."""
    switched = 0
    for _, module in model.named_modules():
        if isinstance(module, SmallMQuantizedLinear):
            module.__class__ = nn.QuantizedLinear
            switched += 1
    _routing_changed()
    return switched


# What `install` marked on a model's layers, remembered on the model (`_routing_marks`) until
# the next install or uninstall anywhere: a 64-layer model has about 1,000 modules to walk (4
# ms on a slow CPU), and `fused_ar.fused_ar_wanted` asks before every AR request on CUDA.
_MARKS = ("kernel_decode", "row_invariant", "cycle_row_invariant")
_routing_generation = 0


def _routing_changed() -> None:
    global _routing_generation
    _routing_generation += 1


def routed_row_invariant(model: nn.Module, *, in_cycles: bool = False) -> bool:
    """Whether `install` left `model`'s kernel layers routed row-invariantly (`in_cycles`:
    inside its MTP cycles)."""
    return _any_kernel_layer(model, "cycle_row_invariant" if in_cycles else "row_invariant")


def decode_routed(model: nn.Module) -> bool:
    """Whether `install` left a decode step's products of `model` on the kernel (the vector
    layout on large matrices: `decode_wanted`, or `install`'s `decode`)."""
    return _any_kernel_layer(model, "kernel_decode")


def _any_kernel_layer(model: nn.Module, mark: str) -> bool:
    """Whether any of `model`'s kernel layers carries `install`'s `mark` (an attribute) set."""
    generation, marks = getattr(model, "_routing_marks", (None, None))
    if generation != _routing_generation:
        layers = [m for _, m in model.named_modules() if isinstance(m, SmallMQuantizedLinear)]
        marks = {name: any(getattr(m, name, False) for m in layers) for name in _MARKS}
        # object's setattr: nn.Module's would file a tuple among the parameters
        object.__setattr__(model, "_routing_marks", (_routing_generation, marks))
    return marks[mark]


def path_name(switched: int, *, decode: bool = True, row_invariant: bool = False,
              cycle_row_invariant: bool = False) -> str:
    """What /health and status say about a model's quantized matmuls, given what `install`
    returned for it (and whether its decode steps take the kernel: `decode_wanted`, and
    whether it routed row-invariantly, everywhere or in MTP cycles): the kernel, or MLX's own
    (and why)."""
    if switched and row_invariant and _mma_usable is not False:
        return (f"small-M CUDA kernel, row-invariant (1..{MAX_ROWS} rows on {_tensor_cores()}, "
                f"decode steps included)")
    if switched and cycle_row_invariant and _mma_usable is not False:
        steps = f"large matrices on {_decode_layouts()}" if decode else "on mlx"
        return (f"small-M CUDA kernel, row-invariant in MTP cycles (1..{MAX_ROWS} rows on "
                f"{_tensor_cores()}); AR decode steps {steps}")
    if switched:
        steps = f"decode steps of large matrices on {_decode_layouts()}" if decode else "decode steps on mlx"
        tensor_cores = "" if _mma_usable is False else f", 2..{MAX_ROWS} on {_tensor_cores()} for large matrices"
        return (f"small-M CUDA kernel (verify blocks of {MIN_ROWS[4]}..{MAX_ROWS} rows at 4-bit, "
                f"{MIN_ROWS[8]}..{MAX_ROWS} at 8-bit{tensor_cores}; {steps})")
    if not fixed_shapes_wanted():
        return "mlx (the small-M kernel is CUDA only)"
    if _usable is False:  # probed (at install) and failed; an unprobed kernel is not compiled here
        return "mlx (the small-M kernel failed its probe)"
    return "mlx (the small-M kernel is on by default for 27B/32B-class 4- and 8-bit models only)"


def _decode_layouts() -> str:
    """The layouts of a decode step's large products as path_name names them."""
    vector = "the vector layout" + (f" (persistent, {VECTOR_PERSISTENT_BLOCKS} blocks)"
                                    if VECTOR_PERSISTENT_BLOCKS else "")
    if DECODE_MMA_VALUES is None or _mma_usable is False:
        return vector
    return f"{vector}, from {DECODE_MMA_VALUES / 2**20:g}M weights on {_tensor_cores()}"


def _tensor_cores() -> str:
    """The mma layout as path_name names it: pipelined through shared memory (MMA_STAGES)."""
    return f"the tensor cores, pipelined in {MMA_STAGES} stages" if MMA_STAGES >= 2 else "the tensor cores"


def usable() -> bool:
    """True on CUDA once the kernel compiled and matched mx.quantized_matmul on a probe.
    Checked once per process; a failure is logged and leaves the stock ops in place."""
    global _usable
    if _usable is None:
        _usable = fixed_shapes_wanted() and _probe()
    return _usable


def mma_usable() -> bool:
    """True on CUDA once the mma layout compiled and matched the float32 truth on a probe
    (it needs bf16 mma.sync: sm_80 and later). Where it does not, its verify blocks take the
    vector layout. Checked once per process."""
    global _mma_usable
    if _mma_usable is None:
        _mma_usable = fixed_shapes_wanted() and custom_kernels.probe(
            "small-M quantized matmul, tensor-core layout", lambda: _worst_probe_error(("mma",)),
            0.01, "the vector layout")
    return _mma_usable


def relative_error(got: mx.array, want: mx.array) -> float:
    """max |got - want| over max |want| (float32)."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return mx.max(mx.abs(got - want)).item() / (mx.max(mx.abs(want)).item() or 1.0)


def probe_case(M: int, bits: int, N: int = 320, K: int = 512, dtype: mx.Dtype = mx.bfloat16):
    """(x, w, scales, biases, float32 truth) on random data: the truth is mx.quantized_matmul
    with everything in float32 (MLX's own low-precision matmuls round more than the kernel),
    computed on the CPU: on CUDA, MLX's float32 matmuls of two or more rows rounded further
    than 1e-5 relative from the CPU's (the reference test failed there for M >= 2 only: cuBLAS
    ran them in TF32, MLX's default, which the engine now turns off: mtplxd.matmul_precision),
    which is no truth for a kernel or its plain-ops reference."""
    keys = mx.random.split(mx.random.key(M * 10 + bits), 2)
    weight = mx.random.normal((N, K), key=keys[0]) * 0.05
    w, scales, biases = mx.quantize(weight.astype(dtype), group_size=GROUP_SIZE, bits=bits)
    x = mx.random.normal((M, K), key=keys[1]).astype(dtype)
    with mx.stream(mx.cpu):
        truth = mx.quantized_matmul(x.astype(mx.float32), w, scales.astype(mx.float32),
                                    biases.astype(mx.float32), transpose=True, group_size=GROUP_SIZE,
                                    bits=bits)
        mx.eval(truth)
    return x, w, scales, biases, truth


def probe_error(M: int, bits: int, layout: str | None = None, **shape: Any) -> float:
    """The kernel's relative error against the float32 truth (raises where it cannot run),
    its M rows given as a model's layers give them, (1, M, K): one row goes to the kernel as
    it is, more are reshaped (`kernel_rows`), so the probe covers both."""
    x, w, scales, biases, truth = probe_case(M, bits, **shape)
    got = small_m_matmul(x[None], w, scales, biases, bits, layout=layout)
    return relative_error(got.reshape(truth.shape), truth)


def _worst_probe_error(layouts: tuple[str, ...]) -> float:
    """The largest probe_error of `layouts` at 1, 3 and 6 rows, both bit widths."""
    return max(probe_error(M, bits, layout) for M in (1, 3, 6) for bits in BITS for layout in layouts)


def _probe() -> bool:
    return custom_kernels.probe(
        "small-M quantized matmul", lambda: _worst_probe_error(("word", "vector")),
        0.01, "mx.quantized_matmul")
