"""How fast the GPU reads a quantized weight matrix when nothing is computed: the ceiling a
product of that matrix can reach (issue 22, point 6: what limits a decode step's product).

Under Nsight Compute on an H100 (2026-12-07, docs/benchmarks.md "Decode products on the
tensor cores timed whole, and a 1-row product under Nsight") the served 1-row products of the
Qwen3-32B's 4-bit gate_proj read at 56-58% of DRAM bandwidth, the vector layout and the
tensor-core layout alike, with different instruction counts, occupancies and stalls. Two
readers tell whether that is the arithmetic or the way the bytes are fetched:

- `vector`: the vector layout's grid and loads exactly (`small_m_qmm.vector_grid`: a block per
  R output rows, each thread one 16-byte vector of each of the R rows a pass, with its group's
  scale and bias), the arithmetic replaced by an XOR of the bits read. At the product's DRAM
  figure: the fetch pattern is the limit (grid, tail, bytes in flight), not the arithmetic.
  (It needs fewer registers than the product, 56 against 80 at 8 rows, so it can hold more
  blocks an SM: Nsight's occupancy says how many it did.)
- `stream`: the same bytes of `w` read as one flat array, `U` 16-byte vectors a thread in
  flight, a fixed grid striding over it: the machine's own read ceiling for that many bytes.

Measured on an H100 (2026-12-07, third session; docs/benchmarks.md "What a 1-row product's
fetch can reach"): the stream at 78-81% of DRAM bandwidth on the MLP's matrices, the vector
grid at 76% on gate_proj (the product 57%: its arithmetic is the limit) and 60% on down_proj
(the product 63%: its grid, 1.2 waves of long blocks, is).

Each returns XORs (uint32) that `reference_*` computes in numpy, so a CUDA test can check that
every byte meant to be read was read. CUDA only (`mx.fast.cuda_kernel`); bench.small_m_ncu runs
them with `--read-ceiling`.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from mtplxd.engine.model import small_m_qmm

STREAM_THREADS = 256
STREAM_BLOCKS = 132 * 8  # 8 blocks of 256 threads an SM on an H100 or H200 (132 SMs)
STREAM_UNROLL = 4

_WARP_XOR = r"""
    // `v` XORed across the warp (every lane ends with the warp's XOR).
    #pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v ^= __shfl_xor_sync(0xffffffffu, v, offset);
"""

_SOURCE_VECTOR = r"""
    constexpr int VALS = 32 / BITS;
    constexpr int VEC = 4;                       // words per 16-byte load
    __shared__ uint32_t partial[8][R];
    const int lane = threadIdx.x % 32;
    const int wid = threadIdx.x / 32;
    const int nwarps = blockDim.x / 32;
    const int N = w_shape[0];
    const int words = w_shape[1];
    const int groups = words * VALS / GS;
    const int vecs = words / VEC;
    const int n0 = blockIdx.x * R;
    const unsigned short* scale_bits = reinterpret_cast<const unsigned short*>(scales);
    const unsigned short* bias_bits = reinterpret_cast<const unsigned short*>(biases);

    uint32_t acc[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0u;
    for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
        const int g = v * VEC * VALS / GS;
        uint4 packed[R];
        uint32_t group_bits[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) {            // every load of the pass before any use
            const int n = n0 + r < N ? n0 + r : N - 1;
            packed[r] = reinterpret_cast<const uint4*>(w)[n * vecs + v];
            group_bits[r] = scale_bits[n * groups + g] | (uint32_t(bias_bits[n * groups + g]) << 16);
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            acc[r] ^= packed[r].x ^ packed[r].y ^ packed[r].z ^ packed[r].w ^ group_bits[r];
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        uint32_t v = acc[r];
""" + _WARP_XOR + r"""
        if (lane == 0) partial[wid][r] = v;
    }
    __syncthreads();
    if (threadIdx.x < R && n0 + (int)threadIdx.x < N) {
        uint32_t v = 0u;
        for (int i = 0; i < nwarps; ++i) v ^= partial[i][threadIdx.x];
        out[n0 + threadIdx.x] = v;
    }
"""

_SOURCE_STREAM = r"""
    __shared__ uint32_t partial[32];
    const int lane = threadIdx.x % 32;
    const int wid = threadIdx.x / 32;
    const int total = w_shape[0] * (w_shape[1] / 4);   // 16-byte vectors
    const int stride = gridDim.x * blockDim.x;
    const uint4* vecs = reinterpret_cast<const uint4*>(w);
    uint32_t v = 0u;
    for (int base = blockIdx.x * blockDim.x + threadIdx.x; base < total; base += stride * U) {
        uint4 packed[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = base + u * stride;
            packed[u] = i < total ? vecs[i] : make_uint4(0u, 0u, 0u, 0u);
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) v ^= packed[u].x ^ packed[u].y ^ packed[u].z ^ packed[u].w;
    }
""" + _WARP_XOR + r"""
    if (lane == 0) partial[wid] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t x = 0u;
        for (int i = 0; i < (int)blockDim.x / 32; ++i) x ^= partial[i];
        out[blockIdx.x] = x;
    }
