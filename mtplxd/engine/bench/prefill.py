"""Prefill speed at given prompt lengths: tokens per second of the trunk over a cold cache.

    python -m mtplxd.engine.bench.prefill --model PATH [--tokens 1024,4096,16384]
        [--repeats 2] [--json-out FILE]

Each length runs `repeats` times on random token ids, each time into a fresh cache, in the
daemon's prefill chunks; the figure is the median. Lengths past the model's trained context
are measured all the same (the cost of the computation does not depend on it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from mtplxd.engine.bench.harness import bench_parser, command_line, machine, median, write_report

PROG = "python -m mtplxd.engine.bench.prefill"


def measure_prefill(model: Any, tokens: int, repeats: int) -> dict[str, Any]:
    """Median prefill tokens/s of `model` (a LoadedModel) over `repeats` cold runs."""
    import mlx.core as mx
    import numpy as np

    ids = np.random.default_rng(tokens).integers(5, model.info.vocab_size - 5, size=tokens).tolist()
    rates = []
    for _ in range(repeats):
        cache = model.trunk.make_cache()
        started = time.perf_counter()
        _, logits = model.trunk.prefill(ids, cache)
        mx.eval(logits)
        rates.append(tokens / (time.perf_counter() - started))
    return {"tokens": tokens, "tokens_per_second": median(rates), "runs": rates}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--tokens", default="1024,4096,16384", help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)

    from mtplxd.engine import load_model

    model = load_model(args.model)
    lengths = [int(n) for n in args.tokens.split(",") if n.strip()]
    report = {
        "model": model.info.to_dict(),
        "prefill": [measure_prefill(model, n, args.repeats) for n in lengths],
        **machine(),
        "command": command_line(PROG, argv),
    }
    for row in report["prefill"]:
        print(f"prefill {row['tokens']:>6} tokens: {row['tokens_per_second']:8.1f} tok/s")
    if args.json_out:
        write_report(args.json_out, report, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
