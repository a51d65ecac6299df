"""The small-M quantized matmul kernel against mx.quantized_matmul, and its error, per shape.

    python -m mtplxd.engine.bench.small_m OUT.json [--sizes qwen3-4b,qwen3-32b,hybrid-27b,embedded]
        [--rows 1,2,3,4,5,6]
        [--bits 4,8] [--repeats 20] [--shipped-only] [--mma-variants]

For every weight matrix of a Qwen3-4B, a Qwen3-32B and a hybrid 27B layer (and the lm_head),
4- and 8-bit (groups of 64), and M = 1..6 input rows (bf16): microseconds per call of
mx.quantized_matmul and of the kernel (a batch of calls evaluated together, after warm-up, so
launch plus run time), the weight bytes each call reads over that time (GB/s, and the
fraction of the 4.3 TB/s roofline), and each one's error against the float32 truth
(mx.quantized_matmul of float32 inputs). `kernel_over_mlx` below 1 means the kernel is
faster; `kernel_us_by_rows_per_warp` times the kernel built with 1, 2 and 4 output columns
per warp (the shipped setting is ROWS_PER_WARP). The `vector_*` fields time the kernel's
bandwidth layout (16-byte loads, warps splitting K: small_m_qmm._SOURCE_VECTOR) the same way,
`vector_us_by_columns` at 4, 8 and 16 output columns per block (`--shipped-only`: only the
shipped widths, a shorter run). `kernel_convert_us` and `vector_convert_us` time both layouts
with the int-to-float conversion per weight value that the and-or unpack replaced (same
outputs; small_m_qmm._HEADER says why). `vector_us_by_form` times the vector layout's forms
with fewer instructions a weight side by side (small_m_qmm.VECTOR_IN_PLACE, VECTOR_BIAS_ONCE):
`masked` (the and-or unpack), `in_place` (`in_place_equals_masked`: bit for bit, as it must)
and `bias_once` (in place, a group's bias once a 16-byte vector; its error against the truth
`bias_once_error`; `in_place` is served); `mma_us_by_hoist` the mma layout with its unpack's
constants made before each use (False) and kept in registers (True, as served: small_m_qmm.MMA_HOIST;
`hoisted_equals_plain`: bit for bit, as it must). At one row, `vector_us_by_unroll` times the vector
layout with 1, 2 and 4 vectors of each weight row loaded per thread before use (in a block of
that many times fewer threads), and `vector_unroll_error` is their worst error. The `mma_*`
fields time the tensor-core layout (small_m_qmm._SOURCE_MMA: short verify blocks of large
matrices); with `--mma-variants`, `mma_us_by_warps` with 4, 8 and 16 warps a block splitting K,
and at 1 and 6 rows `mma_us_by_groups_per_load` with 2, 4 and 8 groups a lane loads before
using any, and `mma_us_by_config` the plain and pipelined forms at MMA_CONFIGS (the stages
each ran in `mma_stages_by_config`; `mma_pipelined_equals_plain`: bit for bit, as it must). From 2 rows, `mma_rows_equal_one_row` (and `mlx_`, `vector_`, `word_`) say whether each
row of the product equals that row's 1-row product bit for bit (row invariance:
small_m_qmm's module docstring; the other layouts compile another instance per row count). Off CUDA the
kernel columns are null (the kernel is CUDA only) and the plain-ops reference's error is
reported instead, so the script runs anywhere.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx

from mtplxd.engine.bench.harness import bench_parser, command_line, machine, median_ms, write_report
from mtplxd.engine.model import small_m_qmm

PROG = "python -m mtplxd.engine.bench.small_m"
BANDWIDTH_BYTES_PER_S = 4.3e12

# (name, N out, K in) of each matrix a decode step reads, per layer, and the lm_head.
SHAPES: dict[str, list[tuple[str, int, int]]] = {
    "qwen3-4b": [("q_proj", 4096, 2560), ("k_proj", 1024, 2560), ("o_proj", 2560, 4096),
                 ("gate_proj", 9728, 2560), ("down_proj", 2560, 9728), ("lm_head", 151936, 2560)],
    "qwen3-32b": [("q_proj", 8192, 5120), ("k_proj", 1024, 5120), ("o_proj", 5120, 8192),
                  ("gate_proj", 25600, 5120), ("down_proj", 5120, 25600), ("lm_head", 151936, 5120)],
    # The hybrid 27B's (bench.real_size's hybrid-27b): a Gated DeltaNet layer's in_proj_qkv,
    # in_proj_z, in_proj_b (in_proj_a's shape too) and out_proj, a gated attention layer's
    # q_proj (queries and gate) and k_proj, the MLP's, and the 248k-row lm_head.
    "hybrid-27b": [("in_proj_qkv", 10240, 5120), ("in_proj_z", 6144, 5120), ("in_proj_b", 48, 5120),
                   ("out_proj", 5120, 6144), ("q_proj", 12288, 5120), ("k_proj", 1024, 5120),
                   ("gate_proj", 17408, 5120), ("down_proj", 5120, 17408), ("lm_head", 248320, 5120)],
    # The embedded model's (hidden 256): its verify shapes are launch-bound, so what counts is
    # which kernel a row count gets (MLX switches from its matvec to a tiled qmm at 8 rows).
    "embedded": [("q_proj", 256, 256), ("k_proj", 128, 256), ("gate_proj", 640, 256),
                 ("down_proj", 256, 640), ("lm_head", 8192, 256)],
    "tiny": [("proj", 192, 128), ("lm_head", 512, 128)],
}
CALLS = 16  # calls evaluated together per timed sample
OTHER_ROWS_PER_WARP = (1, 2)  # variants of the kernel's output columns per warp, timed too
VECTOR_COLUMNS = (8, 4, 16)  # output columns per block of the vector layout, timed (the shipped one first)
UNROLLS = (2, 4)  # 16-byte vectors a thread loads before using them, timed at one row (shipped: 1)
# The vector layout's forms by (in_place, bias_once): small_m_qmm.VECTOR_IN_PLACE's comment.
VECTOR_FORMS = {"masked": (False, False), "in_place": (True, False), "bias_once": (True, True)}
MMA_WARPS = (8, 4, 16)  # warps a block of the mma layout, timed (the default first)
MMA_LOADS = (2, 4, 8)  # groups a lane of the mma layout loads before using any, timed at 1 and 6 rows
# Warps x groups a load [s stages of shared memory] of the mma layout, plain and pipelined,
# timed at 1 and 6 rows (the shipped shape first; a pipelined one runs the most stages that fit).
MMA_CONFIGS = "8x4,8x4s2,8x2s3,4x4,4x4s4,4x2s4"


def parse_mma_configs(text: str) -> tuple[tuple[int, int, int], ...]:
    """"4x4,8x4s2" as ((4, 4, 0), (8, 4, 2)): warps x groups a load, then s and the stages."""
    configs = []
    for item in filter(None, text.split(",")):
        shape, _, stages = item.partition("s")
        warps, groups = shape.split("x")
        configs.append((int(warps), int(groups), int(stages or 0)))
    return tuple(configs)


def mma_config_name(warps: int, groups: int, stages: int) -> str:
    """The report's key of an mma config: what `--mma-configs` takes."""
    return f"{warps}x{groups}" + (f"s{stages}" if stages else "")


