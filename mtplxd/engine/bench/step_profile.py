"""The device's own time for one decode step or one speculative cycle, read from Nsight
Compute: is a real-size step bound by the device or by the host? (issue 22, point 6: what
limits each figure, measured with a profile rather than guessed.)

    python -m mtplxd.engine.bench.step_profile [--size qwen3-32b] [--dtype 4bit] \\
        [--depth 0] [--steps 4] [--context 512] [--small-m-kernel] [--stacked] \\
        [--decode-vector-values N] [--qk-norm-rope] --json-out step.json
    ncu --profile-from-start off --graph-profiling graph --metrics gpu__time_duration.sum \\
        --csv --log-file ncu.csv python -m mtplxd.engine.bench.step_profile ... --profiled
    python -m mtplxd.engine.bench.step_profile --summarize ncu.csv --steps 4 [--json-out FILE]

Why a profiler: on CUDA MLX's `async_eval` blocks once more than 10 command buffers are in
flight, so a host split timed in Python (bench.host) reads "host-bound" whatever the device
does (docs/benchmarks.md, "Where the 32B's decode time goes"). Nsight Compute times each
workload on the device alone. With `--graph-profiling graph` a workload is one of MLX's CUDA
graphs (a 32B decode step is ~15-25 of them) or a kernel launched outside one; their
durations summed over the profiled steps, per step, are the device's busy time. A step whose
wall time is well above that waits on the host (building the graph in Python, MLX encoding
it); one near it is device-bound. `--graph-profiling node` instead gives every kernel's
duration, for a breakdown by kernel (`top_workloads`).

The model is built as bench.real_size builds it (random weights, `--context` tokens);
`--depth 0` profiles the engine's AR loop, `--depth K` its MTP loop at depth K (the fused
one, hybrid models' too, as a greedy request is served), greedy. Without `--profiled` the script times the same
steps unprofiled (`wall_ms_per_step`, with the process's CPU time beside it, `cpu_ms_per_step`:
every thread's, MLX's encoder and its waits included) and stops. With it, the steps run between
cuProfilerStart and cuProfilerStop (the CUDA driver's, which `--profile-from-start off`
obeys), after a warm-up outside the range. `--summarize` reads ncu's CSV afterwards (on any
machine: no MLX needed).
"""

from __future__ import annotations

import csv
import ctypes
import io
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable

from mtplxd.engine.bench.harness import bench_parser, command_line, machine, write_report

PROG = "python -m mtplxd.engine.bench.step_profile"
DURATION_METRIC = "gpu__time_duration.sum"
# ncu writes durations in the unit it finds readable unless told otherwise.
UNIT_TO_MS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0,
              "ms": 1.0, "second": 1e3, "s": 1e3}


def summarize_ncu_csv(text: str, steps: int, top: int = 12) -> dict[str, Any]:
    """Device ms per step from ncu's `--csv` output of DURATION_METRIC: the workloads'
    durations summed over all profiled steps, divided by `steps`; the largest workloads by
    name, each with its median and longest launch (on an H100 on 2026-12-07 a kernel's
    launches under ncu were bimodal, most at one time and a few 5-30x longer, in no order:
    the median is its steady cost, the mean per step is not).
    Lines before ncu's header row (its ==PROF== log) are skipped."""
    by_name = durations_by(text, lambda row: row.get("Kernel Name") or "?")
    if not by_name:
        raise ValueError(f"no {DURATION_METRIC} rows in the ncu output")
    workloads = sum(len(values) for values in by_name.values())
    total_ms = sum(sum(values) for values in by_name.values())
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return {
        "steps": steps,
        "workloads": workloads,
        "workloads_per_step": workloads / steps,
        "device_ms_total": total_ms,
        "device_ms_per_step": total_ms / steps,
        "top_workloads": [{"name": name, "count": len(values), "ms_per_step": sum(values) / steps,
                           "median_ms": statistics.median(values), "max_ms": max(values)}
                          for name, values in ranked],
    }


