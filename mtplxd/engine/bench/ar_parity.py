"""Our AR decode beside stock mlx-lm's `generate_step`, per dtype and sampling mode, on
random weights built in memory (issue 22: "our AR at least as fast as mlx-lm in every mode").

    python -m mtplxd.engine.bench.ar_parity [--size qwen3-4b] [--dtypes 4bit,bf16,8bit]
        [--context 512] [--tokens 64] [--repeats 4] [--temperatures 0,0.6]
        [--budget-s 0] [--json-out FILE]

For each dtype (bench.real_size builds the model: bf16, or MLX affine 8/4-bit in groups of
64) and each temperature (greedy, and T with top-p 0.95), at `--context` tokens of context:

  * `decode_ms`: ms per token of our AR loop (autoregressive.ar_cycles) and of mlx-lm's
    pipelined `generate_step` (its own cache and `make_sampler`), `--tokens` tokens after
    each loop's pipeline is primed (ar_reference.PRIMED_TOKENS), `--repeats` runs per arm,
    interleaved: the arm that goes first alternates from run to run. `speed_vs_mlx_lm` is
    mlx-lm's median over ours (above 1: ours is faster); `pairs_median` the median of the
    back-to-back pairs' ratios. The same figures with `_cpu` are this process's CPU time
    per token (all threads): on a shared CPU it moves far less with other jobs' load.
  * `kernels_per_token`: the primitives one steady-state decode step puts in the graph
    (forward plus sampler), views (reshape, broadcast, slice, ...) left out: what a GPU
    launches per token, counted from the lazy graph (`mx.export_to_dot`), so it is exact
    on any machine. `sampler_kernels` counts the sampler alone.
  * `host_build_us`: the median CPU time the host thread spends building one step's graph
    (forward plus sampler, nothing evaluated): what a launch-bound GPU waits on.

Graphs are kept few (one context, one prompt, warm-up at that context) because on CUDA the
first use of each costs seconds of kernel compilation. The JSON is rewritten after every
run ("complete": false until the end), and with `--budget-s` no new run starts once the
budget is spent, so a cut run keeps what it measured.
"""

from __future__ import annotations

import collections
import gc
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from mtplxd.engine.bench.ar_reference import (
    PRIMED_TOKENS, TokenTimes, bench_params, mlx_lm_decode_times, ours_decode_times,
)
from mtplxd.engine.bench.harness import bench_parser, command_line, machine, median, write_report

PROG = "python -m mtplxd.engine.bench.ar_parity"

# Primitives that make no kernel of their own (a view or metadata change) on MLX's backends.
VIEW_PRIMITIVES = frozenset({"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Transpose",
                             "Unflatten", "Flatten", "AsStrided", "Split", "Copy", "StopGradient"})


# --- counting the work of one step -------------------------------------------------------


def kernels_in(outputs: list[mx.array]) -> dict[str, int]:
    """{primitive name: count} of the unevaluated graph behind `outputs`, views left out."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "step.dot"
        mx.export_to_dot(str(path), *outputs)
        names = re.findall(r'label ="([A-Za-z0-9_]+)', path.read_text())
    return dict(collections.Counter(name for name in names if name not in VIEW_PRIMITIVES))


def ours_stepper(trunk: Any, prompt: list[int], temperature: float
                 ) -> tuple[Callable[[], list[mx.array]], Callable[[list[mx.array]], None]]:
    """(build, advance) over our AR step after a prefill: build() returns one decode step's
    lazy outputs, advance(outputs) evaluates them and makes them the next step's inputs."""
    from mtplxd.engine.decoding.autoregressive import ar_step
    from mtplxd.engine.decoding.sampling import TokenHistory, pick_first

    params = bench_params(temperature)
    cache = trunk.make_cache()
    _, logits = trunk.prefill(prompt, cache)
    history = TokenHistory(logits.shape[-1], prompt)
    first = pick_first(logits, params, history, 0, len(prompt))
    step = ar_step(trunk, cache, params, history, 0)
    state = [mx.array([first], mx.uint32), mx.array([len(prompt) + 1], mx.uint32)]

    def build() -> list[mx.array]:
        return list(step(*state))

    def advance(outputs: list[mx.array]) -> None:
        mx.eval(outputs)
        state[:] = outputs

    return build, advance


