"""One layer's attention over a KV buffer in one form (Qwen3-32B's shapes unless told): wall
per call, and under Nsight Compute the device's own time (issue 22: the fused loops'
attention grows with the context; docs/benchmarks.md, "The KV scatter timed").

    python -m mtplxd.engine.bench.attention_profile --form split --context 8192 --rows 4 \\
        [--split-slots 256] [--split-warps 8] [--split-pairs 1] [--mma-slots 128] [--mma-warps 8] \\
        [--scalars-in-pool] [--calls 16] [--json-out FILE]
    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python -m mtplxd.engine.bench.attention_profile ... --profiled > ncu.csv
    python -m mtplxd.engine.bench.step_profile --summarize ncu.csv --steps 16

The query rows sit at the context's end (row 0 at cache position `--context`) of a buffer
with 256 slots to spare, as the fused loops allocate it. Forms:
  one-pass  the buffer kernel as served (buffer_attention.one_pass_buffer_attention; CUDA)
  split     its split form (split_buffer_attention; CUDA), in chunks of --split-slots key
            slots, blocks of --split-warps warps, each serving --split-pairs (query head, row)
            pairs at most (buffer_attention's SPLIT_SLOTS, SPLIT_WARPS and SPLIT_MAX_PAIRS
            unless told: knobs for this bench only)
  two-pass  its two-pass form (two_pass_buffer_attention; CUDA)
  mma       its mma form (mma_buffer_attention; CUDA): the split form's parts on the tensor cores,
            in chunks of --mma-slots key slots, blocks of --mma-warps warps (each warp taking
            slots / warps of them, a multiple of 16; MMA_SLOTS and MMA_WARPS unless told)
  mlx       mx.fast.scaled_dot_product_attention over the keys the last row sees, causal for
            several rows: what an op-by-op AR step runs (cuDNN on CUDA past 256 keys)
  masked    mx.fast.scaled_dot_product_attention over the whole buffer with a boolean mask:
            what the fused loops ran before the buffer kernel
The offset (row 0's cache position) is an int32 scalar made on the host, as the op-by-op
steps make theirs; the buffer kernels take it, and the scale, padded to 16-byte vectors,
which MLX allocates in device memory (buffer_attention.kernel_offsets says why). With
--scalars-in-pool they take one-element arrays instead, which MLX (0.32.4, CUDA) keeps in a
pool of managed memory that the GPU reaches through a mapping: the layout before the
padding, to time the two side by side.
One form a process, so that an ncu log holds that form's kernels only. The wall figure
(unprofiled) is the median over `--repeats` of `--calls` chained calls evaluated at once,
per call; with `--profiled` the same calls then run once more between cuProfilerStart and
cuProfilerStop, each evaluated alone.
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import mlx.core as mx

from mtplxd.engine.bench.harness import bench_parser, command_line, machine, median_ms, write_report
from mtplxd.engine.bench.step_profile import DriverProfiler
from mtplxd.engine.decoding import buffer_attention

PROG = "python -m mtplxd.engine.bench.attention_profile"
FORMS = ("one-pass", "split", "two-pass", "mma", "mlx", "masked")
SPARE_SLOTS = 256  # slots a fused loop's buffer keeps past the prompt (real_size's --context)
QWEN3_32B = {"heads": 64, "kv_heads": 8, "dim": 128}


def attention_call(form: str, context: int, rows: int, heads: int, kv_heads: int,
                   dim: int) -> Callable[[mx.array], mx.array]:
    """`attend(queries) -> output` of `form` (module docstring) over one random bf16 buffer of
    context + SPARE_SLOTS slots, row 0 at position `context`."""
    if form in buffer_attention.FORMS and not buffer_attention.usable():
        raise SystemExit(f"form {form} needs the buffer kernel (MLX's CUDA backend)")
    slots = context + SPARE_SLOTS
    keys = mx.random.split(mx.random.key(0), 2)
    k = mx.random.normal((1, kv_heads, slots, dim), key=keys[0]).astype(mx.bfloat16)
    v = mx.random.normal((1, kv_heads, slots, dim), key=keys[1]).astype(mx.bfloat16)
    offset = mx.array(context, mx.int32)
    mask = mx.arange(slots)[None] <= context + mx.arange(rows)[:, None]
    mx.eval(k, v, mask, offset)
    scale = 1 / math.sqrt(dim)
    seen = context + rows  # the keys the last row sees
    if form == "one-pass":
        return lambda q: buffer_attention.one_pass_buffer_attention(q, k, v, offset, scale)
    if form == "split":
        return lambda q: buffer_attention.split_buffer_attention(q, k, v, offset, scale)
    if form == "two-pass":
        return lambda q: buffer_attention.two_pass_buffer_attention(q, k, v, offset, scale)
    if form == "mma":
        return lambda q: buffer_attention.mma_buffer_attention(q, k, v, offset, scale)
    if form == "mlx":
        return lambda q: mx.fast.scaled_dot_product_attention(
            q, k[:, :, :seen], v[:, :, :seen], scale=scale, mask="causal" if rows > 1 else None)
    return lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def run(form: str, context: int, rows: int, calls: int, repeats: int, profiled: bool,
        shape: dict[str, int] = QWEN3_32B, in_pool: bool = False) -> dict[str, Any]:
    """Wall microseconds per call of `form` (and, `profiled`, the calls ncu times);
    `in_pool`: the kernels' scalars as buffer_attention.scalars_in_pool keeps them."""
    with buffer_attention.scalars_in_pool(in_pool):
        return _run(form, context, rows, calls, repeats, profiled, shape) | {"scalars_in_pool": in_pool}


