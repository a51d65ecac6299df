"""A dense qwen3 attention layer's query and key norms and rotary embedding in one CUDA kernel.

Why: mlx-lm's qwen3 Attention runs RMSNorm on the queries, RMSNorm on the keys, then the
rotary embedding on each: four launches a layer for a few kilobytes. Under Nsight Compute on
an H100 a 4-bit Qwen3-4B decode step with the small-M kernel was 800 kernels and 6.16 device
ms, and those four were 144 of the kernels and 0.63 ms (`rms_norm_small` 0.29 ms, `rope_single`
0.34; docs/benchmarks.md, "The 4B's decode steps on the kernel"): a step that small is its
launches, not its bytes. This kernel reads the q and k projections' outputs and writes the
normed, rotated queries and keys in the layout attention takes, in one launch a layer.

Arithmetic: MLX's, step by step. The norm sums the squares of a head's row in float32, takes
rsqrt(mean + eps), rounds x times that to the input type and multiplies by the weight in the
input type (MLX's `rms_norm_small`); the rotation turns each pair (i, i + D/2) by position times
exp2(-i / (D/2) * log2(base)) in float32 and rounds (MLX's `rope_single` / `rope`, not
traditional). The sum of squares runs in another order (a warp butterfly), so a value can round
apart from MLX's in its last bit: the probe and the CUDA tests bound it. Each token's heads are
computed alone, so a verify's row is the decode step's row of the same token, and greedy MTP
and AR agree on the GPU as before.

Where: mlx-lm qwen3 Attention layers (a dense Qwen3; the MTP head's included) whose rope is
MLX's plain `nn.RoPE` over the whole head, on CUDA, once a probe compiled the kernel and matched
MLX's ops. `install` swaps those layers' class for `NormRopeAttention`, whose forward is
mlx-lm's with the one call in place of the four. Elsewhere, and for any shape the kernel does
not take, the same forward runs MLX's ops (`reference`), so the CPU's outputs are mlx-lm's to
the bit.

Opt-in (`MTPLX_QK_NORM_ROPE=1`): on an H100 (2026-12-07, fifth session; docs/benchmarks.md,
"The query and key norms and rope as one kernel") the 4-bit 4B's AR step ran 622 kernels
(800 before it and the shared KV index), the four kernels' 0.63 device ms became 0.35, and
whole steps were level: median 3.91 ms against 4.14 in five pairs of processes (faster in
two, slower in three), depth-3 cycles 12.13 against 12.27. Greedy MTP and AR with it: 3
divergences in 2,000 tokens, each a near-tie.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3

from mtplxd.engine.model import custom_kernels

ENV = "MTPLX_QK_NORM_ROPE"
MAX_HEAD_DIM = 512  # a block's threads hold a head's pairs: D / 2, rounded up to whole warps

# Grid (x: a block per head, query heads then key heads; y: token, batch row-major); a block
# is D / 2 threads rounded up to whole warps, thread i holding the pair (i, i + D / 2) of its
# head's row (the threads past D / 2 add nothing and write nothing).
_SOURCE = r"""
    constexpr int P = D / 2;
    constexpr int WARPS = (P + 31) / 32;
    const int i = threadIdx.x;
    const bool live = i < P;
    const int head = blockIdx.x;
    const int token = blockIdx.y;
    const int batch = token / L;
    const int at = token % L;
    const bool is_q = head < HQ;
    const int h = is_q ? head : head - HQ;
    const T* src = is_q ? q + ((size_t)token * HQ + h) * D : k + ((size_t)token * HK + h) * D;
    const float x1 = live ? static_cast<float>(src[i]) : 0.0f;
    const float x2 = live ? static_cast<float>(src[i + P]) : 0.0f;

    // RMSNorm: the row's sum of squares across the block's warps.
    float squares = x1 * x1 + x2 * x2;
    for (int lane_mask = 16; lane_mask > 0; lane_mask >>= 1) {
      squares += __shfl_xor_sync(0xffffffff, squares, lane_mask);
    }
    __shared__ float warp_sums[WARPS];
    if ((i & 31) == 0) warp_sums[i / 32] = squares;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < WARPS; ++w) total += warp_sums[w];
    const float normalizer = rsqrt(total / D + __int_as_float(EPS));
    if (!live) return;
    const T weight1 = static_cast<T>(is_q ? q_weight[i] : k_weight[i]);
    const T weight2 = static_cast<T>(is_q ? q_weight[i + P] : k_weight[i + P]);
    const float n1 = static_cast<float>(weight1 * static_cast<T>(x1 * normalizer));
    const float n2 = static_cast<float>(weight2 * static_cast<T>(x2 * normalizer));

    // The rotation at this token's position (its batch row's offset plus its index).
    const float position = __int_as_float(SCALE) * static_cast<float>(offset[batch * OFFSET_STRIDE] + at);
    const float theta = position * exp2(-(static_cast<float>(i) / static_cast<float>(P)) * __int_as_float(LOG2_BASE));
    const float c = cos(theta);
    const float s = sin(theta);
    T* dst = is_q ? q_out + (((size_t)batch * HQ + h) * L + at) * D
                  : k_out + (((size_t)batch * HK + h) * L + at) * D;
    dst[i] = static_cast<T>(n1 * c - n2 * s);
    dst[i + P] = static_cast<T>(n1 * s + n2 * c);
