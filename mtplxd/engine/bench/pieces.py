"""What each piece of a speculative cycle costs on this device, for a real checkpoint.

    python -m mtplxd.engine.bench.pieces --model PATH [--context 300] [--quantize auto|none|8bit|4bit]
        [--json-out FILE]

Times, one call at a time (median of 30 after warm-up): a trunk forward over 1..5 tokens
with the fused loop's fixed buffer (compiled) and with mlx-lm's exact-length cache
(uncompiled), the MTP head over 1 and 3 rows, and lm_head with a greedy pick, a top-p draw
(AR's and the verify's filter) and a sampled draft's draw (no top-p, its noise drawn once per
cycle). On a device bound by launches rather than weight reads, a forward over K+1 tokens
costs about one over 1 token, and the draft's share of a cycle is the head's and lm_head's
cost against the trunk's.
"""

from __future__ import annotations

import sys
from typing import Callable

import mlx.core as mx

from mtplxd.engine.bench.harness import cycle_bench_parser, device_name, load_dense_mtp_model, median_ms, write_report
from mtplxd.engine.bench.verify import measure_forward_costs
from mtplxd.engine.decoding import fused
from mtplxd.engine.decoding.sampling import draft_weights, scaled_logits
from mtplxd.engine.interface import SamplingParams


def latency_ms(fn: Callable[[], mx.array], repeats: int = 30) -> float:
    """Median wall time of fn() evaluated alone, after five warm-up calls."""
    return median_ms(lambda: mx.eval(fn()), repeats, warmup=5)


def measure(model, context: int) -> dict[str, float]:
    """{piece: ms} for the loaded model (see the module docstring)."""
    trunk, head, text = model.trunk, model.head, model.trunk.text
    fused.route_static_cache_attention()  # as the fused cycle attends
    cache = trunk.make_cache()
    trunk.prefill(list(range(1, context + 1)), cache)
    offset = mx.array(context, mx.int32)
    buffers = fused.to_buffers(cache, fused.capacity_for(context + 8))
    head_buffers = fused.empty_head_buffers(trunk, head, buffers[0].shape[2])
    mx.eval(buffers, head_buffers)

    def static_forward(tokens, n, *kv):
        return trunk.lm_head(text.model(tokens, fused.static_caches(list(kv), n)))

    def head_forward(g, embeddings, n, *kv):
        return head(g, embeddings, fused.static_caches(list(kv), n))

    forward, head_step = mx.compile(static_forward), mx.compile(head_forward)
    results: dict[str, float] = {}
    for rows in (1, 2, 3, 4, 5):
        tokens = mx.array([[5] * rows])
        results[f"trunk forward, {rows} token(s), fixed buffer, compiled"] = latency_ms(
            lambda: forward(tokens, offset, *buffers))

    plain = measure_forward_costs(trunk, cache, text.args.vocab_size, 0, 30, token_counts=(1, 3))
    for rows, ms in plain.items():
        results[f"trunk forward, {rows} token(s), exact-length cache"] = ms
    hidden_size = text.args.hidden_size
    dtype = buffers[0].dtype
    for rows in (1, 3):
        g = mx.zeros((1, rows, hidden_size), dtype)
        embeddings = trunk.embed(mx.array([[5] * rows]))
        results[f"MTP head, {rows} row(s), compiled"] = latency_ms(
            lambda: head_step(g, embeddings, offset, *head_buffers))
    g = mx.zeros((1, 1, hidden_size), dtype)
    key = mx.random.key(0)
    greedy = mx.compile(lambda g: mx.argmax(trunk.draft_logits(g)[0].astype(mx.float32), axis=-1))
    params = SamplingParams(temperature=0.6, top_p=0.95)
    sampled = mx.compile(lambda g, k: mx.random.categorical(
        scaled_logits(trunk.draft_logits(g)[0].astype(mx.float32), params), key=k))
    noise = mx.random.gumbel(shape=(text.args.vocab_size,), key=key)
    drafted = mx.compile(lambda g: mx.argmax(
        draft_weights(trunk.draft_logits(g)[0].astype(mx.float32), params) + noise, axis=-1))
    results["lm_head + argmax, compiled"] = latency_ms(lambda: greedy(g))
    results["lm_head + T=0.6 top-p 0.95 draw, compiled"] = latency_ms(lambda: sampled(g, key))
    results["lm_head + T=0.6 draft draw (no top-p, noise drawn), compiled"] = latency_ms(lambda: drafted(g))
    return results


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = cycle_bench_parser("python -m mtplxd.engine.bench.pieces", __doc__)
    parser.add_argument("--context", type=int, default=300, help="tokens in the cache while timing")
    args = parser.parse_args(argv)

    model = load_dense_mtp_model(args.model, args.quantize)
    if model is None:
        return 2
    results = measure(model, args.context)
    for name, ms in results.items():
        print(f"{name:55s} {ms:8.3f} ms")
    if args.json_out:
        report = {"model": model.info.id, "quantization": model.info.quantization,
                  "device": device_name(),
                  "context": args.context, "latency_ms": results}
        write_report(args.json_out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
