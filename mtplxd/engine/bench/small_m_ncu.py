"""Each quantized product of one weight matrix, called a fixed number of times, for Nsight
Compute (`ncu`) to profile: what limits the small-M kernel (issue 22, point 6: measured with
a profile, not guessed).

    ncu --clock-control none -k regex:'small_m|qmv|qmm|gemv|read_ceiling' --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python -m mtplxd.engine.bench.small_m_ncu [--size qwen3-32b] [--matrix gate_proj] \\
        [--bits 4] [--rows 1,6] [--calls 2] [--together 1] [--vector-rows 4,16] \\
        [--persistent-blocks 264,660] [--unroll 2,4] [--read-ceiling]

For each row count, in this order: MLX's `quantized_matmul`, the kernel's vector layout (where
`small_m_qmm.route` would give it one: up to VECTOR_MAX_ROWS rows), its word layout and its
tensor-core layout ("mma"), each
`--calls` times with an evaluation after each call, so every call is its own launch in the
profile, in the order it prints. Off CUDA only MLX's product runs (the kernel is CUDA only),
so the script runs anywhere.

`--vector-rows 2,4,16` adds the vector layout at those output rows a block beside the served
VECTOR_ROWS (`vector-rR`: fewer registers and more blocks, or the reverse);
`--persistent-blocks 264,660` the vector layout's persistent form (small_m_qmm's
VECTOR_PERSISTENT_BLOCKS) in that many blocks at each of those block heights; `--unroll 2,4`
the vector layout, at each of those block heights, with that many 16-byte vectors of each row
a thread loads before using any (`vector-uU`, `vector-rR-uU`: fewer sequential passes a block
where K is long, as down_proj's; at 4 rows a block and 2 vectors, the served form's 80
registers and bytes in flight in twice the blocks; outputs round apart from the served ones by
a little); `--read-ceiling` adds bench.read_ceiling's readers, which read the same bytes
and compute nothing (`read-vector` in the vector layout's grid, `read-stream` as one flat
array): how near the bandwidth the fetch alone gets.

`--together N` evaluates N calls at once instead, as the micro-bench (bench.small_m) times
them, and prints per call the host's time to build them and the wall time of the evaluation:
under Nsight Systems (`nsys profile --cuda-graph-trace=node --stats=true`) the kernels' own
durations in MLX's CUDA graphs then sit beside the micro-bench's per-call figure (the vector
layout's 1-row gate_proj took 37 us in ncu but 66 us a call in the micro-bench).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from mtplxd.engine.bench import read_ceiling as read_ceiling_module
from mtplxd.engine.bench.harness import median
from mtplxd.engine.bench.small_m import SHAPES
from mtplxd.engine.model import small_m_qmm


def products(w: mx.array, scales: mx.array, biases: mx.array, bits: int, rows: int,
             vector_rows: tuple[int, ...] = (), read_ceiling: bool = False,
             persistent_blocks: tuple[int, ...] = (), unrolls: tuple[int, ...] = ()) -> dict:
    """name -> the product of an (rows, K) input, as it would be served; `vector_rows`: the
    vector layout again with that many output rows a block (`vector-rR`); `persistent_blocks`:
    the vector layout's persistent form in that many blocks, at the served rows a block and at
    each of `vector_rows` (`vector-pB`, `vector-rR-pB`); `unrolls`: the vector layout with that
    many vectors of each row a thread per pass, at each block height (`vector-uU`,
    `vector-rR-uU`); `read_ceiling`: bench.read_ceiling's readers of the same bytes, which
    compute nothing (`read-vector`, `read-stream`)."""
    def mlx_product(x):
        return mx.quantized_matmul(x, w, scales, biases, transpose=True,
                                   group_size=small_m_qmm.GROUP_SIZE, bits=bits)

    out = {"mlx": mlx_product}
    if small_m_qmm.usable():
        if rows <= small_m_qmm.VECTOR_MAX_ROWS[bits]:
            # Each block height's forms: as served, then persistent, then unrolled.
            forms = [("", {}),
                     *((f"-p{blocks}", {"persistent_blocks": blocks}) for blocks in persistent_blocks),
                     *((f"-u{u}", {"unroll": u}) for u in unrolls)]
            for r in (None, *vector_rows):
                for suffix, form in forms:
                    out["vector" + (f"-r{r}" if r else "") + suffix] = lambda x, r=r, form=form: (
                        small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="vector",
                                                   rows_per_warp=r, **form))
        out["word"] = lambda x: small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="word")
        out["mma"] = lambda x: small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="mma")
        if read_ceiling:
            out["read-vector"] = lambda x: read_ceiling_module.read_vector(w, scales, biases, bits)
            out["read-stream"] = lambda x: read_ceiling_module.read_stream(w, scales, biases)
    return out


def run_together(product, x: mx.array, together: int) -> tuple[float, float]:
    """Evaluate `together` calls at once: (host build, wall) in us per call."""
    start = time.perf_counter()
    outs = [product(x) for _ in range(together)]
    built = time.perf_counter()
    mx.eval(outs)
    done = time.perf_counter()
    return (built - start) * 1e6 / together, (done - start) * 1e6 / together


def comma_ints(text: str) -> tuple[int, ...]:
    """"2,4" as (2, 4), "" as (): the variant options' argparse type."""
    return tuple(int(item) for item in text.split(",") if item)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtplxd.engine.bench.small_m_ncu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="qwen3-32b", choices=sorted(SHAPES))
    parser.add_argument("--matrix", default="gate_proj")
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--rows", default="1,6")
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--together", type=int, default=1,
                        help="calls evaluated at once (the micro-bench's way: 16)")
    parser.add_argument("--vector-rows", type=comma_ints, default=(),
                        help="the vector layout again at these output rows a block, e.g. 2,4,16")
    parser.add_argument("--persistent-blocks", type=comma_ints, default=(),
                        help="the vector layout's persistent form in these many blocks, e.g. 264,660")
    parser.add_argument("--unroll", type=comma_ints, default=(),
                        help="the vector layout again with these many vectors of a row a thread "
                             "per pass, e.g. 2,4")
    parser.add_argument("--read-ceiling", action="store_true",
                        help="also read the same bytes computing nothing (bench.read_ceiling)")
    args = parser.parse_args(argv)
    shapes = {name: (N, K) for name, N, K in SHAPES[args.size]}
    if args.matrix not in shapes:
        parser.error(f"no matrix {args.matrix} in {args.size}: {', '.join(shapes)}")
    N, K = shapes[args.matrix]
    weight = (mx.random.normal((N, K), key=mx.random.key(0)) * 0.02).astype(mx.bfloat16)
    w, scales, biases = mx.quantize(weight, group_size=small_m_qmm.GROUP_SIZE, bits=args.bits)
    mx.eval(w, scales, biases)
    for rows in (int(r) for r in args.rows.split(",")):
        x = mx.random.normal((rows, K), key=mx.random.key(rows)).astype(mx.bfloat16)
        mx.eval(x)
        variants = products(w, scales, biases, args.bits, rows, args.vector_rows, args.read_ceiling,
                            args.persistent_blocks, args.unroll)
        for name, product in variants.items():
            timings = [run_together(product, x, args.together) for _ in range(args.calls)]
            line = f"{args.size} {args.matrix} q{args.bits} M={rows} {name}: {args.calls} calls"
            if args.together > 1:
                build, wall = (median([t[i] for t in timings]) for i in (0, 1))
                line += (f" of {args.together} together, per call: host build {build:.1f} us, "
                         f"wall {wall:.1f} us (medians)")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
