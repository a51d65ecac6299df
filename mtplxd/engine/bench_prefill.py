"""Prefill speed at given prompt lengths: tokens per second of the trunk over a cold cache.

    python -m mtplxd.engine.bench_prefill --model PATH [--tokens 1024,4096,16384]
        [--repeats 2] [--json-out FILE]

Each length runs `repeats` times on random token ids, each time into a fresh cache, in the
daemon's prefill chunks; the figure is the median. Lengths past the model's trained context
are measured all the same (the cost of the computation does not depend on it).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any


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
    return {"tokens": tokens, "tokens_per_second": statistics.median(rates), "runs": rates}


def _blas() -> dict[str, Any] | None:
    try:
        from mtplxd.blas import snapshot
    except ImportError:  # a checkout from before mtplxd.blas (the "before" side of a comparison)
        return None
    return snapshot()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m mtplxd.engine.bench_prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--tokens", default="1024,4096,16384", help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)

    import mlx.core as mx

    from mtplxd.engine.model import load_model

    model = load_model(args.model)
    lengths = [int(n) for n in args.tokens.split(",") if n.strip()]
    report = {
        "model": model.info.to_dict(),
        "prefill": [measure_prefill(model, n, args.repeats) for n in lengths],
        "blas": _blas(),
        "device": str(mx.default_device()),
        "mlx_version": mx.__version__,
        "platform": platform.platform(),
        "command": " ".join(["python -m mtplxd.engine.bench_prefill"]
                            + (argv if argv is not None else sys.argv[1:])),
    }
    for row in report["prefill"]:
        print(f"prefill {row['tokens']:>6} tokens: {row['tokens_per_second']:8.1f} tok/s")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2))
        print(f"saved {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
