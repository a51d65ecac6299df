"""KV-cache quantization: memory per 1k tokens, decode speed and MTP acceptance at each kv_bits.

    python -m mtplxd.engine.bench.kv_bits --model PATH [--bits 0,8,4] [--max-tokens 128]
        [--repeats 2] [--depth N] [--context 1024] [--json-out FILE]

The model is loaded once per kv_bits. Memory: `--context` random tokens are prefilled into a
fresh cache and the attention layers' cache bytes are counted (reported per 1k tokens).
Speed: each repeat runs every bench prompt at every kv_bits back to back, AR then MTP, greedy
with ignore_eos, so drifts of the machine hit all settings alike; figures are medians, and
speed ratios are against full precision. At every kv_bits the bench checks that greedy MTP
produced exactly the AR tokens (at that kv_bits).
"""

from __future__ import annotations

import random
import sys
from typing import Any

from mtplxd.engine.bench.harness import (
    PROMPTS, bench_parser, command_line, machine, median, prompt_ids_for, write_report,
)
from mtplxd.engine.interface import GenerationRequest, SamplingParams

PROG = "python -m mtplxd.engine.bench.kv_bits"
MIB = 1024 * 1024


def cache_bytes_per_1k(model: Any, context: int) -> float:
    """Attention-cache bytes after prefilling `context` random tokens, per 1000 tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    rng = random.Random(0)
    prompt = [rng.randrange(10, model.info.vocab_size - 10) for _ in range(context)]
    cache = model.trunk.make_cache()
    model.trunk.prefill(prompt, cache)
    attention = [c for c in cache if isinstance(c, (KVCache, QuantizedKVCache))]
    mx.eval([c.state for c in attention])
    return sum(c.nbytes for c in attention) * 1000 / context


def run(model: Any, prompt: list[int], depth: int, max_tokens: int) -> Any:
    request = GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), depth=depth)
    return model.complete(request)


def measure(model_path: str, bits_list: list[int], max_tokens: int, repeats: int,
            depth: int | None, context: int) -> dict[str, Any]:
    """Run the bench (see the module docstring); returns the report."""
    from mtplxd.engine import load_model

    models = {bits: load_model(model_path, kv_bits=bits) for bits in bits_list}
    first = models[bits_list[0]]
    depth = depth if depth is not None else first.info.depth
    prompts = [prompt_ids_for(first.tokenizer, text) for text in PROMPTS]
    for model in models.values():  # warm-up: first-call costs stay out of the figures
        run(model, prompts[0], depth, 8)
        run(model, prompts[0], 0, 8)
    runs: dict[int, dict[str, list[Any]]] = {b: {"ar": [], "mtp": []} for b in bits_list}
    for _ in range(repeats):
        for prompt in prompts:
            for bits, model in models.items():
                runs[bits]["ar"].append(run(model, prompt, 0, max_tokens))
                runs[bits]["mtp"].append(run(model, prompt, depth, max_tokens))
    report: dict[str, Any] = {"model": first.info.id, "depth": depth, "max_tokens": max_tokens,
                              "repeats": repeats, "context": context, "dtype": first.info.dtype,
                              "kv_bits": {}}
    for bits, model in models.items():
        ar, mtp = runs[bits]["ar"], runs[bits]["mtp"]
        drafted = sum(r.stats.drafted for r in mtp)
        report["kv_bits"][str(bits)] = {
            "cache_mib_per_1k_tokens": cache_bytes_per_1k(model, context) / MIB,
            "ar_decode_tps_median": median(r.stats.decode_tokens_per_second for r in ar),
            "mtp_decode_tps_median": median(r.stats.decode_tokens_per_second for r in mtp),
            "acceptance": sum(r.stats.accepted for r in mtp) / drafted if drafted else 0.0,
            "mean_accepted_length_median": median(r.stats.mean_accepted_length for r in mtp),
            "greedy_mtp_equals_ar": all(a.token_ids == m.token_ids for a, m in zip(ar, mtp)),
            "decode_loop": model.info.decode_loop,
        }
    base = report["kv_bits"][str(bits_list[0])]
    for entry in report["kv_bits"].values():
        for key in ("cache_mib_per_1k_tokens", "ar_decode_tps_median", "mtp_decode_tps_median"):
            entry[f"{key}_vs_{bits_list[0]}"] = entry[key] / base[key] if base[key] else 0.0
    return report


def main(argv: list[str] | None = None) -> int:
    """Command line: run, print a table, save JSON."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--bits", default="0,8,4", help="comma-separated kv_bits (default 0,8,4)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    bits_list = [int(b) for b in args.bits.split(",")]
    report = measure(args.model, bits_list, args.max_tokens, args.repeats, args.depth, args.context)
    report["machine"] = machine()
    report["command"] = command_line(PROG, argv)
    print(f"{report['model']} ({report['dtype']}), depth {report['depth']}:")
    for bits, e in report["kv_bits"].items():
        print(f"  kv_bits {bits}: {e['cache_mib_per_1k_tokens']:.2f} MiB/1k tokens, "
              f"AR {e['ar_decode_tps_median']:.1f} tok/s, MTP {e['mtp_decode_tps_median']:.1f} tok/s, "
              f"acceptance {e['acceptance']:.0%}, greedy MTP == AR: {e['greedy_mtp_equals_ar']}")
    if args.json_out:
        write_report(args.json_out, report, announce=True)
    return 0 if all(e["greedy_mtp_equals_ar"] for e in report["kv_bits"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