def durations_by(text: str, key: Callable[[dict[str, str]], Hashable]) -> dict[Hashable, list[float]]:
    """ncu's DURATION_METRIC rows grouped by `key(row)`: {key: [ms of each workload]}, in the
    order they ran (by kernel name for the summary; by name and grid in
    docs/benchmarks-data/ncu-by-kernel.py)."""
    grouped: dict[Hashable, list[float]] = defaultdict(list)
    for row in _metric_rows(text):
        grouped[key(row)].append(_ms(row["Metric Value"], row["Metric Unit"]))
    return dict(grouped)


def _metric_rows(text: str) -> Iterable[dict[str, str]]:
    """ncu's CSV rows of DURATION_METRIC, from the header row on."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if row.get("Metric Name") == DURATION_METRIC:
            yield row


def _ms(value: str, unit: str) -> float:
    """A duration cell (ncu may print thousands separators) in milliseconds."""
    if unit not in UNIT_TO_MS:
        raise ValueError(f"unknown duration unit {unit!r}")
    return float(value.replace(",", "")) * UNIT_TO_MS[unit]


class DriverProfiler:
    """cuProfilerStart / cuProfilerStop of the CUDA driver (libcuda), which every CUDA
    runtime in the process shares: the range `ncu --profile-from-start off` profiles."""

    def __init__(self) -> None:
        self.driver = ctypes.CDLL("libcuda.so.1")

    def start(self) -> None:
        self._check(self.driver.cuProfilerStart(), "cuProfilerStart")

    def stop(self) -> None:
        self._check(self.driver.cuProfilerStop(), "cuProfilerStop")

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call} returned CUDA error {status}")


def run_steps(size: str, dtype: str, depth: int, steps: int, small_m_kernel: bool,
              profiled: bool, context: int = 512, warmup: int = 8, stacked: bool = False,
              decode_vector_values: int | None = None, qk_norm_rope: bool = False) -> dict[str, Any]:
    """Build the model, run `warmup` steps, then time `steps` more (the profiled range when
    `profiled`): wall ms per step (one cycle at depth > 0) and tokens per step. `stacked`:
    the projections that read one input as one product first (stacked.py), as load_model
    does with MTPLX_STACKED_PROJECTIONS=1. `decode_vector_values`: the weights from which a
    decode step's product takes the kernel's vector layout (small_m_qmm.LARGE_MATRIX_VALUES;
    None: as shipped). `qk_norm_rope`: attention's query and key norms and rope as one kernel a
    layer (qk_norm_rope.py), as load_model does with MTPLX_QK_NORM_ROPE=1."""
    from mtplxd.engine.bench.real_size import decode_vector_threshold

    with decode_vector_threshold(decode_vector_values):
        return _run_steps(size, dtype, depth, steps, small_m_kernel, profiled, context, warmup, stacked,
                          qk_norm_rope)


def _run_steps(size: str, dtype: str, depth: int, steps: int, small_m_kernel: bool,
               profiled: bool, context: int, warmup: int, stacked: bool,
               qk_norm_rope: bool) -> dict[str, Any]:
    from mtplxd.engine.model import small_m_qmm

    model, trunk, built = build_for_steps(size, dtype, stacked=stacked, qk_norm_rope=qk_norm_rope)
    if small_m_kernel:
        small_m_qmm.install(model, force=True)
    timed = time_loop(trunk, model, prompt_for(trunk, context), depth, steps, warmup,
                      DriverProfiler() if profiled else None)
    return {"size": size, "dtype": dtype, "depth": depth, "steps": steps, "context": context,
            "loop": timed["loop"], "small_m_kernel": small_m_kernel,
            "large_matrix_values": small_m_qmm.LARGE_MATRIX_VALUES,
            "row_invariant": small_m_qmm.routed_row_invariant(model), **built, "profiled": profiled,
            "wall_ms_per_step": timed["wall_ms_per_step"], "cpu_ms_per_step": timed["cpu_ms_per_step"],
            "tokens_per_step": timed["tokens_per_step"]}


def build_for_steps(size: str, dtype: str, *, stacked: bool = False,
                    qk_norm_rope: bool = False) -> tuple[Any, Any, dict[str, int]]:
    """(model, trunk, {"stacked_groups", "norm_rope_layers"}): the model as bench.real_size
    builds it (random weights), its projections that read one input stacked (`stacked`,
    stacked.py) and its query and key norms and rope as one kernel a layer (`qk_norm_rope`),
    as load_model does with MTPLX_STACKED_PROJECTIONS=1 and MTPLX_QK_NORM_ROPE=1."""
    from mtplxd.engine.bench.real_size import build_model
    from mtplxd.engine.model import qk_norm_rope as norm_rope
    from mtplxd.engine.model.stacked import stack
    from mtplxd.engine.model.trunk import Trunk

    model, spec = build_model(size, dtype)
    trunk = Trunk(model, spec)
    stacked_groups = stack(model) if stacked else 0
    norm_rope_layers = norm_rope.install(model, force=True) if qk_norm_rope else 0
    return model, trunk, {"stacked_groups": stacked_groups, "norm_rope_layers": norm_rope_layers}


def prompt_for(trunk: Any, context: int) -> list[int]:
    """`context` random prompt tokens (the same for every model of a vocabulary)."""
    import mlx.core as mx

    vocab = trunk.text.args.vocab_size
    return mx.random.randint(0, vocab, (context,), key=mx.random.key(1)).tolist()


def time_loop(trunk: Any, model: Any, prompt: list[int], depth: int, steps: int, warmup: int = 8,
              profiler: "DriverProfiler | None" = None) -> dict[str, Any]:
    """The engine's loop over `prompt` (AR at depth 0, else MTP at `depth`; greedy): `warmup`
    steps, then `steps` more timed (between the profiler's start and stop when given). Its
    wall and process CPU ms a step, tokens a step and which loop ran."""
    import mlx.core as mx

    from mtplxd.engine.bench.real_size import engine_loop

    loop, _, fused = engine_loop(trunk, model.mtp, prompt, depth, 0.0)
    for _ in range(warmup):
        next(loop)
    mx.synchronize()
    if profiler:
        profiler.start()
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = sum(len(next(loop)) for _ in range(steps))
    mx.synchronize()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if profiler:
        profiler.stop()
    loop.close()
    return {"loop": ("ar compiled" if fused else "ar") if depth == 0 else ("fused" if fused else "stepwise"),
            "wall_ms_per_step": elapsed * 1000 / steps, "cpu_ms_per_step": cpu * 1000 / steps,
            "tokens_per_step": tokens / steps}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--size", default="qwen3-32b")
    parser.add_argument("--dtype", default="4bit")
    parser.add_argument("--depth", type=int, default=0, help="0: the AR loop; K: the MTP loop at depth K")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--small-m-kernel", action="store_true",
                        help="install the small-M kernel as served (small_m_qmm.install)")
    parser.add_argument("--stacked", action="store_true",
                        help="stack the projections that read one input into one product (stacked.py)")
    parser.add_argument("--decode-vector-values", type=int, default=None, metavar="N",
                        help="with --small-m-kernel: decode steps' products of N weights or more take the "
                             "vector layout (small_m_qmm.LARGE_MATRIX_VALUES; default as shipped)")
    parser.add_argument("--qk-norm-rope", action="store_true",
                        help="attention's query and key norms and rope as one kernel a layer (qk_norm_rope.py)")
    parser.add_argument("--profiled", action="store_true",
                        help="run the timed steps between cuProfilerStart and cuProfilerStop (under ncu)")
    parser.add_argument("--summarize", type=Path, default=None, metavar="NCU_CSV",
                        help="read ncu's CSV and print the device ms per step instead")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.summarize:
        report = summarize_ncu_csv(args.summarize.read_text(errors="replace"), args.steps)
        print(f"{report['workloads_per_step']:.1f} workloads, {report['device_ms_per_step']:.2f} "
              f"device ms per step")
    else:
        report = {**machine(), "command": command_line(PROG, argv),
                  **run_steps(args.size, args.dtype, args.depth, args.steps, args.small_m_kernel,
                              args.profiled, args.context, stacked=args.stacked,
                              decode_vector_values=args.decode_vector_values,
                              qk_norm_rope=args.qk_norm_rope)}
        print(f"{args.size} {args.dtype} depth {args.depth}: {report['wall_ms_per_step']:.2f} ms "
              f"a step ({report['cpu_ms_per_step']:.2f} ms of the process's CPU time), "
              f"{report['tokens_per_step']:.2f} tokens", flush=True)
    if args.json_out:
        write_report(args.json_out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