"""

_kernel = None
_usable: bool | None = None


def wanted() -> bool:
    """Whether `install` swaps layers without being forced: MTPLX_QK_NORM_ROPE=1 asks."""
    return os.environ.get(ENV, "") == "1"


def installable(attention: nn.Module) -> bool:
    """True for an mlx-lm qwen3 Attention whose norms and rope the kernel computes: MLX's plain
    `nn.RoPE` (not traditional) over the whole head, both norms with one eps, an even head of
    at most MAX_HEAD_DIM."""
    if not isinstance(attention, qwen3.Attention):
        return False
    rope, head_dim = attention.rope, attention.q_norm.weight.shape[0]
    return (type(rope) is nn.RoPE and not rope.traditional and rope.dims == head_dim
            and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM
            and attention.k_norm.weight.shape[0] == head_dim
            and attention.q_norm.eps == attention.k_norm.eps)


class NormRopeAttention(qwen3.Attention):
    """mlx-lm's qwen3 Attention, its query and key norms and rope in one call (`norm_rope`)."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries, keys = norm_rope(self, queries, keys, 0 if cache is None else cache.offset)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        # Looked up on the module at each call: fused.route_static_cache_attention replaces it.
        output = qwen3.scaled_dot_product_attention(queries, keys, values, cache=cache,
                                                    scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


def install(model: nn.Module, *, force: bool = False) -> int:
    """Swap every installable attention layer of `model` (MTP head included) to
    NormRopeAttention where the kernel is usable and wanted (or `force`: the benches and
    tests); returns how many layers."""
    if not (force or wanted()) or not usable():
        return 0
    swapped = 0
    for _, module in model.named_modules():
        if type(module) is qwen3.Attention and installable(module):
            module.__class__ = NormRopeAttention
            swapped += 1
    return swapped


def norm_rope(attention: nn.Module, queries: mx.array, keys: mx.array,
              offset: int | mx.array) -> tuple[mx.array, mx.array]:
    """The q and k projections' outputs (B, L, heads x D) normed and rotated at `offset` (an
    int, a scalar array or one per batch row): queries (B, HQ, L, D) and keys (B, HK, L, D),
    by the kernel where it runs, else by MLX's ops (`reference`)."""
    if usable() and supported(attention, queries, offset):
        return qk_norm_rope(attention, queries, keys, offset)
    return reference(attention, queries, keys, offset)


def reference(attention: nn.Module, queries: mx.array, keys: mx.array,
              offset: int | mx.array) -> tuple[mx.array, mx.array]:
    """mlx-lm's qwen3 sequence in MLX's ops: each norm, the transpose, then the rope."""
    B, L, _ = queries.shape
    q = attention.q_norm(queries.reshape(B, L, attention.n_heads, -1)).transpose(0, 2, 1, 3)
    k = attention.k_norm(keys.reshape(B, L, attention.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    return attention.rope(q, offset=offset), attention.rope(k, offset=offset)


def supported(attention: nn.Module, queries: mx.array, offset: int | mx.array) -> bool:
    """Shapes the kernel takes: 16-bit or float32 inputs and an offset that is an int, a scalar
    or one per batch row (a cohort's RowsKVCache)."""
    if queries.dtype not in (mx.bfloat16, mx.float16, mx.float32) or not installable(attention):
        return False
    return isinstance(offset, int) or offset.size in (1, queries.shape[0])


def qk_norm_rope(attention: nn.Module, queries: mx.array, keys: mx.array,
                 offset: int | mx.array) -> tuple[mx.array, mx.array]:
    """The kernel (CUDA only; see `usable`)."""
    global _kernel
    if _kernel is None:
        _kernel = custom_kernels.cuda_kernel(
            name="mtplx_qk_norm_rope",
            input_names=["q", "k", "q_weight", "k_weight", "offset"],
            output_names=["q_out", "k_out"], source=_SOURCE)
    B, L, _ = queries.shape
    D, HQ, HK = attention.q_norm.weight.shape[0], attention.n_heads, attention.n_kv_heads
    if isinstance(offset, int):
        offset = mx.array(offset, dtype=mx.int32)
    rope = attention.rope
    threads = -(-D // 64) * 32  # D / 2 pairs in whole warps
    return tuple(_kernel(
        inputs=[queries, keys, attention.q_norm.weight, attention.k_norm.weight, offset.astype(mx.int32)],
        template=[("T", queries.dtype), ("D", D), ("HQ", HQ), ("HK", HK), ("L", L),
                  ("OFFSET_STRIDE", int(offset.size > 1)),
                  # eps, log2(base) (as MLX's rope takes its base) and the position scale, as
                  # float32 bits: one compile a model, no constant array a call
                  ("EPS", _float_bits(attention.q_norm.eps)), ("LOG2_BASE", _float_bits(math.log2(rope.base))),
                  ("SCALE", _float_bits(rope.scale))],
        grid=((HQ + HK) * threads, B * L, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(B, HQ, L, D), (B, HK, L, D)], output_dtypes=[queries.dtype] * 2))


def _float_bits(value: float) -> int:
    """`value` rounded to float32, its bits as a signed 32-bit int (a kernel template's int;
    the kernel reads it back with __int_as_float)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def usable() -> bool:
    """True on CUDA once the kernel has compiled and matched MLX's ops on a probe (checked once
    a process; any failure is logged and leaves MLX's ops)."""
    global _usable
    if _usable is None:
        from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

        _usable = fixed_shapes_wanted() and custom_kernels.probe(
            "q/k norm and rope", probe_error, 1.0, "MLX's rms_norm and rope")
    return _usable


def path_name(layers: int) -> str:
    """What /health and status say (`kernels.qk_norm_rope`): the kernel on `layers` layers, or
    MLX's ops."""
    if layers:
        return f"one kernel a layer ({layers} layers, {ENV}=1)"
    return "MLX's rms_norm and rope"


# What the probe tolerates: a difference of 1/64 of the largest output (a bf16 output's last
# bit is 1/128 to 1/256 of its value; the norm's sum in another order moves at most that).
TOLERANCE = 1 / 64


def probe_attention(head_dim: int = 128, heads: int = 4, kv_heads: int = 2,
                    base: float = 1_000_000.0) -> qwen3.Attention:
    """A qwen3 Attention with random norm weights, for the probe and the tests."""
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=heads * head_dim, num_hidden_layers=1,
                           intermediate_size=64, num_attention_heads=heads, rms_norm_eps=1e-6,
                           vocab_size=32, num_key_value_heads=kv_heads, max_position_embeddings=40960,
                           head_dim=head_dim, tie_word_embeddings=True, rope_theta=base)
    attention = qwen3.Attention(args)
    attention.q_norm.weight = 1 + 0.1 * mx.random.normal((head_dim,), key=mx.random.key(3))
    attention.k_norm.weight = 1 + 0.1 * mx.random.normal((head_dim,), key=mx.random.key(4))
    return attention


def kernel_error(attention: nn.Module, batch: int, tokens: int, offset: int | mx.array,
                 dtype: mx.Dtype = mx.bfloat16) -> float:
    """The kernel against `reference` on random projections: the largest difference over the
    largest output, as a multiple of TOLERANCE (below 1 passes)."""
    attention.set_dtype(dtype)
    D = attention.q_norm.weight.shape[0]
    queries = mx.random.normal((batch, tokens, attention.n_heads * D), key=mx.random.key(5)).astype(dtype)
    keys = 3 * mx.random.normal((batch, tokens, attention.n_kv_heads * D), key=mx.random.key(6)).astype(dtype)
    error = 0.0
    for got, want in zip(qk_norm_rope(attention, queries, keys, offset),
                         reference(attention, queries, keys, offset)):
        if got.shape != want.shape:
            return math.inf
        got, want = got.astype(mx.float32), want.astype(mx.float32)
        error = max(error, (mx.max(mx.abs(got - want)) / mx.max(mx.abs(want))).item())
    return error / TOLERANCE


def probe_error() -> float:
    """The worst `kernel_error` of a decode step at a scalar offset and a two-row verify at
    per-row offsets."""
    attention = probe_attention()
    return max(kernel_error(attention, 1, 1, mx.array(517, dtype=mx.int32)),
               kernel_error(attention, 2, 3, mx.array([40, 9], dtype=mx.int32)))
