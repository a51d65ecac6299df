"""What every custom CUDA kernel of the engine shares: it is used only after a probe on
this machine compiled it and matched MLX's own ops, and any failure leaves MLX's ops in place;
and it is built from its source without comments or indentation (`cuda_kernel`).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

log = logging.getLogger(__name__)


# Device helpers of the kernels that use the tensor cores and asynchronous copies (sm_80 on):
# small_m_qmm's mma layouts and buffer_attention's mma form put it before their own header.
TENSOR_CORE_HEADER = r"""// d += A (16 x 16) * B (16 x 8) on the tensor cores, 16-bit inputs, float32 sums (sm_80 on).
// Per lane (g = lane / 4, t = lane % 4): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1],
// a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]; b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g];
// d = D[g][2t, 2t+1], D[g+8][2t, 2t+1] (PTX ISA, mma.m16n8k16).
template <bool BF16>
__device__ __forceinline__ void mtplx_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
    if constexpr (BF16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}
// Asynchronous copies global -> shared (sm_80 on): BYTES of 4, 8 (through L1) or 16 (L2
// only: each weight is read once), then a commit closing the copies issued so far into a
// group, and a wait until at most N groups of this thread's are in flight.
template <int BYTES>
__device__ __forceinline__ void mtplx_cp_async(void* dst, const void* src) {
    const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    if constexpr (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(to), "l"(src) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" :: "r"(to), "l"(src), "n"(BYTES) : "memory");
    }
}
__device__ __forceinline__ void mtplx_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void mtplx_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }
// The same 16-byte copy, or 16 zero bytes where `real` is false (nothing read: src-size 0).
__device__ __forceinline__ void mtplx_cp_async_or_zero(void* dst, const void* src, bool real) {
    const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(to), "l"(src), "r"(real ? 16 : 0) : "memory");
}
"""


def probe(name: str, error: Callable[[], float], limit: float, fallback: str) -> bool:
    """True when `error()` runs (compiling and launching the kernel) and stays below `limit`;
    otherwise log why and return False, so the caller keeps `fallback`."""
    try:
        measured = error()
    except Exception as exc:  # noqa: BLE001 - any JIT or launch failure means "not here"
        log.warning("%s kernel unavailable, using %s: %s", name, fallback, exc)
        return False
    if not measured < limit:
        log.warning("%s kernel disagrees with %s (error %s); not using it", name, fallback, measured)
        return False
    return True


# A C++ string or character literal, or a comment: what `compact` must tell apart.
_LITERAL_OR_COMMENT = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.S)


def compact(source: str) -> str:
    """CUDA C++ `source` with its comments, indentation, runs of blanks and empty lines taken
    out: the same tokens, each preprocessor directive still on its own line, string literals
    (the inline PTX) as written.

    Why: MLX's CUDA backend hashes a custom kernel's whole source each time it encodes a launch
    (`CustomKernel::eval_gpu`, mlx 0.32), before it finds the compiled module. On an H100's host
    a kernel whose source carried 20 kB more took 3.7-4.2 us more a launch, with CUDA graphs and
    without (bench.launch_cost; docs/benchmarks.md, "A kernel's host cost"); small_m_qmm's
    vector layout is about 19 kB as written, half of it comments and indentation. A step of a
    4-bit Qwen3-4B is host-bound: about 110 of its kernels are that layout's."""
    def drop_comment(match: re.Match[str]) -> str:
        text = match.group()
        if text.startswith("//"):
            return ""
        return " " if text.startswith("/*") else text

    lines = []
    for line in _LITERAL_OR_COMMENT.sub(drop_comment, source).splitlines():
        line = line.strip()
        if line and '"' not in line and "'" not in line:
            line = re.sub(r"[ \t]+", " ", line)
        if line:
            lines.append(line)
    return "\n".join(lines) + "\n"


def cuda_kernel(*, source: str, header: str = "", **kwargs: Any) -> Any:
    """`mx.fast.cuda_kernel` built from `compact(source)` and `compact(header)`; the other
    arguments (name, input_names, output_names, ...) as MLX takes them."""
    import mlx.core as mx

    return mx.fast.cuda_kernel(source=compact(source), header=compact(header) if header else "", **kwargs)
