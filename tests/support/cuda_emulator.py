"""A CUDA kernel body of the engine run on the CPU: its logic checked where no GPU is lent.

The engine's kernels (mx.fast.cuda_kernel bodies) run only on an NVIDIA GPU, which this
machine does not have. Here a body is compiled as C++ with g++ and launched block by block,
each block's threads as OS threads: `__syncthreads` and `__syncwarp` are barriers, a warp's
shuffles and `mma.sync` (the tensor cores) exchange values through memory between barriers,
and the asynchronous copies are plain copies. `__shared__` variables become function-level
statics (one block runs at a time), and the dynamic shared memory a buffer that starts filled
with 0xFF bytes (NaN in 16 and 32 bits), so a kernel that reads a stage it never wrote shows
it. The fake sits at the hardware boundary only: the kernel's own source is compiled as it
is written, after `custom_kernels.compact`. A kernel whose threads leave while others wait at
a barrier (undefined on a GPU) hangs here: the engine's kernels return block- or warp-uniformly.

`mma.sync.m16n8k16` is emulated from the PTX ISA's fragment layouts (the comment on
`mtplx_mma` in custom_kernels.TENSOR_CORE_HEADER states them), independently of any kernel
that uses it, with float32 sums in k order: the hardware's order of summation differs, so a
result agrees with the GPU's to rounding, not bit for bit.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mtplxd.engine.model import custom_kernels

GXX = shutil.which("g++")

_PRELUDE = r"""
#include <algorithm>
#include <array>
#include <barrier>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
using std::max;
using std::min;
#define __device__
#define __forceinline__ inline
#define __align__(n) alignas(n)
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
struct alignas(16) uint4 { uint32_t x, y, z, w; };
struct alignas(8) uint2 { uint32_t x, y; };
struct alignas(16) float4 { float x, y, z, w; };
thread_local Dim3 threadIdx;
Dim3 blockIdx, blockDim, gridDim;
static std::barrier<>* emu_block_barrier;
static std::vector<std::barrier<>*> emu_warp_barriers;
static unsigned char* emu_dynamic_shared;
inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }
static float emu_shuffle[32][32];
inline float __shfl_xor_sync(unsigned, float value, int mask) {
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    emu_shuffle[w][lane] = value;
    __syncwarp();
    const float other = emu_shuffle[w][lane ^ mask];
    __syncwarp();
    return other;
}
inline float emu_bits_to_float(uint32_t bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline float __uint_as_float(uint32_t bits) { return emu_bits_to_float(bits); }
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t selector) {  // byte i of the result: byte (selector's nibble i) of y:x
    const uint64_t both = ((uint64_t)y << 32) | x;
    uint32_t out = 0;
    for (int i = 0; i < 4; ++i) out |= (uint32_t)((both >> (8 * ((selector >> (4 * i)) & 7))) & 0xFFu) << (8 * i);
    return out;
}
struct __nv_bfloat16 {
    uint16_t bits;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) {  // round to nearest even, as __float2bfloat16 (finite inputs)
        uint32_t u; std::memcpy(&u, &f, 4);
        u += 0x7FFFu + ((u >> 16) & 1u);
        bits = (uint16_t)(u >> 16);
    }
    operator float() const { return emu_bits_to_float((uint32_t)bits << 16); }
};
struct __half {
    uint16_t bits;
    __half() = default;
    __half(float f) { _Float16 h = (_Float16)f; std::memcpy(&bits, &h, 2); }
    operator float() const { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
};
template <bool BF16>
inline float emu_half_value(uint32_t reg, int element) {
    const uint16_t bits = (uint16_t)(reg >> (16 * element));
    if constexpr (BF16) return emu_bits_to_float((uint32_t)bits << 16);
    _Float16 h; std::memcpy(&h, &bits, 2); return (float)h;
}
// mma.sync.m16n8k16, per the PTX ISA: lane l = 4 g + t holds A[g + 8 (r % 2)][2t + 8 (r / 2) + e]
// in half e of A register r, B[2t + 8 r + e][g] in half e of B register r, and D[g + 8 (i / 2)][2t + i % 2].
static uint32_t emu_a[32][32][4], emu_b[32][32][2];
template <bool BF16>
inline void mtplx_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    emu_a[w][lane][0] = a0; emu_a[w][lane][1] = a1; emu_a[w][lane][2] = a2; emu_a[w][lane][3] = a3;
    emu_b[w][lane][0] = b0; emu_b[w][lane][1] = b1;
    __syncwarp();
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
        float sum = d[i];
        for (int k = 0; k < 16; ++k) {
            const float a = emu_half_value<BF16>(emu_a[w][(row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2);
            const float b = emu_half_value<BF16>(emu_b[w][col * 4 + (k % 8) / 2][k / 8], k % 2);
            sum += a * b;
        }
        d[i] = sum;
    }
    __syncwarp();
}
template <int BYTES>
inline void mtplx_cp_async(void* dst, const void* src) { std::memcpy(dst, src, BYTES); }
inline void mtplx_cp_async_or_zero(void* dst, const void* src, bool real) {
    if (real) std::memcpy(dst, src, 16); else std::memset(dst, 0, 16);
}
inline void mtplx_cp_async_commit() {}
template <int N>
inline void mtplx_cp_async_wait() {}
using Shape = std::array<int32_t, 8>;
template <typename U> struct Limits { static constexpr U finite_min() { return -FLT_MAX; } };
"""


def _body(source: str) -> str:
    """A kernel body with its shared memory made block-wide for sequential blocks."""
    body = custom_kernels.compact(source)
    body = body.replace("extern __shared__ __align__(16) unsigned char mtplx_shared[];",
                        "unsigned char* mtplx_shared = emu_dynamic_shared;")
    return body.replace("__shared__", "static")


def signature(inputs: list[tuple[str, str]], outputs: list[tuple[str, str]], constants: dict[str, Any],
              shape_type: str) -> tuple[list[str], str]:
    """A kernel's parameters as mx.fast.cuda_kernel writes them (each input's pointer of its own
    type, then its shape as `shape_type`; the outputs' pointers), and its constants' lines;
    `inputs`/`outputs`: (name, C type; "T" for the T constant's type)."""
    def typed(kind: str) -> str:
        return str(constants["T"]) if kind == "T" else kind

    params = [f"const {typed(kind)}* {n}, {shape_type} {n}_shape" for n, kind in inputs]
    params += [f"{typed(kind)}* {n}" for n, kind in outputs]
    lines = "".join(f"  using {k} = {v};\n" if k == "T" else
                    f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower()};\n"
                    for k, v in constants.items())
    return params, lines


def build(name: str, source: str, header: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]],
          constants: dict[str, Any], directory: Path) -> ctypes.CDLL:
    """`source` (a cuda_kernel body) with `header` (without TENSOR_CORE_HEADER, emulated here)
    as a shared library whose `launch(pointers..., shapes..., grid x, y, z, threads, shared
    bytes)` runs the grid; `inputs`/`outputs`: (name, C type; "T" for the T constant)."""
    params, lines = signature(inputs, outputs, constants, "const Shape")
    args = ", ".join([f"{n}, {n}_shape" for n, _ in inputs] + [n for n, _ in outputs])
    launch_params = ", ".join(params + ["int gx", "int gy", "int gz", "int threads", "int shared_bytes"])
    header = "\n".join(line for line in custom_kernels.compact(header).splitlines()
                       if not line.startswith("#include <cooperative_groups"))  # CUDA's, unused here
    program = (_PRELUDE + header + f"\nstatic void body({', '.join(params)}) {{\n{lines}"
               f"{_body(source)}\n}}\n"
               f"extern \"C\" void launch({launch_params}) {{\n"
               "  std::vector<unsigned char> shared(shared_bytes + 16, 0xFF);\n"
               "  emu_dynamic_shared = shared.data() + (16 - reinterpret_cast<uintptr_t>(shared.data()) % 16) % 16;\n"
               "  gridDim = {(unsigned)gx, (unsigned)gy, (unsigned)gz}; blockDim = {(unsigned)threads, 1, 1};\n"
               "  for (int bz = 0; bz < gz; ++bz) for (int by = 0; by < gy; ++by) for (int bx = 0; bx < gx; ++bx) {\n"
               "    std::fill(shared.begin(), shared.end(), 0xFF);\n"
               "    blockIdx = {(unsigned)bx, (unsigned)by, (unsigned)bz};\n"
               "    std::barrier<> block(threads);\n"
               "    std::vector<std::barrier<>*> warps;\n"
               "    for (int w = 0; w < threads / 32; ++w) warps.push_back(new std::barrier<>(32));\n"
               "    emu_block_barrier = &block; emu_warp_barriers = warps;\n"
               "    std::vector<std::thread> pool;\n"
               "    for (int i = 0; i < threads; ++i) pool.emplace_back([&, i] {\n"
               f"      threadIdx = {{(unsigned)i, 0, 0}}; body({args}); }});\n"
               "    for (auto& th : pool) th.join();\n"
               "    for (auto* w : warps) delete w;\n"
               "  }\n}\n")
    digest = hashlib.sha256(program.encode()).hexdigest()[:16]
    library = directory / f"{name}-{digest}.so"
    if not library.exists():
        path = directory / f"{name}-{digest}.cpp"
        path.write_text(program)
        done = subprocess.run([GXX, "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-w", str(path),
                               "-o", str(library)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(done.stderr)
    return ctypes.CDLL(str(library))


class Shape(ctypes.Structure):
    """The kernel's `Shape` (8 int32), passed by value."""
    _fields_ = [("dims", ctypes.c_int32 * 8)]


def shape_of(array: np.ndarray) -> Shape:
    return Shape((ctypes.c_int32 * 8)(*(list(array.shape) + [0] * (8 - array.ndim))))


def launch(library: ctypes.CDLL, inputs: list[np.ndarray], outputs: list[np.ndarray],
           grid: tuple[int, int, int], threads: int, shared_bytes: int) -> None:
    """Run `build`'s kernel over `grid` blocks of `threads`: each input (C-contiguous) with
    its shape, then the outputs, written in place."""
    args: list[Any] = []
    for array in inputs:
        assert array.flags.c_contiguous
        args += [ctypes.c_void_p(array.ctypes.data), shape_of(array)]
    for array in outputs:
        assert array.flags.c_contiguous
        args.append(ctypes.c_void_p(array.ctypes.data))
    library.launch(*args, *(ctypes.c_int(n) for n in (*grid, threads, shared_bytes)))


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (MLX's conversion: nearest even), as uint16 bit patterns."""
    return np.array(mx.array(np.asarray(values, np.float32)).astype(mx.bfloat16).view(mx.uint16))


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns as float32."""
    return np.array(mx.array(bits).view(mx.bfloat16).astype(mx.float32))