def mlx_lm_stepper(model: Any, prompt: list[int], temperature: float
                   ) -> tuple[Callable[[], list[mx.array]], Callable[[list[mx.array]], None]]:
    """The same over mlx-lm: the body of `generate_step`'s `_step` (mlx-lm 0.32: the model,
    the last row, a log-softmax, the sampler), on its own prompt cache."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temperature, top_p=0.95 if temperature > 0 else 0.0)
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    state = [mx.argmax(logits, axis=-1)]
    mx.eval(state)

    def build() -> list[mx.array]:
        logits = model(state[0][None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return [sampler(logprobs), logprobs.squeeze(0)]

    def advance(outputs: list[mx.array]) -> None:
        mx.eval(outputs)
        state[0] = outputs[0]

    return build, advance


def step_work(stepper: tuple[Callable, Callable], builds: int = 30) -> dict[str, Any]:
    """Kernels of one steady-state step and the median host µs to build one (graph only,
    the previous step evaluated first), in this thread's CPU time: other jobs' load and the
    BLAS threads still spinning after the last step do not count."""
    build, advance = stepper
    advance(build())  # the first step after the prefill is not yet the steady state
    outputs = build()
    kernels = kernels_in(outputs)
    advance(outputs)
    times = []
    for _ in range(builds):
        start = time.thread_time()
        outputs = build()
        times.append((time.thread_time() - start) * 1e6)
        advance(outputs)
    return {"kernels_per_token": sum(kernels.values()), "kernels": kernels,
            "host_build_us": median(times)}


def sampler_kernels(vocab: int, temperature: float) -> dict[str, int]:
    """Kernels of the sampler alone on a (1, vocab) bf16 row: ours (the compiled chain) and
    mlx-lm's (`generate_step`'s log-softmax and `make_sampler`)."""
    from mlx_lm.sample_utils import make_sampler

    from mtplxd.engine.decoding.sampling import TokenHistory, row_sampler, seed_words

    params = bench_params(temperature)
    logits = mx.random.normal((1, vocab), key=mx.random.key(0)).astype(mx.bfloat16)
    counts, seen = TokenHistory(vocab, []).rows(None, 1)
    position = mx.array([7], mx.uint32)
    mx.eval(logits, counts, seen, position)
    ours = list(row_sampler(params)(logits, counts, seen, seed_words(0), position))
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    reference = [make_sampler(temperature, top_p=0.95 if temperature > 0 else 0.0)(logprobs), logprobs]
    return {"ours": sum(kernels_in(ours).values()), "mlx_lm": sum(kernels_in(reference).values())}


# --- the run -----------------------------------------------------------------------------


def _decode_runs(trunk: Any, model: Any, prompt: list[int], temperature: float, run: int,
                 tokens: int) -> dict[str, TokenTimes]:
    """One back-to-back pair: ours and mlx-lm, the first of them alternating with `run`."""
    arms = {"ours": lambda: ours_decode_times(trunk, prompt, tokens, temperature),
            "mlx_lm": lambda: mlx_lm_decode_times(model, prompt, tokens, temperature)}
    order = list(arms) if run % 2 == 0 else list(reversed(arms))
    return {name: arms[name]() for name in order}


def _summarise(runs: dict[str, list[TokenTimes]]) -> dict[str, Any]:
    """Medians, every run, and ours against mlx-lm, in wall and in CPU ms per token."""
    summary: dict[str, Any] = {}
    for clock, suffix in (("wall_ms", ""), ("cpu_ms", "_cpu")):
        values = {name: [getattr(t, clock) for t in times] for name, times in runs.items()}
        ms = {name: median(v) for name, v in values.items()}
        pairs = [m / o for o, m in zip(values["ours"], values["mlx_lm"]) if o > 0]
        summary.update({
            f"ms_per_token{suffix}_median": ms,
            f"ms_per_token{suffix}_all": {name: [round(x, 4) for x in v] for name, v in values.items()},
            f"speed_vs_mlx_lm{suffix}": ms["mlx_lm"] / ms["ours"] if ms["ours"] else 0.0,
            f"speed_vs_mlx_lm{suffix}_pairs_median": median(pairs)})
    return summary


def measure_dtype(size: str, dtype: str, *, context: int, tokens: int, repeats: int,
                  temperatures: list[float], out_of_time: Callable[[], bool],
                  save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every figure of one dtype (see the module docstring), saved after each run."""
    from mtplxd.engine.bench import real_size
    from mtplxd.engine.model.trunk import Trunk

    started = time.perf_counter()
    model, spec = real_size.build_model(size, dtype)
    trunk = Trunk(model, spec)
    vocab = trunk.text.args.vocab_size
    prompt = mx.random.randint(0, vocab, (context,), key=mx.random.key(1)).tolist()
    entry: dict[str, Any] = {"size": size, "dtype": dtype, "context": context,
                             "build_seconds": time.perf_counter() - started, "modes": {}}
    for temperature in temperatures:
        mode: dict[str, Any] = {
            "work": {"ours": step_work(ours_stepper(trunk, prompt, temperature)),
                     "mlx_lm": step_work(mlx_lm_stepper(model, prompt, temperature))},
            "sampler_kernels": sampler_kernels(vocab, temperature)}
        _decode_runs(trunk, model, prompt, temperature, 0, 4)  # warm-up at this context
        entry["modes"][str(temperature)] = mode
    runs = {str(t): {"ours": [], "mlx_lm": []} for t in temperatures}
    for run in range(repeats):
        for temperature in temperatures:
            if out_of_time():
                break
            for name, times in _decode_runs(trunk, model, prompt, temperature, run, tokens).items():
                runs[str(temperature)][name].append(times)
            entry["modes"][str(temperature)]["decode"] = _summarise(runs[str(temperature)])
            entry["runs_per_arm"] = run + 1
            entry["seconds"] = time.perf_counter() - started
            save(entry)
    del model, trunk
    gc.collect()
    mx.clear_cache()
    return entry