def _run(form: str, context: int, rows: int, calls: int, repeats: int, profiled: bool,
         shape: dict[str, int]) -> dict[str, Any]:
    attend = attention_call(form, context, rows, **shape)
    q = mx.random.normal((1, shape["heads"], rows, shape["dim"]), key=mx.random.key(2)).astype(mx.bfloat16)
    mx.eval(q)

    def chained() -> None:  # each call's output is the next one's query: none is skipped
        y = q
        for _ in range(calls):
            y = attend(y)
        mx.eval(y)

    chained()  # compiles the kernels
    wall_us = median_ms(chained, repeats) / calls * 1000
    if profiled:
        profiler = DriverProfiler()
        profiler.start()
        for _ in range(calls):
            mx.eval(attend(q))
        profiler.stop()
    return {"form": form, "context": context, "rows": rows, "slots": context + SPARE_SLOTS,
            **shape, "calls": calls, "repeats": repeats, "wall_us_per_call": wall_us,
            "profiled": profiled}


@contextmanager
def kernel_shape(**values: int) -> Iterator[None]:
    """buffer_attention's knobs (SPLIT_SLOTS, SPLIT_WARPS, SPLIT_MAX_PAIRS, MMA_SLOTS,
    MMA_WARPS) at these values inside (a kernel reads them when called), the shipped ones
    back after."""
    shipped = {name: getattr(buffer_attention, name) for name in values}
    for name, value in values.items():
        setattr(buffer_attention, name, value)
    try:
        yield
    finally:
        for name, value in shipped.items():
            setattr(buffer_attention, name, value)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--form", choices=FORMS, required=True)
    parser.add_argument("--context", type=int, default=8192, help="cache position of query row 0")
    parser.add_argument("--rows", type=int, default=1, help="query rows (1: a decode step; K+1: a verify)")
    parser.add_argument("--heads", type=int, default=QWEN3_32B["heads"], help="query heads (64: Qwen3-32B)")
    parser.add_argument("--kv-heads", type=int, default=QWEN3_32B["kv_heads"], help="KV heads (8)")
    parser.add_argument("--dim", type=int, default=QWEN3_32B["dim"],
                        help="head size (128; the hybrid 27B's attention: 24 heads, 4 KV heads, 256)")
    parser.add_argument("--split-slots", type=int, default=buffer_attention.SPLIT_SLOTS,
                        help="key slots a block of the split form takes (a multiple of 32)")
    parser.add_argument("--split-warps", type=int, choices=(1, 2, 4, 8), default=buffer_attention.SPLIT_WARPS,
                        help="warps a block of the split form's first pass has")
    parser.add_argument("--split-pairs", type=int, choices=(1, 2, 4), default=buffer_attention.SPLIT_MAX_PAIRS,
                        help="(query head, row) pairs a warp of it serves at most (fewer where shared memory is short)")
    parser.add_argument("--mma-slots", type=int, default=buffer_attention.MMA_SLOTS,
                        help="key slots a block of the mma form takes (a multiple of 16 x --mma-warps)")
    parser.add_argument("--mma-warps", type=int, choices=(1, 2, 4, 8), default=buffer_attention.MMA_WARPS,
                        help="warps a block of the mma form has")
    parser.add_argument("--scalars-in-pool", action="store_true",
                        help="the kernels' offset and scale in MLX's managed small-array pool, as before "
                             "they were padded (the module docstring)")
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profiled", action="store_true",
                        help="then run the calls between cuProfilerStart and cuProfilerStop (under ncu)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.context < 0 or min(args.rows, args.calls, args.repeats, args.heads, args.kv_heads, args.dim) < 1:
        parser.error("--context must be >= 0 and the other counts >= 1")
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads (whole GQA groups)")
    if args.split_slots < 32 or args.split_slots % 32:
        parser.error("--split-slots must be a positive multiple of 32 (the split form's tile)")
    if args.mma_slots < 16 * args.mma_warps or args.mma_slots % (16 * args.mma_warps):
        parser.error("--mma-slots must be a positive multiple of 16 x --mma-warps (a warp's 16-slot steps)")
    shape = {"heads": args.heads, "kv_heads": args.kv_heads, "dim": args.dim}
    with kernel_shape(SPLIT_SLOTS=args.split_slots, SPLIT_WARPS=args.split_warps, SPLIT_MAX_PAIRS=args.split_pairs,
                      MMA_SLOTS=args.mma_slots, MMA_WARPS=args.mma_warps):
        report = {**machine(), "command": command_line(PROG, argv), "split_slots": args.split_slots,
                  "split_warps": args.split_warps, "split_pairs": args.split_pairs,
                  "mma_slots": args.mma_slots, "mma_warps": args.mma_warps,
                  **run(args.form, args.context, args.rows, args.calls, args.repeats, args.profiled, shape,
                        args.scalars_in_pool)}
    print(f"{args.form} context {args.context} rows {args.rows}: "
          f"{report['wall_us_per_call']:.1f} us a call", flush=True)
    if args.json_out:
        write_report(args.json_out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