def _per_call_us(fn, x, repeats: int) -> float:
    return median_ms(lambda: mx.eval([fn(x) for _ in range(CALLS)]), repeats) / CALLS * 1000


def _rows_equal_one_row(product, x: mx.array) -> bool:
    """Whether every row of product(x) equals, bit for bit, product of that row alone (what a
    verify row needs to round as the decode step of the same row)."""
    together = product(x)
    return all(mx.array_equal(together[i:i + 1], product(x[i:i + 1])).item() for i in range(x.shape[0]))


def _mma_configs_timed(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int,
                       repeats: int) -> dict[str, Any]:
    """The mma layout at each of MMA_CONFIGS: microseconds a call, the stages each pipelined
    one ran (0 where it did not fit: the plain layout), and whether every pipelined output
    equals the plain layout's at the same warps and groups bit for bit (it should)."""
    us, stages_run, equal = {}, {}, True
    for warps, loads, stages in parse_mma_configs(MMA_CONFIGS):
        def product(x, warps=warps, loads=loads, stages=stages):
            return small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="mma", warps=warps,
                                              unroll=loads, stages=stages)
        name = mma_config_name(warps, loads, stages)
        us[name] = _per_call_us(product, x, repeats)
        stages_run[name] = small_m_qmm.pipelined_stages(bits, warps, loads, x.shape[-1] // small_m_qmm.GROUP_SIZE, stages)
        if stages:
            equal = equal and mx.array_equal(product(x), product(x, stages=0)).item()
    return {"mma_us_by_config": us, "mma_stages_by_config": stages_run, "mma_pipelined_equals_plain": equal}


def measure_shape(N: int, K: int, bits: int, rows: list[int], repeats: int,
                  shipped_only: bool = False, mma_variants: bool = False) -> list[dict[str, Any]]:
    """One weight matrix at every row count: times, bandwidth and errors."""
    weight = (mx.random.normal((N, K), key=mx.random.key(N + K)) * 0.02).astype(mx.bfloat16)
    w, scales, biases = mx.quantize(weight, group_size=small_m_qmm.GROUP_SIZE, bits=bits)
    del weight
    mx.eval(w, scales, biases)
    read = w.nbytes + scales.nbytes + biases.nbytes
    on_cuda = small_m_qmm.usable()
    out = []
    for M in rows:
        x = mx.random.normal((M, K), key=mx.random.key(M)).astype(mx.bfloat16)
        mx.eval(x)

        def stock(x):
            return mx.quantized_matmul(x, w, scales, biases, transpose=True,
                                       group_size=small_m_qmm.GROUP_SIZE, bits=bits)

        def kernel(x, per_warp=small_m_qmm.ROWS_PER_WARP, layout="word", convert=False, unroll=1,
                   in_place=None, bias_once=None):
            return small_m_qmm.small_m_matmul(x, w, scales, biases, bits, per_warp, layout, convert, unroll,
                                              in_place=in_place, bias_once=bias_once)

        truth = mx.quantized_matmul(x.astype(mx.float32), w, scales.astype(mx.float32),
                                    biases.astype(mx.float32), transpose=True,
                                    group_size=small_m_qmm.GROUP_SIZE, bits=bits)
        mlx_us = _per_call_us(stock, x, repeats)
        row: dict[str, Any] = {"N": N, "K": K, "bits": bits, "M": M, "weight_bytes": read,
                               "mlx_us": mlx_us, "mlx_of_roofline": read / BANDWIDTH_BYTES_PER_S * 1e6 / mlx_us,
                               "mlx_error": small_m_qmm.relative_error(stock(x), truth),
                               "kernel_us": None, "kernel_over_mlx": None, "kernel_error": None,
                               "vector_us": None, "vector_over_mlx": None, "vector_error": None,
                               "mma_us": None, "mma_over_mlx": None, "mma_error": None}
        if on_cuda:
            # The shipped output columns per warp, then the others the kernel can be built with.
            per_warps = ((small_m_qmm.ROWS_PER_WARP,) if shipped_only
                         else (small_m_qmm.ROWS_PER_WARP, *OTHER_ROWS_PER_WARP))
            by_per_warp = {per_warp: _per_call_us(lambda x, p=per_warp: kernel(x, p), x, repeats)
                           for per_warp in per_warps}
            kernel_us = by_per_warp[small_m_qmm.ROWS_PER_WARP]
            row.update(kernel_us=kernel_us, kernel_over_mlx=kernel_us / mlx_us,
                       kernel_us_by_rows_per_warp=by_per_warp,
                       kernel_of_roofline=read / BANDWIDTH_BYTES_PER_S * 1e6 / kernel_us,
                       kernel_error=small_m_qmm.relative_error(kernel(x), truth))
            # The vector layout: a block per VECTOR_ROWS columns (and the other widths it takes).
            by_columns = {columns: _per_call_us(lambda x, c=columns: kernel(x, c, "vector"), x, repeats)
                          for columns in (VECTOR_COLUMNS[:1] if shipped_only else VECTOR_COLUMNS)}
            vector_us = by_columns[small_m_qmm.VECTOR_ROWS]
            row.update(vector_us=vector_us, vector_over_mlx=vector_us / mlx_us,
                       vector_us_by_columns=by_columns,
                       vector_of_roofline=read / BANDWIDTH_BYTES_PER_S * 1e6 / vector_us,
                       vector_error=small_m_qmm.relative_error(
                           kernel(x, small_m_qmm.VECTOR_ROWS, "vector"), truth))
            # Both layouts with the conversion per value, side by side with the unpack.
            kernel_convert_us = _per_call_us(lambda x: kernel(x, convert=True), x, repeats)
            vector_convert_us = _per_call_us(
                lambda x: kernel(x, small_m_qmm.VECTOR_ROWS, "vector", True), x, repeats)
            same = mx.array_equal(kernel(x, small_m_qmm.VECTOR_ROWS, "vector", True),
                                  kernel(x, small_m_qmm.VECTOR_ROWS, "vector")).item()
            row.update(kernel_convert_us=kernel_convert_us, vector_convert_us=vector_convert_us,
                       vector_unpack_over_convert=vector_us / vector_convert_us,
                       kernel_unpack_over_convert=kernel_us / kernel_convert_us,
                       unpack_equals_convert=bool(same))
            # The vector layout's forms with fewer instructions, side by side.
            def vector_form(x, form):
                in_place, bias_once = VECTOR_FORMS[form]
                return kernel(x, small_m_qmm.VECTOR_ROWS, "vector", in_place=in_place, bias_once=bias_once)

            by_form = {form: _per_call_us(lambda x, f=form: vector_form(x, f), x, repeats) for form in VECTOR_FORMS}
            row.update(vector_us_by_form=by_form,
                       in_place_equals_masked=bool(mx.array_equal(vector_form(x, "in_place"),
                                                                  vector_form(x, "masked")).item()),
                       bias_once_error=small_m_qmm.relative_error(vector_form(x, "bias_once"), truth))
            # The tensor-core layout, at its default and other block widths.
            def mma(x, warps=small_m_qmm.MMA_WARPS):
                return small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="mma", warps=warps)

            by_warps = {warps: _per_call_us(lambda x, k=warps: mma(x, k), x, repeats)
                        for warps in (MMA_WARPS if mma_variants else MMA_WARPS[:1])}
            mma_us = by_warps[small_m_qmm.MMA_WARPS]
            row.update(mma_us=mma_us, mma_over_mlx=mma_us / mlx_us, mma_us_by_warps=by_warps,
                       mma_of_roofline=read / BANDWIDTH_BYTES_PER_S * 1e6 / mma_us,
                       mma_error=small_m_qmm.relative_error(mma(x), truth))
            # Its unpack's constants made per use (as served) and kept in registers, side by side.
            def mma_hoisted(x, hoist):
                return small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="mma", hoist=hoist)

            row.update(mma_us_by_hoist={h: _per_call_us(lambda x, h=h: mma_hoisted(x, h), x, repeats)
                                        for h in (False, True)},
                       hoisted_equals_plain=bool(mx.array_equal(mma_hoisted(x, True), mma_hoisted(x, False)).item()))
            if M > 1:  # row invariance: each row of the M-row product, bit for bit its 1-row product
                row.update(mma_rows_equal_one_row=_rows_equal_one_row(mma, x),
                           mlx_rows_equal_one_row=_rows_equal_one_row(stock, x),
                           vector_rows_equal_one_row=_rows_equal_one_row(
                               lambda x: kernel(x, small_m_qmm.VECTOR_ROWS, "vector"), x),
                           word_rows_equal_one_row=_rows_equal_one_row(kernel, x))
            if M in (1, 6) and mma_variants:  # bytes in flight against registers
                row["mma_us_by_groups_per_load"] = {
                    loads: _per_call_us(lambda x, u=loads: small_m_qmm.small_m_matmul(
                        x, w, scales, biases, bits, layout="mma", unroll=u), x, repeats) for loads in MMA_LOADS}
                row.update(_mma_configs_timed(x, w, scales, biases, bits, repeats))
            if M == 1:  # decode rows: more vectors in flight per thread, fewer threads
                by_unroll = {u: _per_call_us(lambda x, u=u: kernel(x, small_m_qmm.VECTOR_ROWS, "vector", unroll=u),
                                             x, repeats) for u in UNROLLS}
                row.update(vector_us_by_unroll={1: vector_us, **by_unroll},
                           vector_unroll_error=max(small_m_qmm.relative_error(
                               kernel(x, small_m_qmm.VECTOR_ROWS, "vector", unroll=u), truth) for u in UNROLLS))
        else:
            row["reference_error"] = small_m_qmm.relative_error(
                small_m_qmm.reference(x, w, scales, biases, bits), truth)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("out")
    parser.add_argument("--sizes", default="qwen3-4b,qwen3-32b")
    parser.add_argument("--rows", default="1,2,3,4,5,6")
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shipped-only", action="store_true",
                        help="time only the shipped columns per warp and per block")
    parser.add_argument("--mma-variants", action="store_true",
                        help="time the mma layout at 4, 8 and 16 warps a block and, at 1 and 6 rows, "
                             "at 2, 4 and 8 groups loaded before use")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    results: list[dict[str, Any]] = []
    report = {"kernel_usable": small_m_qmm.usable(), "results": results, **machine(),
              "command": command_line(PROG, argv)}
    for size in args.sizes.split(","):
        for name, N, K in SHAPES[size]:
            for bits in (int(b) for b in args.bits.split(",")):
                for row in measure_shape(N, K, bits, rows, args.repeats, args.shipped_only, args.mma_variants):
                    row.update(size=size, matrix=name)
                    results.append(row)
                    kernel = (f"kernel {row['kernel_us']:8.1f} us ({row['kernel_over_mlx']:.2f}x, "
                              f"err {row['kernel_error']:.1e}) vector {row['vector_us']:8.1f} us "
                              f"({row['vector_over_mlx']:.2f}x, {row['vector_of_roofline']:.0%} of roofline, "
                              f"err {row['vector_error']:.1e}; with conversions {row['vector_convert_us']:.1f} us, "
                              "forms " + " ".join(f"{f} {us:.1f}" for f, us in row["vector_us_by_form"].items())
                              + f" us, in place same bits {row['in_place_equals_masked']}) "
                              f"mma {row['mma_us']:8.1f} us ({row['mma_over_mlx']:.2f}x, "
                              f"{row['mma_of_roofline']:.0%} of roofline, err {row['mma_error']:.1e}; hoisted "
                              f"{row['mma_us_by_hoist'][True]:.1f} us against {row['mma_us_by_hoist'][False]:.1f}, "
                              f"same bits {row['hoisted_equals_plain']})"
                              if row["kernel_us"] is not None else "kernel n/a")
                    print(f"{size:10s} {name:9s} q{bits} M={row['M']}: mlx {row['mlx_us']:8.1f} us "
                          f"({row['mlx_of_roofline']:.0%} of roofline) {kernel}", flush=True)
                write_report(args.out, report, indent=1)  # as it goes: a cut-short run keeps its rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
