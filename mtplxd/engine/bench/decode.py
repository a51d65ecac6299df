"""AR against MTP on the same prompts, interleaved: decode speed, ratio, acceptance by depth.

    python -m mtplxd.engine.bench --model PATH [--depth 3] [--max-tokens 128]
        [--repeats 3] [--temperatures 0,0.6] [--decode-loop auto|fused|stepwise]
        [--quantize auto|none|8bit|4bit] [--json-out FILE]

For every temperature, each repeat runs every prompt twice back to back, AR then MTP, so
slow drifts of the machine (thermals, other load) hit both alike. Figures are medians over
runs; `speedup` is the ratio of the two medians. Because MTP's speed differs much from
prompt to prompt, two more ratios are kept: over all tokens (total AR decode time over total
MTP decode time: every run decodes the same number of tokens) and the median of the ratios
of the back-to-back pairs, the one that a machine's drifts disturb least. At temperature 0
the bench also checks that MTP produced exactly the AR tokens.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtplxd.engine.bench.harness import (
    PROMPTS, add_decode_options, add_dequantize_option, bench_parser, command_line, interleaved, machine,
    median, paired_speedups, prompt_ids_for, write_report,
)
from mtplxd.engine.interface import GenerationRequest, GenerationResult, SamplingParams

PROG = "python -m mtplxd.engine.bench"

@dataclass
class RunSet:
    """Results of one mode (AR or MTP) at one temperature."""

    decode_tps: list[float] = field(default_factory=list)
    prefill_tps: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    drafted_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    committed: int = 0
    cycles: int = 0
    # Per run, so that with decode_tps each run's time per cycle can be told apart from how
    # much its text let MTP accept (sampled runs differ in both).
    tokens_per_cycle: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(cls, results: list[GenerationResult]) -> "RunSet":
        """The set of `results`, in run order."""
        runs = cls()
        for result in results:
            runs.add(result)
        return runs

    def add(self, result: GenerationResult) -> None:
        """Fold one request's stats in."""
        stats = result.stats
        self.decode_tps.append(stats.decode_tokens_per_second)
        self.prefill_tps.append(stats.prefill_tokens_per_second)
        self.ttft.append(stats.ttft_seconds)
        self.tokens.append(result.token_ids)
        self.tokens_per_cycle.append(stats.mean_accepted_length)
        if stats.drafted_by_depth:
            if not self.drafted_by_depth:
                self.drafted_by_depth = [0] * len(stats.drafted_by_depth)
                self.accepted_by_depth = [0] * len(stats.drafted_by_depth)
            for i, (d, a) in enumerate(zip(stats.drafted_by_depth, stats.accepted_by_depth)):
                self.drafted_by_depth[i] += d
                self.accepted_by_depth[i] += a
            self.cycles += stats.cycles
            self.committed += round(stats.mean_accepted_length * stats.cycles)

    def summary(self) -> dict[str, Any]:
        """Medians and acceptance totals, JSON-ready."""
        acceptance = [a / d if d else 0.0 for a, d in zip(self.accepted_by_depth, self.drafted_by_depth)]
        return {
            "runs": len(self.decode_tps),
            "decode_tokens_per_second_median": median(self.decode_tps),
            "decode_tokens_per_second_all": [round(x, 2) for x in self.decode_tps],
            "prefill_tokens_per_second_median": median(self.prefill_tps),
            "ttft_seconds_median": median(self.ttft),
            "acceptance_by_depth": [round(x, 4) for x in acceptance],
            "drafted_by_depth": self.drafted_by_depth,
            "accepted_by_depth": self.accepted_by_depth,
            "mean_accepted_length": self.committed / self.cycles if self.cycles else 1.0,
            "mean_accepted_length_all": [round(x, 3) for x in self.tokens_per_cycle],
        }


def run_once(model, ids: list[int], temperature: float, depth: int, max_tokens: int, seed: int) -> GenerationResult:
    """One request as the bench sends it: ignore_eos, top-p 0.95 when sampling, `seed`."""
    # ignore_eos: every run decodes max_tokens, so speeds compare like for like.
    sampling = SamplingParams(temperature=temperature, top_p=0.95 if temperature > 0 else 1.0,
                              seed=seed, max_tokens=max_tokens, ignore_eos=True)
    return model.complete(GenerationRequest(ids, sampling, depth=depth))


def _arm(model, temperature: float, depth: int, max_tokens: int):
    """One side of the comparison: run(ids, repeat, index) -> its result (depth 0: AR)."""
    return lambda ids, repeat, index: run_once(model, ids, temperature, depth, max_tokens, 1000 * repeat + index)


