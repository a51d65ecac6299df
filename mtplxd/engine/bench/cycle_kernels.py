"""Kernels per cycle: the lone fused cycle (fused.py) against the fused cohort cycle at
widths W (fused_cohort.py), counted from the graphs, so exact on any machine.

    python -m mtplxd.engine.bench.cycle_kernels [--model mtplxd/models/embedded] [--depth 6]
        [--widths 1,3,8] [--builds 10] [--time-cycles N] [--modes greedy,sampled]
        [--quantize auto] [--small-m-kernel] [--json-out FILE]

For greedy and sampled (temperature 0.7, top-p 0.95) rows, at a 256-slot cache:
  * `kernels`: the primitives one cycle launches, views left out (ar_parity.kernels_in), in
    the graph `mx.compile` replays (fused elementwise runs count once) and, as `traced`, in
    the plain traced graph;
  * `host_build_us`: the median CPU time of this thread to build one cycle (a compiled call:
    a replay of the traced graph, nothing evaluated): what a launch-bound GPU waits on.
A cohort cycle on a launch-bound GPU costs about what a lone cycle costs when these match.

With `--time-cycles N` each cycle is also run for N cycles on the device, its state threaded
from cycle to cycle as the decode loops do (512-slot buffers, from position 20):
  * `pipelined_ms`: per cycle, each launched before the previous one is read back (the
    loops' own rhythm: what a row's decode speed is made of), the median of 3 passes;
  * `synced_ms`: per cycle, each evaluated before the next is built (one cycle's latency).
So on a GPU a cohort cycle's cost over the lone cycle's is measured without the scheduler.
`--small-m-kernel` routes quantized layers through small_m_qmm's kernel (CUDA only).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

import mlx.core as mx

from mtplxd.engine.bench.ar_parity import kernels_in
from mtplxd.engine.bench.harness import (
    add_quantize_option, add_small_m_kernel_option, bench_parser, command_line, machine,
    write_report,
)
from mtplxd.engine.decoding import fused, fused_cohort, row_sampling
from mtplxd.engine.decoding.fused import _CycleState, _speculative_cycle
from mtplxd.engine.decoding.sampling import seed_words
from mtplxd.engine.interface import SamplingParams

PROG = "python -m mtplxd.engine.bench.cycle_kernels"
CAPACITY = 256
TIMED_CAPACITY = 512  # room for the timed passes: each cycle advances a row by up to K+1
TIMED_PASSES = 3
MODES = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.7, top_p=0.95)}


def cycle_state(trunk: Any, depth: int, rows: int | None, capacity: int = CAPACITY) -> _CycleState:
    """An evaluated cycle state of zeros at position 20: one row's (rows None) or a cohort's."""
    args = trunk.text.args
    lead, width = ((), 1) if rows is None else ((rows,), rows)
    dtype = trunk.embed(mx.array([[0]])).dtype
    buffer = (width, args.num_key_value_heads, capacity, args.head_dim)

    def scalar(value: int) -> mx.array:
        return mx.full(lead, value, mx.int32)

    state = _CycleState(
        n=scalar(20), head_n=scalar(19), token=mx.zeros((width,), mx.uint32),
        pending_h=mx.zeros((width, depth + 1, args.hidden_size), dtype),
        pending_tokens=mx.zeros(lead + (depth + 1,), mx.uint32), count=scalar(1),
        counts=mx.zeros(lead + (args.vocab_size,)), seen=mx.zeros(lead + (args.vocab_size,)),
        trunk_kv=[mx.zeros(buffer, dtype) for _ in range(2 * args.num_hidden_layers)],
        head_kv=[mx.zeros(buffer, dtype) for _ in range(2)])
    mx.eval(state.flat())
    return state


def cycle_work(build: Callable[[], Callable], args: tuple, builds: int) -> dict[str, Any]:
    """Kernels of the traced and the compiled cycle, and the median µs to build one."""
    traced = sum(kernels_in(list(build()(*args))).values())
    compiled = mx.compile(build())
    outputs = compiled(*args)  # the trace (first call) is left out
    kernels = kernels_in(list(outputs))
    mx.eval(outputs)
    times = []
    for _ in range(builds):
        del outputs
        start = time.thread_time()
        outputs = compiled(*args)
        times.append((time.thread_time() - start) * 1e6)
        mx.eval(outputs)
    return {"kernels": sum(kernels.values()), "traced": traced,
            "host_build_us": round(statistics.median(times))}


def cycle_times(build: Callable[[], Callable], fixed: tuple, state: Callable[[], _CycleState],
                cycles: int) -> dict[str, float]:
    """ms per cycle over `cycles` cycles, pipelined (launched a cycle ahead of the read, as
    the loops run) and synced, each pass from a fresh `state()`; the first pass warms up."""
    compiled = mx.compile(build())

    def launch(arrays: list[mx.array]) -> list[mx.array]:
        outputs = list(compiled(*fixed, *arrays))
        arrays.clear()  # as the loops do: with no other reference the cycle reuses the buffers
        mx.async_eval(outputs[0], outputs[1])
        return outputs

    def pipelined() -> float:
        reading = launch(state().flat())
        start = time.perf_counter()
        for _ in range(cycles):
            following = reading[2:]
            del reading[2:]
            launched = launch(following)
            reading[0].tolist(), reading[1].tolist()
            reading = launched
        mx.eval(reading)
        return (time.perf_counter() - start) * 1e3 / cycles

    def synced() -> float:
        arrays = state().flat()
        start = time.perf_counter()
        for _ in range(cycles):
            arrays = list(compiled(*fixed, *arrays))
            mx.eval(arrays)
            arrays = arrays[2:]
        return (time.perf_counter() - start) * 1e3 / cycles

    pipelined(), synced()  # warm-up: the trace and first-use compilation
    return {"pipelined_ms": round(statistics.median(pipelined() for _ in range(TIMED_PASSES)), 4),
            "synced_ms": round(statistics.median(synced() for _ in range(TIMED_PASSES)), 4)}


def measure(trunk: Any, head: Any, depth: int, widths: list[int], builds: int,
            modes: list[str] | None = None, time_cycles: int = 0) -> dict[str, Any]:
    """{mode: {"lone": work, "W": work, ...}} (see the module docstring)."""
    vocab = trunk.text.args.vocab_size
    out: dict[str, Any] = {}
    for mode in modes or list(MODES):
        params = MODES[mode]
        lone = cycle_state(trunk, depth, None)
        build = lambda: _speculative_cycle(trunk, head, params, depth)  # noqa: E731
        figures = {"lone": cycle_work(build, (seed_words(0), *lone.flat()), builds)}
        if time_cycles:
            figures["lone"].update(cycle_times(
                build, (seed_words(0),), lambda: cycle_state(trunk, depth, None, TIMED_CAPACITY),
                time_cycles))
        for width in widths:
            settings = [params] * width
            features = row_sampling.features_of(settings, vocab)
            fixed = (mx.stack([seed_words(i) for i in range(width)]), mx.ones((width,), mx.bool_),
                     row_sampling.settings_table(settings, vocab))
            build = lambda: fused_cohort.cohort_cycle(trunk, head, features, depth)  # noqa: E731
            figures[str(width)] = cycle_work(build, (*fixed, *cycle_state(trunk, depth, width).flat()),
                                             builds)
            if time_cycles:
                figures[str(width)].update(cycle_times(
                    build, fixed, lambda: cycle_state(trunk, depth, width, TIMED_CAPACITY), time_cycles))
        out[mode] = figures
        print(f"{mode}: " + "; ".join(f"{name} {f['kernels']} kernels ({f['traced']} traced), "
                                      f"{f['host_build_us']} us" + _times(f)
                                      for name, f in figures.items()), flush=True)
    return out


def _times(figures: dict[str, Any]) -> str:
    if "pipelined_ms" not in figures:
        return ""
    return f", {figures['pipelined_ms']} ms pipelined / {figures['synced_ms']} ms synced"


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--model", default="mtplxd/models/embedded")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--widths", default="1,3,8")
    parser.add_argument("--builds", type=int, default=10)
    parser.add_argument("--time-cycles", type=int, default=0,
                        help="also time N cycles of each on the device (0: count only)")
    parser.add_argument("--modes", default=",".join(MODES))
    add_quantize_option(parser)
    add_small_m_kernel_option(parser)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    from mtplxd.engine.loaded_model import load_model

    model = load_model(args.model, quantize=args.quantize, small_m_kernel=args.small_m_kernel or None)
    fused.route_static_cache_attention()
    widths = [int(w) for w in args.widths.split(",")]
    report = {"bench": "cycle_kernels", "command": command_line(PROG, argv), "machine": machine(),
              "model": model.info.id, "quantization": model.info.quantization,
              "quantized_matmul": model.info.kernels["quantized_matmul"], "depth": args.depth,
              "capacity": CAPACITY, "timed_capacity": TIMED_CAPACITY if args.time_cycles else None,
              "modes": measure(model.trunk, model.head, args.depth, widths, args.builds,
                               args.modes.split(","), args.time_cycles)}
    if args.json_out:
        write_report(args.json_out, report, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