def _summary_line(entry: dict[str, Any]) -> str:
    parts = []
    for temperature, mode in entry["modes"].items():
        work = mode["work"]
        decode = mode.get("decode", {}).get("ms_per_token_median", {})
        parts.append(f"T={temperature}: ours {decode.get('ours', 0):.3f} ms vs mlx-lm "
                     f"{decode.get('mlx_lm', 0):.3f} ms "
                     f"({mode.get('decode', {}).get('speed_vs_mlx_lm', 0):.3f}x), kernels/token "
                     f"{work['ours']['kernels_per_token']} vs {work['mlx_lm']['kernels_per_token']}, "
                     f"host build {work['ours']['host_build_us']:.0f} vs "
                     f"{work['mlx_lm']['host_build_us']:.0f} us")
    return f"{entry['size']} {entry['dtype']}: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    from mtplxd.engine.bench.real_size import DTYPES, SIZES

    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--size", default="qwen3-4b", choices=list(SIZES))
    parser.add_argument("--dtypes", default="4bit,bf16,8bit")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64, help="timed tokens per run")
    parser.add_argument("--repeats", type=int, default=4, help="runs per arm and mode")
    parser.add_argument("--temperatures", default="0,0.6")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="start no new run after this many seconds (0: no limit)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtype: {', '.join(unknown)} (dtypes: {', '.join(DTYPES)})")
    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    started = time.perf_counter()

    def out_of_time() -> bool:
        return bool(args.budget_s) and time.perf_counter() - started > args.budget_s

    report: dict[str, Any] = {"configs": [], "complete": False, **machine(), "size": args.size,
                              "context": args.context, "tokens": args.tokens,
                              "primed_tokens": PRIMED_TOKENS, "top_p_when_sampling": 0.95,
                              "command": command_line(PROG, argv)}

    def write() -> None:
        report["seconds"] = time.perf_counter() - started
        if args.json_out:
            write_report(args.json_out, report)

    def save(entry: dict[str, Any]) -> None:
        if not any(c is entry for c in report["configs"]):
            report["configs"].append(entry)
        write()

    for dtype in dtypes:
        if out_of_time():
            print(f"{dtype}: skipped, the budget is spent", flush=True)
            continue
        entry = measure_dtype(args.size, dtype, context=args.context, tokens=args.tokens,
                              repeats=args.repeats, temperatures=temperatures,
                              out_of_time=out_of_time, save=save)
        save(entry)
        print(_summary_line(entry), flush=True)
    report["complete"] = len(report["configs"]) == len(dtypes) and all(
        c.get("runs_per_arm") == args.repeats for c in report["configs"])
    write()
    if args.json_out:
        print(f"saved {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
