"""What the runaway-loop guard costs a healthy stream: inter-token gaps with it on and off.

    python -m mtplxd.engine.bench.loop_guard --model PATH [--max-tokens 256] [--repeats 3]
        [--depth N] [--temperature 0.8] [--json-out FILE]

Each repeat runs every bench prompt twice back to back, guard off then on, with the same
seed (ignore_eos, so every run decodes --max-tokens tokens). Per run it records when each
streamed delta left the engine, and reports per arm the median of the runs' largest gap
between deltas, the median gap, and decode tokens/s, plus the on/off ratios of those
medians. The output (token ids and text) of the two arms must be identical; the deltas are
too, except in runs where the model repeated a span of `hold_tokens` tokens (listed as
`held_runs`: the guard held that text until the repetition broke). Runs the guard stopped
are counted (sampled text from a real model should have none).
"""

from __future__ import annotations

import sys
from dataclasses import asdict
import time
from typing import Any

from mtplxd.engine.bench.harness import (
    PROMPTS, bench_parser, command_line, interleaved, machine, median, prompt_ids_for, write_report,
)
from mtplxd.engine.interface import (
    GenerationRequest, GenerationResult, RepetitionPolicy, SamplingParams, TokenDelta,
)

PROG = "python -m mtplxd.engine.bench.loop_guard"


def timed_run(model: Any, prompt: list[int], guard: RepetitionPolicy | None, max_tokens: int,
              depth: int | None, temperature: float, seed: int) -> dict[str, Any]:
    """One generation: its deltas, the gaps between them (seconds), its stats."""
    request = GenerationRequest(prompt, SamplingParams(temperature=temperature, seed=seed,
                                                       max_tokens=max_tokens, ignore_eos=True),
                                depth=depth, repetition=guard)
    deltas, stamps, result = [], [], None
    for item in model.generate(request):
        if isinstance(item, TokenDelta):
            stamps.append(time.perf_counter())
            deltas.append((list(item.token_ids), item.text))
        elif isinstance(item, GenerationResult):
            result = item
    assert result is not None
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"deltas": deltas, "gaps": gaps, "decode_tps": result.stats.decode_tokens_per_second,
            "repetition_stop": result.stats.repetition_stop}


def measure(model_path: str, max_tokens: int, repeats: int, depth: int | None,
            temperature: float) -> dict[str, Any]:
    """Run the bench (see the module docstring); returns the report."""
    from mtplxd.engine import load_model

    model = load_model(model_path)
    prompts = [prompt_ids_for(model.tokenizer, text) for text in PROMPTS]
    guard = RepetitionPolicy()
    timed_run(model, prompts[0], guard, 16, depth, temperature, 0)  # warm-up

    def arm(policy: RepetitionPolicy | None):
        return lambda prompt, repeat, index: timed_run(model, prompt, policy, max_tokens, depth,
                                                       temperature, 1000 * repeat + index)

    off, on = interleaved(prompts, repeats, [arm(None), arm(guard)])
    report: dict[str, Any] = {"model": model.info.id, "depth": depth if depth is not None else model.info.depth,
                              "max_tokens": max_tokens, "temperature": temperature, "repeats": repeats,
                              "policy": asdict(guard),
                              "identical_output": all(_ids(a) == _ids(b) and _text(a) == _text(b)
                                                      for a, b in zip(off, on)),
                              "identical_streams": all(a["deltas"] == b["deltas"] for a, b in zip(off, on)),
                              # Runs whose deltas were cut differently: the guard held text while
                              # a span repeated, then released it when the repetition broke.
                              "held_runs": [
                                  {"run": i, "same_tokens": _ids(a) == _ids(b), "same_text": _text(a) == _text(b),
                                   "off_deltas": len(a["deltas"]), "on_deltas": len(b["deltas"])}
                                  for i, (a, b) in enumerate(zip(off, on)) if a["deltas"] != b["deltas"]],
                              "runs": len(off)}
    for name, runs in (("off", off), ("on", on)):
        report[name] = {
            "max_gap_ms_median": 1000 * median(max(r["gaps"], default=0.0) for r in runs),
            "gap_ms_median": 1000 * median(g for r in runs for g in r["gaps"]),
            "decode_tps_median": median(r["decode_tps"] for r in runs),
            "repetition_stops": sum(r["repetition_stop"] for r in runs),
            "max_gap_ms_per_run": [round(1000 * max(r["gaps"], default=0.0), 3) for r in runs],
        }
    for key in ("max_gap_ms_median", "gap_ms_median", "decode_tps_median"):
        base = report["off"][key]
        report[f"{key}_on_over_off"] = report["on"][key] / base if base else 0.0
    return report


def _ids(run: dict[str, Any]) -> list[int]:
    return [t for ids, _ in run["deltas"] for t in ids]


def _text(run: dict[str, Any]) -> str:
    return "".join(text for _, text in run["deltas"])


def main(argv: list[str] | None = None) -> int:
    """Command line: run, print a summary, save JSON."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    report = measure(args.model, args.max_tokens, args.repeats, args.depth, args.temperature)
    report["machine"] = machine()
    report["command"] = command_line(PROG, argv)
    for name in ("off", "on"):
        arm = report[name]
        print(f"guard {name:3}: max gap {arm['max_gap_ms_median']:.2f} ms (median of {report['runs']} runs), "
              f"gap {arm['gap_ms_median']:.2f} ms, {arm['decode_tps_median']:.1f} tok/s, "
              f"{arm['repetition_stops']} stopped")
    print(f"on/off: max gap x{report['max_gap_ms_median_on_over_off']:.3f}, "
          f"decode x{report['decode_tps_median_on_over_off']:.3f}; identical output: "
          f"{report['identical_output']}; runs with held text: {len(report['held_runs'])}")
    if args.json_out:
        write_report(args.json_out, report, announce=True)
    return 0 if report["identical_output"] else 1


if __name__ == "__main__":
    sys.exit(main())
