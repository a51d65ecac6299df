"""Our AR decode against stock mlx-lm's `generate_step` on the same weights, interleaved.

    python -m mtplxd.engine.bench.ar_reference --model PATH [--tokens 256] [--repeats 3]
        [--temperatures 0,0.6] [--quantize auto|none|8bit|4bit] [--json-out FILE]

Three arms decode the same prompts back to back (which arm goes first rotates from prompt
to prompt), each `--tokens` tokens after the first
(top-p 0.95 when sampling, as the decode bench): `ours` (autoregressive.ar_cycles: the
compiled sampler chain, device-side keys, no penalty history without penalties), `ours_before`
(the same loop with the per-token sampler as it was before: the uncompiled `pick`, a key made
on the host, the history recorded every token) and `mlx_lm` (mlx-lm's pipelined
`generate_step` with `make_sampler`). Each figure is the decode time per token (the first
token, which comes from the prefill, and two more that fill each loop's pipeline, excluded);
`speed_vs_mlx_lm` is mlx-lm's median ms per token over ours (above 1: ours is faster).
`sampler_us_median` times the three samplers alone on a random row of the model's
vocabulary (interleaved, 50 x 20 calls). Also callable from other benches:
`mlx_lm_decode_ms`, `ours_decode_ms` (wall ms), and `*_decode_times` (wall and CPU ms).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import mlx.core as mx

from mtplxd.engine.bench.harness import (
    PROMPTS, add_quantize_option, bench_parser, command_line, machine, median,
    prompt_ids_for, write_report,
)
from mtplxd.engine.interface import SamplingParams

PROG = "python -m mtplxd.engine.bench.ar_reference"


def bench_params(temperature: float) -> SamplingParams:
    """The sampling settings the AR benches decode with (top-p 0.95 when sampling)."""
    return SamplingParams(temperature=temperature, top_p=0.95 if temperature > 0 else 1.0)


# Tokens each loop decodes untimed before its timed ones. Why: when it hands over its first
# token, mlx-lm's generate_step already has the next step on the device, while our loop
# (after `pick_first`) starts from an idle device; two untimed tokens put both pipelines in
# their steady state, so neither arm's figure carries a start-up step (1/16 of a 16-token run).
PRIMED_TOKENS = 2


class TokenTimes(NamedTuple):
    """Per decoded token: wall ms, and CPU ms of this whole process (every thread). On a
    shared CPU the second moves far less with other jobs' load than the first."""

    wall_ms: float
    cpu_ms: float


def _timed_tokens(tokens: Iterator[Any], count: int) -> TokenTimes:
    """Time per token over `count` items of `tokens` (each read back to the host), after
    PRIMED_TOKENS untimed ones."""
    for _ in range(PRIMED_TOKENS):
        next(tokens)
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        next(tokens)
    return TokenTimes((time.perf_counter() - start) * 1000 / count,
                      (time.process_time() - start_cpu) * 1000 / count)


