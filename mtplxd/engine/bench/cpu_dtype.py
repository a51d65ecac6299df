"""A quantized model in the three forms the Linux CPU can serve it, decoding the same prompts:
"dense" (its weights dequantized to float32 at load: the default where they fit,
loader.dequantize), "packed" (packed weights, float32 scales and activations: `dequantize =
"off"`) and "checkpoint" (packed, in the checkpoint's own dtype: `compute="checkpoint"`).

    python -m mtplxd.engine.bench.cpu_dtype --model PATH [--quantize 4bit] [--depth 3]
        [--arms dense,packed,checkpoint] [--max-tokens 32] [--repeats 2] [--json-out FILE]

Why: MLX's CPU backend computes a quantized matmul in its activations' dtype and loops over
its rows, and has a BLAS path only for float32 (engine.md, "BLAS on the Linux CPU"). The
arms are loaded once and run interleaved, greedy, over the bench's prompt set
(harness.PROMPTS), AR and MTP at `--depth` (by default the depth the first arm is served at,
or the recommended one where that is 0), with `ignore_eos` so every run decodes
`--max-tokens` tokens. Per arm: its `quantization` label, `dtype`, resident `weights_bytes`,
decode tok/s (median over runs) and its runs' tokens; `ratios` gives each arm's medians over
the last arm's. `--quantize 4bit` quantizes an unquantized checkpoint as it loads (its
scales in the checkpoint's dtype, as a quantized checkpoint ships them).
"""

from __future__ import annotations

import sys
from typing import Any

from mtplxd.engine.bench.harness import (
    PROMPTS, add_quantize_option, bench_parser, command_line, interleaved, machine, median,
    prompt_ids_for, write_report,
)

PROG = "python -m mtplxd.engine.bench.cpu_dtype"
# Each arm's load_model options.
ARMS: dict[str, dict[str, str]] = {
    "dense": {"compute": "auto", "dequantize_weights": "on"},
    "packed": {"compute": "auto", "dequantize_weights": "off"},
    "checkpoint": {"compute": "checkpoint", "dequantize_weights": "off"},
}


def measure(path: str, quantize: str, depth: int | None, max_tokens: int, repeats: int,
            arms: list[str] | None = None) -> dict[str, Any]:
    """The arms' decode rates, AR and MTP, interleaved over the prompt set."""
    from mtplxd.engine import GenerationRequest, SamplingParams, load_model
    from mtplxd.engine.model.loader import recommended_depth

    arms = arms or list(ARMS)
    models = {arm: load_model(path, quantize=quantize, **ARMS[arm]) for arm in arms}
    first = models[arms[0]]
    if depth is None:
        depth = first.info.depth or (recommended_depth({}) if first.head is not None else 0)
    prompts = [prompt_ids_for(first.tokenizer, text) for text in PROMPTS]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    report: dict[str, Any] = {"model": first.info.id, "depth": depth, "max_tokens": max_tokens,
                              "arms": {}, "ratios": {}}
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

        runs = interleaved(prompts, repeats, [arm(models[name]) for name in arms])
        for name, results in zip(arms, runs):
            info = models[name].info
            entry = report["arms"].setdefault(name, {"quantization": info.quantization, "dtype": info.dtype,
                                                     "weights_bytes": info.weights_bytes})
            entry[label] = {"tokens_per_s": median(rate for rate, _ in results),
                            "runs_tokens": [ids for _, ids in results]}
        base = report["arms"][arms[-1]][label]["tokens_per_s"]
        report["ratios"][label] = {
            f"{name}_over_{arms[-1]}": report["arms"][name][label]["tokens_per_s"] / base if base else 0.0
            for name in arms[:-1]}
    return report


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--depth", type=int, default=None, help="MTP depth (default: the model's)")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"which forms, the last the ratios' base (of {', '.join(ARMS)})")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompt set")
    parser.add_argument("--json-out", default=None)
    add_quantize_option(parser)
    args = parser.parse_args(argv)
    arms = [arm for arm in args.arms.split(",") if arm]
    if len(arms) < 2 or len(set(arms)) < len(arms) or not set(arms) <= set(ARMS):
        parser.error(f"--arms takes two or three different forms of {', '.join(ARMS)}")
    report = measure(args.model, args.quantize, args.depth, args.max_tokens, args.repeats, arms)
    report.update(machine(), command=command_line(PROG, argv))
    for label, ratios in report["ratios"].items():
        rates = ", ".join(f"{name} {report['arms'][name][label]['tokens_per_s']:.2f}" for name in arms)
        shown = ", ".join(f"{key.replace('_', ' ')} {value:.2f}x" for key, value in ratios.items())
        print(f"{label} tok/s: {rates} ({shown})")
    if args.json_out:
        write_report(args.json_out, report, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
