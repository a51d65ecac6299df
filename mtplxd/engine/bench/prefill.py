"""Prefill speed at given prompt lengths: tokens per second over a cold cache, and the time
to the first token of a whole request.

    python -m mtplxd.engine.bench.prefill --model PATH [--tokens 8192,32768,65536]
        [--repeats 2] [--quantize auto|none|8bit|4bit] [--json-out FILE]

Each length runs `repeats` times on random token ids, each time into a fresh cache, in the
daemon's prefill chunks; the figures are medians. `tokens_per_second` is the trunk's prefill
alone; `ttft_seconds` is a one-token request through the engine's generation path (the trunk,
the MTP head filling its own cache over the prompt, the first sample), what a client waits
for before the first byte. `peak_memory_bytes` is MLX's peak while the lengths ran (weights,
the KV cache and the attention's scores of one chunk against the whole prefix). Lengths past
the model's context are measured all the same (the cost does not depend on it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from mtplxd.engine.bench.harness import (add_quantize_option, bench_parser, command_line,
                                         machine, median, write_report)

PROG = "python -m mtplxd.engine.bench.prefill"


def prompt_ids(model: Any, tokens: int) -> list[int]:
    """Random token ids (seeded by the length), clear of the vocabulary's special ends."""
    import numpy as np

    return np.random.default_rng(tokens).integers(5, model.info.vocab_size - 5, size=tokens).tolist()


def measure_prefill(model: Any, tokens: int, repeats: int) -> dict[str, Any]:
    """Median trunk prefill tokens/s and one-token request TTFT of `model` (a LoadedModel)."""
    import mlx.core as mx

    from mtplxd.engine import GenerationRequest, SamplingParams

    ids = prompt_ids(model, tokens)
    mx.reset_peak_memory()
    rates, ttfts = [], []
    for _ in range(repeats):
        cache = model.trunk.make_cache()
        started = time.perf_counter()
        _, logits = model.trunk.prefill(ids, cache)
        mx.eval(logits)
        rates.append(tokens / (time.perf_counter() - started))
        del cache, logits
        request = GenerationRequest(prompt_ids=ids, sampling=SamplingParams(temperature=0.0, max_tokens=1))
        started = time.perf_counter()
        model.complete(request)
        ttfts.append(time.perf_counter() - started)
    return {"tokens": tokens, "tokens_per_second": median(rates), "runs": rates,
            "ttft_seconds": median(ttfts), "ttft_runs": ttfts,
            "peak_memory_bytes": int(mx.get_peak_memory())}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--tokens", default="8192,32768,65536", help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=2)
    add_quantize_option(parser)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)

    from mtplxd.engine import load_model

    model = load_model(args.model, quantize=args.quantize)
    lengths = [int(n) for n in args.tokens.split(",") if n.strip()]
    report = {
        "model": model.info.to_dict(),
        "prefill": [measure_prefill(model, n, args.repeats) for n in lengths],
        **machine(),
        "command": command_line(PROG, argv),
    }
    for row in report["prefill"]:
        print(f"prefill {row['tokens']:>6} tokens: {row['tokens_per_second']:8.1f} tok/s, "
              f"first token after {row['ttft_seconds']:.2f} s, peak {row['peak_memory_bytes'] / 2**30:.2f} GiB")
    if args.json_out:
        write_report(args.json_out, report, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
