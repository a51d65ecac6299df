"""Prefill speed at given prompt lengths: tokens per second over a cold cache, the time to
the first token, and the memory it took.

    python -m mtplxd.engine.bench.prefill --model PATH [--tokens 8192,32768,65536]
        [--repeats 2] [--chunk 512] [--quantize auto|none|8bit|4bit]
        [--cpu-attention mlx,numpy] [--json-out FILE]

Each length runs `repeats` one-token requests of random token ids through the engine's
generation path, each into a fresh cache (no session bank), in `--chunk`-token prefill
chunks (default: the daemon's); the figures are medians of the request's own stats, as /v1
reports them: prefill tokens/s (the trunk over the prompt) and the time to the first token
(prefill and the first sample). `cpu_seconds` is the process's CPU time per request (all
its threads): on a machine shared with other jobs it moves less than wall time does.
`peak_memory_bytes` is MLX's peak over the length's runs (weights, the KV cache, and one
chunk's attention scores against the whole prefix). Lengths past the model's context are
measured all the same (the cost does not depend on it).

`--cpu-attention` names the attention paths of long prefill chunks to compare (engine/model/
cpu_attention.py: `numpy`, `mlx`, `auto`); each length runs every path in turn, so both see
the same load. Each row records the path and the load average (1 min) before and after it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from mtplxd.engine.bench.harness import (add_quantize_option, bench_parser, command_line,
                                         machine, median, write_report)
from mtplxd.engine.model.trunk import PREFILL_CHUNK

PROG = "python -m mtplxd.engine.bench.prefill"


def prompt_ids(model: Any, tokens: int) -> list[int]:
    """Random token ids (seeded by the length), clear of the vocabulary's special ends."""
    import numpy as np

    return np.random.default_rng(tokens).integers(5, model.info.vocab_size - 5, size=tokens).tolist()


def measure_prefill(model: Any, tokens: int, repeats: int, chunk: int = PREFILL_CHUNK) -> dict[str, Any]:
    """Median prefill tokens/s, TTFT and CPU seconds of one-token requests to `model` (a
    LoadedModel), prefilled in `chunk`-token pieces."""
    import mlx.core as mx

    from mtplxd.engine import GenerationRequest, SamplingParams

    request = GenerationRequest(prompt_ids=prompt_ids(model, tokens), prefill_chunk=chunk,
                                sampling=SamplingParams(temperature=0.0, max_tokens=1))
    mx.clear_cache()
    mx.reset_peak_memory()
    stats, cpu = [], []
    for _ in range(repeats):
        started = time.process_time()
        stats.append(model.complete(request).stats)
        cpu.append(time.process_time() - started)
    rates = [s.prefill_tokens_per_second for s in stats]
    ttfts = [s.ttft_seconds for s in stats]
    return {"tokens": tokens, "tokens_per_second": median(rates), "runs": rates,
            "ttft_seconds": median(ttfts), "ttft_runs": ttfts,
            "cpu_seconds": median(cpu), "cpu_runs": cpu, "chunks": stats[0].prefill_chunks,
            "peak_memory_bytes": int(mx.get_peak_memory())}


def measure_paths(model: Any, tokens: int, modes: list[str], args: Any) -> list[dict[str, Any]]:
    """`measure_prefill` at one length under each attention path in turn (cpu_attention.py),
    each row naming its path and the load average before and after it; prints each row."""
    from mtplxd.engine.model import cpu_attention

    rows = []
    for mode in modes:
        cpu_attention.set_mode(mode)
        load_before = os.getloadavg()[0]
        row = measure_prefill(model, tokens, args.repeats, args.chunk)
        load_after = os.getloadavg()[0]
        rows.append({"cpu_attention": mode, **row, "load_average_before": load_before,
                     "load_average_after": load_after})
        print(f"prefill {tokens:>6} tokens, {mode} attention: {row['tokens_per_second']:8.1f} tok/s, "
              f"first token after {row['ttft_seconds']:.2f} s, {row['cpu_seconds']:.1f} CPU s, "
              f"peak {row['peak_memory_bytes'] / 2**30:.2f} GiB, load {load_before:.1f}-{load_after:.1f}",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--tokens", default="8192,32768,65536", help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=PREFILL_CHUNK,
                        help=f"prefill chunk in tokens (default {PREFILL_CHUNK}, the daemon's)")
    parser.add_argument("--cpu-attention", default=None,
                        help="comma-separated attention paths to compare: numpy, mlx, auto "
                             "(default: the configured one, MTPLX_CPU_ATTENTION)")
    add_quantize_option(parser)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)

    from mtplxd.engine import load_model
    from mtplxd.engine.model import cpu_attention

    model = load_model(args.model, quantize=args.quantize)
    lengths = [int(n) for n in args.tokens.split(",") if n.strip()]
    configured = cpu_attention.current_mode()
    modes = [m.strip() for m in (args.cpu_attention or configured).split(",")]
    try:
        rows = [row for n in lengths for row in measure_paths(model, n, modes, args)]
    finally:
        cpu_attention.set_mode(configured)
    report = {
        "model": model.info.to_dict(),
        "chunk": args.chunk,
        "prefill": rows,
        **machine(),
        "command": command_line(PROG, argv),
    }
    if args.json_out:
        write_report(args.json_out, report, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
