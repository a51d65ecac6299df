"""A model as served on this backend (`compute="auto"`: float32 on the Linux CPU) beside the
same model in its checkpoint's dtype (`compute="checkpoint"`), decoding the same prompts.

    python -m mtplxd.engine.bench.cpu_dtype --model PATH [--quantize 4bit] [--depth 3]
        [--max-tokens 32] [--repeats 2] [--json-out FILE]

Why: MLX's CPU backend computes a quantized matmul in its activations' dtype, and has a BLAS
path only for float32 (engine.md, "BLAS on the Linux CPU"). Since 2026-12-04 the Linux CPU
serves quantized checkpoints in float32 too (loader.compute_dtype); this measures what that
buys a whole model. Both arms are loaded once and run interleaved, greedy, over the bench's
prompt set (harness.PROMPTS), AR and MTP at `--depth` (the model's by default), with
`ignore_eos` so every run decodes `--max-tokens` tokens. Per arm: its `dtype`, resident
`weights_bytes`, decode tok/s (median over runs) and its runs' tokens; `float32_over_checkpoint`
is the ratio of the medians. `--quantize 4bit` quantizes an unquantized checkpoint as it
loads (its scales in the checkpoint's dtype, as a quantized checkpoint ships them).
"""

from __future__ import annotations

import sys
from typing import Any

from mtplxd.engine.bench.harness import (
    PROMPTS, add_quantize_option, bench_parser, command_line, interleaved, machine, median,
    prompt_ids_for, write_report,
)

PROG = "python -m mtplxd.engine.bench.cpu_dtype"
ARMS = ("auto", "checkpoint")


def measure(path: str, quantize: str, depth: int | None, max_tokens: int, repeats: int) -> dict[str, Any]:
    """Both arms' decode rates, AR and MTP, interleaved over the prompt set."""
    from mtplxd.engine import GenerationRequest, SamplingParams, load_model

    models = {arm: load_model(path, quantize=quantize, compute=arm) for arm in ARMS}
    first = models["auto"]
    depth = first.info.depth if depth is None else depth
    prompts = [prompt_ids_for(first.tokenizer, text) for text in PROMPTS]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    report: dict[str, Any] = {"model": first.info.id, "quantization": first.info.quantization,
                              "depth": depth, "max_tokens": max_tokens, "arms": {}}
    for label, request_depth in (("ar", 0), ("mtp", depth)):
        if request_depth and first.head is None:
            continue
        for model in models.values():  # warm-up: first-call costs stay out of the figures
            model.complete(GenerationRequest(prompts[0], sampling, depth=request_depth))

        def arm(model):
            def run(prompt, _repeat, _index):
                result = model.complete(GenerationRequest(prompt, sampling, depth=request_depth))
                return result.stats.decode_tokens_per_second, result.token_ids
            return run

        runs = interleaved(prompts, repeats, [arm(models[name]) for name in ARMS])
        for name, results in zip(ARMS, runs):
            entry = report["arms"].setdefault(name, {"dtype": models[name].info.dtype,
                                                     "weights_bytes": models[name].info.weights_bytes})
            entry[label] = {"tokens_per_s": median(rate for rate, _ in results),
                            "runs_tokens": [ids for _, ids in results]}
        auto, kept = (report["arms"][name][label]["tokens_per_s"] for name in ARMS)
        report[f"{label}_float32_over_checkpoint"] = auto / kept if kept else 0.0
    return report


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--depth", type=int, default=None, help="MTP depth (default: the model's)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompt set")
    parser.add_argument("--json-out", default=None)
    add_quantize_option(parser)
    args = parser.parse_args(argv)
    report = measure(args.model, args.quantize, args.depth, args.max_tokens, args.repeats)
    report.update(machine(), command=command_line(PROG, argv))
    for label in ("ar", "mtp"):
        if f"{label}_float32_over_checkpoint" in report:
            rates = {name: round(report["arms"][name][label]["tokens_per_s"], 2) for name in ARMS}
            print(f"{label}: {rates['auto']} tok/s as served ({report['arms']['auto']['dtype']}), "
                  f"{rates['checkpoint']} in {report['arms']['checkpoint']['dtype']}: "
                  f"{report[f'{label}_float32_over_checkpoint']:.2f}x")
    if args.json_out:
        write_report(args.json_out, report, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