def mlx_lm_decode_times(model: Any, prompt: list[int], tokens: int, temperature: float) -> TokenTimes:
    """Time per decoded token of stock mlx-lm `generate_step` (its own cache and sampler)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temperature, top_p=0.95 if temperature > 0 else 0.0)
    steps = generate_step(mx.array(prompt), model, max_tokens=tokens + 1 + PRIMED_TOKENS,
                          sampler=sampler)
    next(steps)  # the prefill and the first token
    times = _timed_tokens(steps, tokens)  # it yields each token read back (an int)
    steps.close()
    return times


def mlx_lm_decode_ms(model: Any, prompt: list[int], tokens: int, temperature: float) -> float:
    """Wall ms per decoded token of stock mlx-lm `generate_step`."""
    return mlx_lm_decode_times(model, prompt, tokens, temperature).wall_ms


def ours_decode_times(trunk: Any, prompt: list[int], tokens: int, temperature: float, *,
                      before: bool = False) -> TokenTimes:
    """Time per decoded token of our AR loop as served (autoregressive.ar_cycles, or the
    compiled fused_ar loop where fused_ar_wanted) after a prefill; `before`: the op-by-op
    loop with the per-token sampler as it was before it was compiled."""
    from mtplxd.engine.decoding import autoregressive
    from mtplxd.engine.decoding.fused_ar import fused_ar_cycles, fused_ar_wanted
    from mtplxd.engine.decoding.sampling import TokenHistory, pick_first

    params = bench_params(temperature)
    cache = trunk.make_cache()
    _, logits = trunk.prefill(prompt, cache)
    history = TokenHistory(logits.shape[-1], prompt)
    first = pick_first(logits, params, history, 0, len(prompt))
    if before:
        loop = _before_cycles
    else:
        loop = fused_ar_cycles if fused_ar_wanted(trunk, cache, len(prompt)) else autoregressive.ar_cycles
    cycles = loop(trunk, cache, params, history, 0, first, len(prompt))
    times = _timed_tokens(cycles, tokens)
    cycles.close()
    return times


def ours_decode_ms(trunk: Any, prompt: list[int], tokens: int, temperature: float, *,
                   before: bool = False) -> float:
    """Wall ms per decoded token of our AR loop (see `ours_decode_times`)."""
    return ours_decode_times(trunk, prompt, tokens, temperature, before=before).wall_ms


def _before_cycles(trunk, cache, params, history, seed, last_token, position) -> Iterator[list[int]]:
    """The AR loop with the sampler as it was before it was compiled: `pick` with a host-made
    key, the history appended every token (the reference arm `ours_before`)."""
    from mtplxd.engine.decoding.sampling import TARGET, pick, position_key

    def step(token, position):
        _, logits = trunk.forward(token.reshape(1, 1), cache, all_logits=True)
        counts, seen = history.rows(None, 1)
        keys = None if params.greedy else [position_key(seed, position, TARGET)]
        chosen = pick(logits[0], params, counts, seen, keys)
        history.append(chosen)
        return chosen

    position += 1
    pending = step(mx.array([last_token]), position)
    mx.async_eval(pending)
    while True:
        current = pending
        position += 1
        pending = step(current, position)
        mx.async_eval(pending)
        yield [current.item()]


def sampler_us(vocab: int, temperature: float, repeats: int = 50, calls: int = 20) -> dict[str, float]:
    """Microseconds per sampled token of the sampler alone, on a random (1, vocab) row, for
    each arm: ours (the compiled chain), ours_before (`pick` with a host key and the history
    appended) and mlx-lm (`make_sampler` on log-probabilities, as generate_step calls it).
    Decode times on a loaded CPU swing by 2x; this isolates what the change touched."""
    from mlx_lm.sample_utils import make_sampler

    from mtplxd.engine.decoding.sampling import (
        TARGET, TokenHistory, pick, position_key, row_sampler, seed_words,
    )

    params = bench_params(temperature)
    logits = mx.random.normal((1, vocab), key=mx.random.key(3)) * 4
    history = TokenHistory(vocab, [1, 2, 3])
    counts, seen = history.rows(None, 1)
    mx.eval(logits, counts, seen)
    sample, words = row_sampler(params), seed_words(0)
    reference = make_sampler(temperature, top_p=0.95 if temperature > 0 else 0.0)
    position = mx.array([7], mx.uint32)

    def ours():
        nonlocal position
        token, position = sample(logits, counts, seen, words, position)
        return token

    def before():
        keys = None if params.greedy else [position_key(0, 7, TARGET)]
        token = pick(logits, params, *history.rows(None, 1), keys)
        history.append(token)
        return token

    def mlx_lm():
        return reference(logits - mx.logsumexp(logits, keepdims=True))

    arms = {"ours": ours, "ours_before": before, "mlx_lm": mlx_lm}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for repeat in range(repeats + 3):  # interleaved; the first 3 rounds are warm-up
        for name, arm in arms.items():
            start = time.perf_counter()
            for _ in range(calls):
                mx.eval(arm())
            if repeat >= 3:
                times[name].append((time.perf_counter() - start) * 1e6 / calls)
    return {name: median(values) for name, values in times.items()}


ARMS: dict[str, Callable[[Any, list[int], int, float], float]] = {
    "ours": lambda loaded, ids, n, t: ours_decode_ms(loaded.trunk, ids, n, t),
    "ours_before": lambda loaded, ids, n, t: ours_decode_ms(loaded.trunk, ids, n, t, before=True),
    "mlx_lm": lambda loaded, ids, n, t: mlx_lm_decode_ms(loaded.model, ids, n, t),
}


def _rotated(loaded: Any, prompt_ids: list[list[int]], repeats: int, tokens: int,
             temperature: float) -> dict[str, list[float]]:
    """Every arm on every prompt, back to back, each prompt starting with the next arm in
    turn, so what a run leaves behind (MLX's buffer cache, a burst of load on a shared
    machine) does not always land on the same arm."""
    names = list(ARMS)
    results: dict[str, list[float]] = {name: [] for name in names}
    turn = 0
    for _ in range(repeats):
        for ids in prompt_ids:
            for k in range(len(names)):
                name = names[(turn + k) % len(names)]
                results[name].append(ARMS[name](loaded, ids, tokens, temperature))
            turn += 1
    return results


def run_bench(loaded: Any, *, tokens: int, repeats: int, temperatures: list[float],
              prompts: tuple[str, ...] = PROMPTS) -> dict[str, Any]:
    """Every arm on every prompt, interleaved; JSON-ready medians and ratios per temperature."""
    prompt_ids = [prompt_ids_for(loaded.tokenizer, p) for p in prompts]
    report: dict[str, Any] = {}
    for temperature in temperatures:
        for arm in ARMS.values():  # warm-up: compile this temperature's graphs and kernels
            arm(loaded, prompt_ids[0], 8, temperature)
        results = _rotated(loaded, prompt_ids, repeats, tokens, temperature)
        ms = {name: median(values) for name, values in results.items()}
        pairs = [m / o for o, m in zip(results["ours"], results["mlx_lm"])]
        report[str(temperature)] = {
            "sampler_us_median": sampler_us(loaded.info.vocab_size, temperature),
            "ms_per_token_median": ms,
            "ms_per_token_all": {name: [round(v, 4) for v in values] for name, values in results.items()},
            "tokens_per_second_median": {name: 1000 / v if v else 0.0 for name, v in ms.items()},
            "speed_vs_mlx_lm": ms["mlx_lm"] / ms["ours"] if ms["ours"] else 0.0,
            "speed_vs_mlx_lm_pairs_median": median(pairs),
            "speed_vs_before": ms["ours_before"] / ms["ours"] if ms["ours"] else 0.0,
        }
    return report


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--tokens", type=int, default=256, help="decoded tokens per run")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the prompt set")
    parser.add_argument("--temperatures", default="0,0.6")
    parser.add_argument("--json-out", type=Path, default=None)
    add_quantize_option(parser)
    args = parser.parse_args(argv)

    from mtplxd.engine.loaded_model import load_model

    loaded = load_model(args.model, quantize=args.quantize)
    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    report = {"temperatures": run_bench(loaded, tokens=args.tokens, repeats=args.repeats,
                                        temperatures=temperatures),
              "model": loaded.info.to_dict(), "tokens": args.tokens,
              "runs_per_arm": args.repeats * len(PROMPTS), **machine(),
              "command": command_line(PROG, argv)}
    for temperature, entry in report["temperatures"].items():
        ms, alone = entry["ms_per_token_median"], entry["sampler_us_median"]
        print(f"T={temperature}: sampler alone, us/token: ours {alone['ours']:.1f}, before "
              f"{alone['ours_before']:.1f}, mlx-lm {alone['mlx_lm']:.1f}")
        print(f"T={temperature}: ms/token ours {ms['ours']:.3f}, before {ms['ours_before']:.3f}, "
              f"mlx-lm {ms['mlx_lm']:.3f}; ours vs mlx-lm {entry['speed_vs_mlx_lm']:.3f}x "
              f"(pairs median {entry['speed_vs_mlx_lm_pairs_median']:.3f}x), "
              f"vs before {entry['speed_vs_before']:.3f}x")
    if args.json_out:
        write_report(args.json_out, report, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
