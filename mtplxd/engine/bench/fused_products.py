"""Products that read the same input, one at a time against stacked into one matrix.

    python -m mtplxd.engine.bench.fused_products OUT.json [--sizes hybrid-27b,qwen3-32b]
        [--rows 1,4] [--bits 4,8] [--repeats 20]

Why: on an H100 the hybrid 27B's 4-bit decode step was its quantized products, most of them
small matrices the tensor-core layout reads at 18-32% of the roofline (a 48-row in_proj_b
takes 15 us, pure latency) while the 248k-row lm_head reaches 59% (docs/benchmarks.md, "Whole
steps on an H100"). The products of one layer that share an input can be one wide product:
a Gated DeltaNet layer's in_proj_qkv, z, b and a; an MLP's gate_proj and up_proj; attention's
q, k and v projections. This bench measures what stacking them buys before the engine does it.

For each group of one size, bit width (affine, groups of 64) and row count (bf16 inputs):
microseconds per call of the parts one after the other (`separate_us`, all of them evaluated
together) and of one product of the parts stacked along the output dimension (`fused_us`),
per path: `mlx` (mx.quantized_matmul) everywhere, and on CUDA `mma` (the small-M kernel's
tensor-core layout, which row-invariant routing serves for every 1..7-row product) and
`routed` (each product as the mixed routing would route it: small_m_qmm.route on a layer of
that shape). `equal` says whether the stacked product's columns are bit for bit the parts'
(each output column is its own weight row's dot product with the input, so they should be,
and a stacked engine would then change no token). Off CUDA only `mlx` runs.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from mtplxd.engine.bench.harness import bench_parser, command_line, machine, median_ms, write_report
from mtplxd.engine.model import small_m_qmm
from mtplxd.engine.model.stacked import stacked_projection

PROG = "python -m mtplxd.engine.bench.fused_products"
CALLS = 16  # calls evaluated together per timed sample (bench.small_m's)

# (group, K in, [(part, N out), ...]): the matrices of one layer that read the same input.
GROUPS: dict[str, list[tuple[str, int, list[tuple[str, int]]]]] = {
    "hybrid-27b": [("gdn_in", 5120, [("in_proj_qkv", 10240), ("in_proj_z", 6144), ("in_proj_b", 48),
                                     ("in_proj_a", 48)]),
                   ("mlp_in", 5120, [("gate_proj", 17408), ("up_proj", 17408)]),
                   ("attention_in", 5120, [("q_proj", 12288), ("k_proj", 1024), ("v_proj", 1024)])],
    "qwen3-32b": [("mlp_in", 5120, [("gate_proj", 25600), ("up_proj", 25600)]),
                  ("attention_in", 5120, [("q_proj", 8192), ("k_proj", 1024), ("v_proj", 1024)])],
    "qwen3-4b": [("mlp_in", 2560, [("gate_proj", 9728), ("up_proj", 9728)]),
                 ("attention_in", 2560, [("q_proj", 4096), ("k_proj", 1024), ("v_proj", 1024)])],
    "tiny": [("mlp_in", 128, [("gate_proj", 192), ("up_proj", 192)]),
             ("gdn_in", 128, [("in_proj_qkv", 320), ("in_proj_b", 8), ("in_proj_a", 8)])],
}


def quantized_layer(N: int, K: int, bits: int, seed: int) -> nn.QuantizedLinear:
    """An affine-quantized N x K layer (groups of 64) of random bf16 weights."""
    layer = nn.QuantizedLinear(K, N, bias=False, group_size=small_m_qmm.GROUP_SIZE, bits=bits)
    weight = (mx.random.normal((N, K), key=mx.random.key(seed)) * 0.02).astype(mx.bfloat16)
    layer.weight, layer.scales, layer.biases = mx.quantize(weight, group_size=small_m_qmm.GROUP_SIZE, bits=bits)
    mx.eval(layer.parameters())
    return layer


def _paths(on_cuda: bool) -> dict[str, Callable[[mx.array, nn.QuantizedLinear], mx.array]]:
    """Each path's product of a layer: MLX's, and on CUDA the kernel's mma layout and the
    mixed routing's choice (small_m_qmm.route; MLX where it routes nothing)."""
    def mlx(x, layer):
        return mx.quantized_matmul(x, layer.weight, layer.scales, layer.biases, transpose=True,
                                   group_size=layer.group_size, bits=layer.bits)

    def through(layout_of):
        def product(x, layer):
            layout = layout_of(x, layer)
            if layout is None:
                return mlx(x, layer)
            return small_m_qmm.small_m_matmul(x, layer.weight, layer.scales, layer.biases, layer.bits,
                                              layout=layout)
        return product

    paths = {"mlx": mlx}
    if on_cuda:
        paths["mma"] = through(lambda x, layer: "mma")
        paths["routed"] = through(small_m_qmm.route)
    return paths


