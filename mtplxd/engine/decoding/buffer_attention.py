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

The split form (`MTPLX_BUFFER_ATTENTION_SPLIT=1`, opt-in until a GPU has timed it): one
block per query row walks all of that row's keys, 32 warps each taking every 32nd slot one
after the other, so its time grows with the context and only heads x rows blocks run (64 on
Qwen3-32B's decode step: half an H100's SMs; 31 us a layer over 512 keys under Nsight, twice
cuDNN's). Split, the keys are cut into SPLIT_SLOTS-slot chunks, a block per chunk computes
that chunk's part exactly as the one-pass kernel computes its whole (`_SPLIT_SOURCE`), and a
second kernel merges the parts in chunk order (`_MERGE_SOURCE`). The chunks are fixed by the
slot index, not by the rows in the call, so a verify row still rounds as the compiled AR
step of the same position; with no more than SPLIT_SLOTS keys visible there is one part and
the merge gives the one-pass kernel's bits (multiplying by exp2(0) = 1 and adding zeros).
"""

from __future__ import annotations

import math
import os
from typing import Callable

import mlx.core as mx

from mtplxd.engine.model import custom_kernels
from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

_HEADER = "#include <cooperative_groups/reduce.h>\n"

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

# The split form's first pass: the one-pass kernel above (its source, edited) over the key
# slots of one chunk (blockIdx.z) only, stopping before the normalisation: each block writes
# its chunk's running maximum, its sum of weights and its unnormalised output (float32) to
# part_max, part_sum and part_acc, (heads, rows, chunks[, D]). A chunk past the row's limit writes the parts of no
# keys (max finite_min, sum and output 0), which the merge weighs by exp2(-huge) = 0.
_SPLIT_SOURCE = _edited(
    _SOURCE,
    ("const int row = blockIdx.y;", "const int row = blockIdx.y;\n    const int chunk = blockIdx.z;"),
    ("const int limit = min(offset[0] + row + 1, slots);  // slots this row may see",
     "const int limit = min(offset[0] + row + 1, slots);  // slots this row may see\n"
     "    const int begin = chunk * CHUNK;\n"
     "    const int end = min(begin + CHUNK, limit);  // this chunk's share of them\n"
     "    const size_t part = ((size_t)head * rows + row) * gridDim.z + chunk;"),
    ("keys + ((size_t)kv_head * slots + w)", "keys + ((size_t)kv_head * slots + begin + w)"),
    ("values + ((size_t)kv_head * slots + w)", "values + ((size_t)kv_head * slots + begin + w)"),
    ("for (int slot = w; slot < limit; slot += WARPS)", "for (int slot = begin + w; slot < end; slot += WARPS)"),
    ("    total = total == 0 ? 0 : __frcp_rn(total);\n", ""),
    ("cg::reduce(warp, exchange[w][lane] * rescale, cg::plus<float>()) * total;",
     "cg::reduce(warp, exchange[w][lane] * rescale, cg::plus<float>());"),
    ("""        T* out_row = out + ((size_t)head * rows + row) * D + w * E;
        for (int e = 0; e < E; ++e) out_row[e] = static_cast<T>(acc[e]);""",
     """        float* acc_out = part_acc + part * D + w * E;
        for (int e = 0; e < E; ++e) acc_out[e] = acc[e];
        if (w == 0) {
            part_max[part] = top;
            part_sum[part] = total;
        }"""))

# The split form's merge: a block per (head, row), a thread per output element, the chunks'
# parts added in chunk order, each weighed by exp2(its maximum - the largest), then one
# reciprocal of the weights' sum, as the one-pass kernel ends.
_MERGE_SOURCE = r"""
    const int rows = part_max_shape[1];
    const int chunks = part_max_shape[2];
    const int head = blockIdx.x;
    const int row = blockIdx.y;
    const int d = threadIdx.x;
    const size_t base = ((size_t)head * rows + row) * chunks;
    float top = Limits<float>::finite_min();
    for (int c = 0; c < chunks; ++c) top = max(top, part_max[base + c]);
    float sum = 0.f, acc = 0.f;
    for (int c = 0; c < chunks; ++c) {
        const float weight = exp2f(part_max[base + c] - top);
        sum += part_sum[base + c] * weight;
        acc += part_acc[(base + c) * D + d] * weight;
    }
    sum = sum == 0 ? 0 : __frcp_rn(sum);
    out[((size_t)head * rows + row) * D + d] = static_cast<T>(acc * sum);
"""

# Key slots a block of the split form takes. 256: below that MLX's own decode steps run its
# one-pass kernel (from 256 cached keys it hands them to cuDNN), and the split form gives
# that kernel's bits wherever a row sees no more than one chunk.
SPLIT_SLOTS = 256
SPLIT_ENV = "MTPLX_BUFFER_ATTENTION_SPLIT"

_kernel = None
_rows_kernel = None
_split_kernels: tuple | None = None
_usable: bool | None = None
_rows_usable: bool | None = None
_split_usable: bool | None = None


def _buffer_kernel():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mtplx_buffer_attention", input_names=["queries", "keys", "values", "offset", "scale"],
            output_names=["out"], source=_SOURCE, header=_HEADER)
    return _kernel


def buffer_attention(queries: mx.array, keys: mx.array, values: mx.array, offset: mx.array,
                     scale: float) -> mx.array:
    """softmax(q k^T * scale) v with query row i seeing key slots 0..offset+i.

    queries (1, Hq, L, D); keys and values (1, Hkv, S, D) buffers; `offset` an int scalar
    array (the cache position of query row 0). CUDA only: see `usable`.
    """
    if keys.shape[2] > SPLIT_SLOTS and split_wanted() and split_usable():
        return split_buffer_attention(queries, keys, values, offset, scale)
    _, heads, rows, dim = queries.shape
    return _buffer_kernel()(
        inputs=[queries, keys, values, offset.astype(mx.int32).reshape(1),
                mx.array([scale], mx.float32)],
        template=[("T", queries.dtype), ("D", dim)],
        grid=(heads * 1024, rows, 1), threadgroup=(1024, 1, 1),
        output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]


def _split_buffer_kernels():
    global _split_kernels
    if _split_kernels is None:
        _split_kernels = (
            mx.fast.cuda_kernel(name="mtplx_buffer_attention_split",
                                input_names=["queries", "keys", "values", "offset", "scale"],
                                output_names=["part_max", "part_sum", "part_acc"],
                                source=_SPLIT_SOURCE, header=_HEADER),
            mx.fast.cuda_kernel(name="mtplx_buffer_attention_merge",
                                input_names=["part_max", "part_sum", "part_acc"],
                                output_names=["out"], source=_MERGE_SOURCE, header=_HEADER))
    return _split_kernels


def split_buffer_attention(queries: mx.array, keys: mx.array, values: mx.array, offset: mx.array,
                           scale: float) -> mx.array:
    """`buffer_attention` in the split form (the module docstring): a block per SPLIT_SLOTS
    key slots of each query row, then a merge in chunk order. CUDA only: see `split_usable`."""
    _, heads, rows, dim = queries.shape
    chunks = -(-keys.shape[2] // SPLIT_SLOTS)
    split, merge = _split_buffer_kernels()
    parts = split(
        inputs=[queries, keys, values, offset.astype(mx.int32).reshape(1), mx.array([scale], mx.float32)],
        template=[("T", queries.dtype), ("D", dim), ("CHUNK", SPLIT_SLOTS)],
        grid=(heads * 1024, rows, chunks), threadgroup=(1024, 1, 1),
        output_shapes=[(heads, rows, chunks), (heads, rows, chunks), (heads, rows, chunks, dim)],
        output_dtypes=[mx.float32] * 3)
    return merge(inputs=parts, template=[("T", queries.dtype), ("D", dim)],
                 grid=(heads * dim, rows, 1), threadgroup=(dim, 1, 1),
                 output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]


def split_wanted() -> bool:
    """Whether the split form is asked for (SPLIT_ENV "1"; off by default until measured)."""
    return os.environ.get(SPLIT_ENV, "") == "1"


def _rows_buffer_kernel():
    global _rows_kernel
    if _rows_kernel is None:
        _rows_kernel = mx.fast.cuda_kernel(
            name="mtplx_rows_buffer_attention",
            input_names=["queries", "keys", "values", "offset", "scale"],
            output_names=["out"], source=_ROWS_SOURCE, header=_HEADER)
    return _rows_kernel


def rows_buffer_attention(queries: mx.array, keys: mx.array, values: mx.array,
                          offsets: mx.array, scale: float) -> mx.array:
    """`buffer_attention` for W rows: queries (W, Hq, L, D), buffers (W, Hkv, S, D), row w's
    query i seeing key slots 0..offsets[w]+i. CUDA only: see `rows_usable`."""
    batch, heads, rows, dim = queries.shape
    return _rows_buffer_kernel()(
        inputs=[queries, keys, values, offsets.astype(mx.int32), mx.array([scale], mx.float32)],
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
    """True on CUDA once the kernel has compiled and matched mx.fast's attention on a probe.

    Checked once per process; any failure (no CUDA, a JIT error) leaves the caller on
    mx.fast.scaled_dot_product_attention, and is logged.
    """
    global _usable
    if _usable is None:
        _usable = fixed_shapes_wanted() and _probe()
    return _usable


def split_usable() -> bool:
    """`usable` for the split form: on CUDA once both of its kernels compiled and matched
    mx.fast's masked attention on a probe whose rows see several chunks (checked once per
    process, before any graph is traced: `fused.route_static_cache_attention`)."""
    global _split_usable
    if _split_usable is None:
        _split_usable = fixed_shapes_wanted() and custom_kernels.probe(
            "split buffer attention", _split_probe_error, 0.05, "the one-pass buffer kernel")
    return _split_usable


def path_name() -> str:
    """What /health and status say about the fused loops' attention (`cache_attention`)."""
    if not usable():
        return "mlx scaled_dot_product_attention"
    if split_wanted() and split_usable():
        return f"buffer CUDA kernel, split into {SPLIT_SLOTS}-slot chunks"
    return "buffer CUDA kernel"


def rows_usable() -> bool:
    """`usable` for the W-row kernel: on CUDA once it compiled and matched mx.fast's masked
    attention on a probe of rows at different offsets (checked once per process)."""
    global _rows_usable
    if _rows_usable is None:
        _rows_usable = fixed_shapes_wanted() and custom_kernels.probe(
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
    return _masked_error(lambda q, k, v, at, scale: buffer_attention(q, k, v, at[0], scale), [20], 40)


def _split_probe_error() -> float:  # its rows see two chunks; a third lies past them
    return _masked_error(lambda q, k, v, at, scale: split_buffer_attention(q, k, v, at[0], scale),
                         [SPLIT_SLOTS + 100], 2 * SPLIT_SLOTS + 40)


def _probe() -> bool:
    return custom_kernels.probe("buffer attention", _probe_error, 0.05, "mx.fast attention")
