"""What one kernel of a compiled graph costs when it does no work: the floor under a step made
of many small kernels (issue 22, point 6: what limits the 4B's decode step).

    python -m mtplxd.engine.bench.launch_cost [--ops 200] [--iterations 100] [--rounds 5] \\
        [--pad 20000] --json-out launch.json

A 4-bit Qwen3-4B's compiled decode step launches 600-800 kernels; a fifth fewer of them left
its wall time level (docs/benchmarks.md, "The query and key norms and rope as one kernel"). So
what does a kernel cost beyond its work? Each form chains `--ops` kernels on a (1, 64) float32
array inside one `mx.compile`d function, and the function runs `--iterations` times back to back
(`mx.async_eval`, as the engine's loops run), then once more per round with a wait after each
call (`mx.eval`):

- `norm`: MLX's `mx.fast.rms_norm` (a built-in kernel that `mx.compile` does not fuse with
  its neighbours, as it would chained elementwise ops; a 4B layer runs four of them).
- `custom`: x + 1 as an `mx.fast.cuda_kernel` with a few lines of source (CUDA only).
- `custom-padded`: that kernel with `--pad` bytes of comment in its source, as long as
  small_m_qmm's vector layout was with its header as written (about 19 kB): MLX's CUDA
  backend hashes a custom kernel's whole source each time it encodes it
  (`CustomKernel::eval_gpu`, mlx 0.32), so a long source may cost host time a launch. (It
  did, on an H100: the engine's kernels now reach MLX compacted, custom_kernels.compact.)

Reported per form: microseconds a kernel pipelined (wall, and the process's CPU time) and
waited on, medians over `--rounds`. A pipelined figure near the waited one, with CPU time
beside it, is host-bound: the host encodes kernels no faster than the device runs them. The
forms are interleaved within each round so the machine's drift falls on all of them.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from mtplxd.engine.bench.harness import bench_parser, command_line, machine, write_report
from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

PROG = "python -m mtplxd.engine.bench.launch_cost"
FORMS = ("norm", "custom", "custom-padded")
SHAPE = (1, 64)
_ADD_SOURCE = """
    // The grid is x's size (`kernel_once`): one element a thread.
    unsigned int elem = threadIdx.x + blockIdx.x * blockDim.x;
    out[elem] = x[elem] + 1.0f;
"""


@functools.cache
def _add_kernel(pad: int):
    padding = "" if pad <= 0 else "// " + "x" * max(pad - 4, 0) + "\n"
    return mx.fast.cuda_kernel(name=f"mtplx_launch_cost_add_{pad}", input_names=["x"], output_names=["out"],
                               source=padding + _ADD_SOURCE)


def kernel_once(x: mx.array, form: str, pad: int = 0) -> mx.array:
    """One kernel on x: "norm" MLX's rms_norm; "custom", "custom-padded" x + 1 by a
    cuda_kernel whose source carries `pad` bytes of comment in the padded form."""
    if form == "norm":
        return mx.fast.rms_norm(x, None, 1e-5)
    kernel = _add_kernel(pad if form == "custom-padded" else 0)
    return kernel(inputs=[x], grid=(x.size, 1, 1), threadgroup=(min(x.size, 256), 1, 1),
                  output_shapes=[x.shape], output_dtypes=[x.dtype])[0]


def chain(form: str, ops: int, pad: int = 0) -> Callable[[mx.array], mx.array]:
    """A compiled function applying `kernel_once` `ops` times: `ops` kernels a call."""
    def run(x: mx.array) -> mx.array:
        for _ in range(ops):
            x = kernel_once(x, form, pad)
        return x
    return mx.compile(run)


def _time_pipelined(fn: Callable[[mx.array], mx.array], x: mx.array, iterations: int) -> tuple[float, float]:
    """Seconds of wall and of the process's CPU for `iterations` calls queued back to back."""
    mx.synchronize()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(iterations):
        x = fn(x)
        mx.async_eval(x)
    mx.eval(x)
    mx.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu_start


def _time_waited(fn: Callable[[mx.array], mx.array], x: mx.array, iterations: int) -> float:
    """Seconds of wall for `iterations` calls, each waited on before the next."""
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(iterations):
        x = fn(x)
        mx.eval(x)
    return time.perf_counter() - start


def measure(forms: tuple[str, ...], ops: int, iterations: int, rounds: int, pad: int) -> dict[str, Any]:
    """Per form, microseconds a kernel (pipelined wall and CPU, waited wall): each round's
    figure and the medians."""
    x0 = mx.ones(SHAPE, dtype=mx.float32)
    fns = {form: chain(form, ops, pad) for form in forms}
    for fn in fns.values():  # trace and compile outside the timing
        mx.eval(fn(x0))
    per_kernel = 1e6 / (ops * iterations)
    rows: dict[str, dict[str, list[float]]] = {f: {"pipelined": [], "cpu": [], "waited": []} for f in forms}
    for _ in range(rounds):
        for form, fn in fns.items():
            wall, cpu = _time_pipelined(fn, x0, iterations)
            rows[form]["pipelined"].append(wall * per_kernel)
            rows[form]["cpu"].append(cpu * per_kernel)
            rows[form]["waited"].append(_time_waited(fn, x0, iterations) * per_kernel)
    return {"ops": ops, "iterations": iterations, "rounds": rounds, "pad": pad,
            "forms": {form: {"us_per_kernel_pipelined": statistics.median(r["pipelined"]),
                             "cpu_us_per_kernel_pipelined": statistics.median(r["cpu"]),
                             "us_per_kernel_waited": statistics.median(r["waited"]), "rounds": r}
                      for form, r in rows.items()}}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--ops", type=int, default=200, help="kernels a compiled call")
    parser.add_argument("--iterations", type=int, default=100, help="calls a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pad", type=int, default=20000, help="bytes of comment in custom-padded's source")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.ops, args.iterations, args.rounds) < 1:
        parser.error("--ops, --iterations and --rounds must be at least 1")
    forms = FORMS if fixed_shapes_wanted() else ("norm",)  # cuda_kernel: CUDA only
    report = {**machine(), "command": command_line(PROG, argv),
              **measure(forms, args.ops, args.iterations, args.rounds, args.pad)}
    for form, row in report["forms"].items():
        print(f"{form:14s} {row['us_per_kernel_pipelined']:6.2f} us a kernel pipelined "
              f"({row['cpu_us_per_kernel_pipelined']:.2f} of CPU), {row['us_per_kernel_waited']:6.2f} waited")
    if args.json_out:
        write_report(args.json_out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