def _per_call_us(fn: Callable[[], list[mx.array]], repeats: int) -> float:
    return median_ms(lambda: mx.eval([fn() for _ in range(CALLS)]), repeats) / CALLS * 1000


def measure_group(K: int, parts: list[tuple[str, int]], bits: int, rows: list[int], repeats: int,
                  on_cuda: bool) -> list[dict[str, Any]]:
    """One group at every row count: separate and stacked, per path."""
    layers = [quantized_layer(N, K, bits, seed=i + 1) for i, (_, N) in enumerate(parts)]
    fused = stacked_projection(*layers)  # what the engine stacks (MTPLX_STACKED_PROJECTIONS)
    out = []
    for M in rows:
        x = mx.random.normal((M, K), key=mx.random.key(M)).astype(mx.bfloat16)
        mx.eval(x)
        record: dict[str, Any] = {"K": K, "bits": bits, "M": M, "parts": [name for name, _ in parts],
                                  "N_parts": [N for _, N in parts], "weight_bytes": sum(
                                      layer[key].nbytes for layer in layers for key in ("weight", "scales", "biases"))}
        for path, product in _paths(on_cuda).items():
            separate_us = _per_call_us(lambda: [product(x, layer) for layer in layers], repeats)
            fused_us = _per_call_us(lambda: [product(x, fused)], repeats)
            equal = mx.array_equal(mx.concatenate([product(x, layer) for layer in layers], axis=-1),
                                   product(x, fused)).item()
            record[path] = {"separate_us": separate_us, "fused_us": fused_us,
                            "fused_over_separate": fused_us / separate_us, "equal": bool(equal)}
        out.append(record)
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("out")
    parser.add_argument("--sizes", default="hybrid-27b,qwen3-32b")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    unknown = [size for size in args.sizes.split(",") if size not in GROUPS]
    if unknown:
        parser.error(f"unknown size: {', '.join(unknown)} (sizes: {', '.join(GROUPS)})")
    rows = [int(r) for r in args.rows.split(",")]
    on_cuda = small_m_qmm.usable() and small_m_qmm.mma_usable()
    results: list[dict[str, Any]] = []
    report = {"kernel_usable": on_cuda, "results": results, **machine(), "command": command_line(PROG, argv)}
    for size in args.sizes.split(","):
        for group, K, parts in GROUPS[size]:
            for bits in (int(b) for b in args.bits.split(",")):
                for record in measure_group(K, parts, bits, rows, args.repeats, on_cuda):
                    record.update(size=size, group=group)
                    results.append(record)
                    paths = "; ".join(
                        f"{path} {r['separate_us']:.1f} -> {r['fused_us']:.1f} us ({r['fused_over_separate']:.2f}x"
                        f"{', equal' if r['equal'] else ', NOT equal'})"
                        for path, r in record.items() if isinstance(r, dict))
                    print(f"{size:10s} {group:12s} q{bits} M={record['M']}: {paths}", flush=True)
                write_report(args.out, report, indent=1)  # as it goes: a cut-short run keeps its rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