def run_bench(model, *, depth: int, max_tokens: int, repeats: int,
              temperatures: list[float], prompts: tuple[str, ...] = PROMPTS) -> dict[str, Any]:
    """Run AR and MTP interleaved on every prompt; return the JSON-ready report."""
    prompt_ids = [prompt_ids_for(model.tokenizer, p) for p in prompts]
    report: dict[str, Any] = {"temperatures": {}}
    for temperature in temperatures:
        # Warm-up: a temperature's first request compiles its graphs (on CUDA, JIT kernels
        # for tens of seconds); first-call costs stay out of the figures.
        run_once(model, prompt_ids[0], temperature, 0, 8, 0)
        run_once(model, prompt_ids[0], temperature, depth, 8, 0)
        # Each prompt runs AR then MTP back to back, both with the same seed.
        arms = [_arm(model, temperature, d, max_tokens) for d in (0, depth)]
        ar, mtp = (RunSet.of(results) for results in interleaved(prompt_ids, repeats, arms))
        ar_summary, mtp_summary = ar.summary(), mtp.summary()
        ar_tps = ar_summary["decode_tokens_per_second_median"]
        entry = {
            "ar": ar_summary,
            "mtp": mtp_summary,
            "speedup": mtp_summary["decode_tokens_per_second_median"] / ar_tps if ar_tps else 0.0,
            **paired_speedups(ar.decode_tps, mtp.decode_tps),
        }
        if temperature == 0:
            entry["greedy_identical"] = ar.tokens == mtp.tokens
        report["temperatures"][str(temperature)] = entry
    return report


def bench_table(report: dict[str, Any]) -> Any:
    """The report as a rich Table that fits 80 columns: headers wrap between words and a long
    acceptance list folds, where one-line columns would end in an ellipsis."""
    from rich.table import Table

    info = report["model"]
    table = Table(title=f"{info['id']} ({info['family']}, {info['quantization'] or 'float'}) "
                        f"depth {report['depth']}, {report['max_tokens']} tokens x "
                        f"{report['runs_per_mode']} runs, {report['decode_loop']} loop, device {report['device']}")
    for column in ("T", "AR tok/s", "MTP tok/s", "MTP/AR", "acceptance by depth",
                   "tokens per cycle", "greedy MTP == AR"):
        table.add_column(column, justify="right", overflow="fold")
    for temperature, entry in report["temperatures"].items():
        table.add_row(
            temperature,
            f"{entry['ar']['decode_tokens_per_second_median']:.1f}",
            f"{entry['mtp']['decode_tokens_per_second_median']:.1f}",
            f"{entry['speedup']:.2f}x",
            " ".join(f"{a:.0%}" for a in entry["mtp"]["acceptance_by_depth"]),  # wraps between depths
            f"{entry['mtp']['mean_accepted_length']:.2f}",
            {True: "yes", False: "NO"}.get(entry.get("greedy_identical"), "-"),
        )
    return table


def _print_table(report: dict[str, Any]) -> None:
    from rich.console import Console

    table = bench_table(report)
    console = Console()
    console.print(table)
    for temperature, entry in report["temperatures"].items():
        console.print(f"T={temperature}: MTP/AR {entry['speedup_all_tokens']:.2f}x over all tokens; "
                      f"back-to-back pairs median {entry['speedup_pairs_median']:.2f}x, "
                      f"lowest {entry['speedup_pairs_min']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    add_decode_options(parser)
    add_dequantize_option(parser)
    parser.add_argument("--json-out", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)

    from mtplxd.engine.loaded_model import load_model

    started = time.perf_counter()
    model = load_model(args.model, decode_loop=args.decode_loop, quantize=args.quantize,
                       dequantize_weights=args.dequantize)
    load_seconds = time.perf_counter() - started
    if model.info.mode != "mtp":
        print(f"{model.info.id} is served AR ({model.info.ar_reason}); nothing to compare", file=sys.stderr)
        return 2
    depth = model.info.depth if args.depth is None else args.depth
    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    report = run_bench(model, depth=depth, max_tokens=args.max_tokens, repeats=args.repeats,
                       temperatures=temperatures)
    report.update({
        "model": model.info.to_dict(),
        "depth": depth,
        "decode_loop": model.trunk.decode_loop,
        "max_tokens": args.max_tokens,
        "runs_per_mode": args.repeats * len(PROMPTS),
        "load_seconds": load_seconds,
        **machine(),
        "command": command_line(PROG, argv),
    })
    _print_table(report)
    if args.json_out:
        write_report(args.json_out, report, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