"""


@functools.cache
def _kernel(pattern: str):
    source = {"vector": _SOURCE_VECTOR, "stream": _SOURCE_STREAM}[pattern]
    return mx.fast.cuda_kernel(name=f"mtplx_read_ceiling_{pattern}", input_names=["w", "scales", "biases"],
                               output_names=["out"], source=source)


def read_vector(w: mx.array, scales: mx.array, biases: mx.array, bits: int,
                rows_per_block: int = small_m_qmm.VECTOR_ROWS) -> mx.array:
    """(N,) uint32: each weight row's words, and its groups' scale and bias bits (bias high),
    XORed, read in the vector layout's grid (`small_m_qmm.vector_grid`) and order."""
    threads, blocks, _ = small_m_qmm.vector_grid(w, rows_per_block)
    return _kernel("vector")(
        inputs=[w, scales, biases],
        template=[("R", rows_per_block), ("BITS", bits), ("GS", small_m_qmm.GROUP_SIZE)],
        grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(w.shape[0],)], output_dtypes=[mx.uint32])[0]


def read_stream(w: mx.array, scales: mx.array, biases: mx.array, blocks: int = STREAM_BLOCKS,
                unroll: int = STREAM_UNROLL) -> mx.array:
    """(blocks,) uint32 whose XOR is that of every word of `w`, read as one flat array by
    `blocks` blocks of STREAM_THREADS threads, `unroll` 16-byte vectors a thread in flight.
    (scales and biases are taken only so that it is called as the products are.)"""
    return _kernel("stream")(
        inputs=[w, scales, biases], template=[("U", unroll)],
        grid=(blocks * STREAM_THREADS, 1, 1), threadgroup=(STREAM_THREADS, 1, 1),
        output_shapes=[(blocks,)], output_dtypes=[mx.uint32])[0]


def _bits16(a: mx.array) -> np.ndarray:
    """A 16-bit float array's bit patterns as uint32 (numpy has no bfloat16)."""
    return np.array(a.view(mx.uint16)).astype(np.uint32)


def reference_vector(w: mx.array, scales: mx.array, biases: mx.array, bits: int) -> np.ndarray:
    """What `read_vector` returns, in numpy: a row's words XORed, and for each of its 16-byte
    vectors the bits of the group it falls in (a group spans several vectors: each is XORed
    once a vector, as the kernel reads it)."""
    words = np.array(w)
    vector_groups = np.arange(words.shape[1] // 4) * 4 * (32 // bits) // small_m_qmm.GROUP_SIZE
    group_bits = _bits16(scales) | (_bits16(biases) << 16)
    return (np.bitwise_xor.reduce(words, axis=1)
            ^ np.bitwise_xor.reduce(group_bits[:, vector_groups], axis=1)).astype(np.uint32)


def reference_stream(w: mx.array) -> int:
    """The XOR of every word of `w`: what `read_stream`'s outputs XOR to."""
    return int(np.bitwise_xor.reduce(np.array(w), axis=None))
