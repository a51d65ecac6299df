"""What the flight recorder's draft/verify split costs decode: MTP with the split's timed
cycle (one per sample window, decoding/split.py) against MTP without it, interleaved.

    python -m mtplxd.engine.bench.split_cost --model PATH [--depth 3] [--max-tokens 256]
        [--repeats 3] [--temperatures 0,0.6] [--decode-loop auto|fused|stepwise]
        [--quantize auto|none|8bit|4bit] [--json-out FILE]

Each prompt runs twice back to back, split on then off, with the same seed, so drifts of the
machine hit both alike. `ratio_*` are on/off (1.0: no cost): over all tokens, and the median
and lowest of the back-to-back pairs. The report also keeps the split the "on" runs recorded
(per-cycle draft and verify ms, mean over their timed cycles) and whether both sides produced
the same tokens (they must: a timed cycle computes what an untimed one does).
"""

from __future__ import annotations

import sys
from typing import Any

import mtplxd.engine.generation as generation
from mtplxd.engine.bench.decode import run_once
from mtplxd.engine.bench.harness import (
    PROMPTS, add_decode_options, bench_parser, command_line, interleaved, machine, median,
    paired_speedups, prompt_ids_for, write_report,
)
from mtplxd.engine.interface import GenerationResult

PROG = "python -m mtplxd.engine.bench.split_cost"


def _run(model, ids: list[int], temperature: float, depth: int, max_tokens: int, seed: int,
         split: bool) -> GenerationResult:
    """decode.py's run (ignore_eos, the same sampling), with the timed cycles on or off."""
    generation.TIME_SAMPLED_CYCLES = split
    try:
        return run_once(model, ids, temperature, depth, max_tokens, seed)
    finally:
        generation.TIME_SAMPLED_CYCLES = True


def _split_means(results: list[GenerationResult]) -> dict[str, Any]:
    """Draft and verify ms per timed cycle over every sample of `results`."""
    timed = [s for r in results for s in r.stats.samples if s.get("split_cycles")]
    cycles = sum(s["split_cycles"] for s in timed)
    if not cycles:
        return {"timed_cycles": 0}
    return {"timed_cycles": cycles, "all_cycles": sum(r.stats.cycles for r in results),
            **{key: round(sum(s[key] * s["split_cycles"] for s in timed) / cycles, 3)
               for key in ("draft_ms", "verify_ms")}}


def run_bench(model, *, depth: int, max_tokens: int, repeats: int,
              temperatures: list[float]) -> dict[str, Any]:
    """Split on against off at each temperature; the JSON-ready report."""
    prompt_ids = [prompt_ids_for(model.tokenizer, p) for p in PROMPTS]
    report: dict[str, Any] = {"temperatures": {}}
    for temperature in temperatures:
        for split in (True, False):  # warm-up: the first request of each side compiles
            _run(model, prompt_ids[0], temperature, depth, 8, 0, split)
        arms = [lambda ids, repeat, index, split=split: _run(
            model, ids, temperature, depth, max_tokens, 1000 * repeat + index, split)
            for split in (True, False)]
        on, off = interleaved(prompt_ids, repeats, arms)
        on_tps = [r.stats.decode_tokens_per_second for r in on]
        off_tps = [r.stats.decode_tokens_per_second for r in off]
        ratios = paired_speedups(off_tps, on_tps)  # "speedup" of on over off
        report["temperatures"][str(temperature)] = {
            "split_on_tok_s_median": round(median(on_tps), 2),
            "split_off_tok_s_median": round(median(off_tps), 2),
            "split_on_tok_s_all": [round(x, 2) for x in on_tps],
            "split_off_tok_s_all": [round(x, 2) for x in off_tps],
            "ratio_all_tokens": round(ratios["speedup_all_tokens"], 4),
            "ratio_pairs_median": round(ratios["speedup_pairs_median"], 4),
            "ratio_pairs_min": round(ratios["speedup_pairs_min"], 4),
            "same_tokens": [r.token_ids for r in on] == [r.token_ids for r in off],
            "split": _split_means(on),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    add_decode_options(parser, max_tokens=256)
    parser.add_argument("--json-out", default=None, help="write the report here")
    args = parser.parse_args(argv)

    from mtplxd.engine.loaded_model import load_model

    model = load_model(args.model, decode_loop=args.decode_loop, quantize=args.quantize)
    if model.info.mode != "mtp":
        print(f"{model.info.id} is served AR ({model.info.ar_reason}): it drafts nothing", file=sys.stderr)
        return 2
    depth = model.info.depth if args.depth is None else args.depth
    report = run_bench(model, depth=depth, max_tokens=args.max_tokens, repeats=args.repeats,
                       temperatures=[float(t) for t in args.temperatures.split(",") if t.strip()])
    report.update({"model": model.info.id, "depth": depth, "decode_loop": model.trunk.decode_loop,
                   "max_tokens": args.max_tokens, "runs_per_side": args.repeats * len(PROMPTS),
                   **machine(), "command": command_line(PROG, argv)})
    for temperature, entry in report["temperatures"].items():
        print(f"T={temperature}: split on {entry['split_on_tok_s_median']:.1f} tok/s, off "
              f"{entry['split_off_tok_s_median']:.1f} tok/s; on/off {entry['ratio_all_tokens']:.3f} "
              f"over all tokens, pairs median {entry['ratio_pairs_median']:.3f}; split "
              f"{entry['split']}; same tokens: {entry['same_tokens']}")
    if args.json_out:
        write_report(args.json_out, report, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
