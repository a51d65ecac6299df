"""What a cohort's batched verify and drafting cost, and how far its numerics stay from solo.

    python -m mtplxd.engine.bench.cohort (--model PATH | --dims qwen3-4b) [--dtype bfloat16]
        [--context 512] [--depth 3] [--widths 1,3,8] [--repeats 20]
        [--divergence-tokens 128] [--json-out FILE]

Cycle cost: at a fixed context, for each width W and block length L (1: the AR lane; K+1:
an MTP verify at depth K), the median milliseconds of one batched forward over W rows
(model/batched.py) against W per-row forwards (the `exact` profile), the two alternating
within each repeat, the caches trimmed back after each call so every timed call has the same
shapes. `per_row_speedup` = per-row time /
batched time. Drafting cost (with `--model`: it needs the MTP head): for each width W, the
median milliseconds of one cohort's drafting at depth K (cohort_drafts.draft_together: the
heads batched, K head forwards) against W rows drafting alone (W(K) head forwards), each
row's PENDING K+1 pairs (a full accept), its head cache trimmed back after every call.

Numerics: one verify block per row, batched against per-row: the largest |logit difference|
(0.0 where batched matmuls compute each row alone). With `--model` (a real tokenizer), also
greedy MTP rows in cohorts of each width (numerics throughput) against each prompt's solo
greedy AR output: the first diverging token of every row (null when none within
`--divergence-tokens`). `--dims` builds a random-weight dense qwen3 of those dimensions in
memory (bench/verify.py), with no tokenizer: cycle cost and logit difference only.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import mlx.core as mx

from mtplxd.engine.bench.harness import (
    PROMPTS, bench_parser, command_line, device_name, elapsed_ms, print_and_save, prompt_ids_for,
)

PROG = "python -m mtplxd.engine.bench.cohort"


def _trim(caches: list[list[Any]], n: int) -> None:
    for cache in caches:
        for entry in cache:
            entry.trim(n)


def alternating_medians_ms(calls: list[Any], repeats: int, warmup: int = 3) -> list[float]:
    """Median wall ms of each call, the calls alternating within every repeat so that the
    machine's drift (a shared CPU) hits them alike."""
    for _ in range(warmup):
        for call in calls:
            call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, spent in zip(calls, times):
            spent.append(elapsed_ms(call))
    return [statistics.median(spent) for spent in times]


def cycle_costs(trunk: Any, caches: list[list[Any]], widths: list[int], lengths: list[int],
                vocab: int, repeats: int) -> dict[str, Any]:
    """{"W=3,L=4": {"batched_ms", "per_row_ms", "per_row_speedup"}} at each width and length."""
    from mtplxd.engine.model.batched import batched_forward

    out = {}
    for length in lengths:
        for width in widths:
            rows = caches[:width]
            tokens = mx.random.randint(0, vocab, (width, length), key=mx.random.key(width * 100 + length))

            def batched(rows=rows, tokens=tokens, length=length) -> None:
                _, logits = batched_forward(trunk, tokens, rows)
                mx.eval(logits)
                _trim(rows, length)

            def per_row(rows=rows, tokens=tokens, length=length) -> None:
                outs = [trunk.forward(tokens[i:i + 1], cache, all_logits=True)[1]
                        for i, cache in enumerate(rows)]
                mx.eval(outs)
                _trim(rows, length)

            batched_ms, per_row_ms = alternating_medians_ms([batched, per_row], repeats)
            out[f"W={width},L={length}"] = {
                "batched_ms": round(batched_ms, 3), "per_row_ms": round(per_row_ms, 3),
                "per_row_speedup": round(per_row_ms / batched_ms, 3),
                "batched_ms_per_row": round(batched_ms / width, 3),
            }
            print(f"W={width} L={length}: batched {batched_ms:.2f} ms, per-row {per_row_ms:.2f} ms",
                  flush=True)
    return out


def draft_costs(model: Any, widths: list[int], context: int, depth: int,
                repeats: int) -> dict[str, Any]:
    """{"W=3": {"batched_ms", "per_row_ms", "per_row_speedup"}}: a cohort's drafting at each
    width, heads batched against each row drafting alone (greedy rows)."""
    from mtplxd.engine.decoding.cohort_drafts import draft_together
    from mtplxd.engine.decoding.cohort_rows import CohortSpeculativeDecoder, DraftCall
    from mtplxd.engine.decoding.sampling import TokenHistory
    from mtplxd.engine.interface import SamplingParams

    trunk, head, vocab = model.trunk, model.head, model.info.vocab_size
    dtype = trunk.embed(mx.array([[0]])).dtype
    size = trunk.embed(mx.array([[0]])).shape[-1]
    calls = []
    for row in range(max(widths)):
        key = mx.random.key(1000 + row)
        decoder = CohortSpeculativeDecoder(trunk, head, trunk.make_cache(), SamplingParams(),
                                           TokenHistory(vocab, []), 0, depth)
        # The head cache holds `context` pairs, as after a prompt of that length.
        head(mx.random.normal((1, context, size), key=key).astype(dtype),
             trunk.embed(mx.random.randint(0, vocab, (1, context), key=key)), decoder.head_cache)
        pending = mx.random.normal((1, depth + 1, size), key=mx.random.split(key)[0]).astype(dtype)
        calls.append(DraftCall(decoder, context, 1, pending,
                               mx.random.randint(0, vocab, (depth + 1,), key=key).tolist()))
    mx.eval([c.decoder.head_cache[0].keys for c in calls])

    def restore(rows: list[Any]) -> None:
        for call in rows:
            for entry in call.decoder.head_cache:
                entry.trim(entry.offset - context)

    out = {}
    for width in widths:
        rows = calls[:width]

        def batched(rows=rows, width=width) -> None:
            mx.eval([d.drafts for d in draft_together(rows, width)])
            restore(rows)

        def per_row(rows=rows) -> None:
            mx.eval([call.decoder.prepare(call).drafts for call in rows])
            restore(rows)

        batched_ms, per_row_ms = alternating_medians_ms([batched, per_row], repeats)
        out[f"W={width}"] = {"batched_ms": round(batched_ms, 3), "per_row_ms": round(per_row_ms, 3),
                             "per_row_speedup": round(per_row_ms / batched_ms, 3)}
        print(f"drafting W={width} K={depth}: batched {batched_ms:.2f} ms, per-row "
              f"{per_row_ms:.2f} ms", flush=True)
    return out


def logit_difference(trunk: Any, caches: list[list[Any]], width: int, length: int,
                     vocab: int) -> float:
    """max |batched - per-row| over the logits of one (width, length) verify."""
    from mtplxd.engine.model.batched import batched_forward

    tokens = mx.random.randint(0, vocab, (width, length), key=mx.random.key(7))
    _, batched = batched_forward(trunk, tokens, caches[:width])
    mx.eval(batched)
    _trim(caches[:width], length)
    solo = mx.concatenate([trunk.forward(tokens[i:i + 1], cache, all_logits=True)[1]
                           for i, cache in enumerate(caches[:width])])
    mx.eval(solo)
    _trim(caches[:width], length)
    return float(mx.max(mx.abs(batched.astype(mx.float32) - solo.astype(mx.float32))).item())


def first_divergences(model: Any, width: int, depth: int, tokens: int) -> list[int | None]:
    """Greedy rows in one cohort of `width` (numerics throughput) against solo greedy AR: the
    index of each row's first differing token (None: equal for all `tokens`)."""
    from mtplxd.engine.interface import GenerationRequest, GenerationResult, SamplingParams
    from mtplxd.engine.scheduler import Row, Scheduler

    requests = [GenerationRequest(prompt_ids_for(model.tokenizer, PROMPTS[i % len(PROMPTS)]),
                                  SamplingParams(max_tokens=tokens, ignore_eos=True), depth=depth)
                for i in range(width)]
    solo = [model.complete(GenerationRequest(r.prompt_ids, r.sampling, depth=0)).token_ids
            for r in requests]
    scheduler = Scheduler(max_concurrent=width, cohort_mode="always", numerics="throughput")
    results: dict[int, Any] = {}
    for i, request in enumerate(requests):
        scheduler.submit(Row(request, lambda stop, cohort, r=request: model.generate_steps(
            r, stop, cohort=cohort), lambda item, i=i: results.__setitem__(i, item),
            cohort_capable=True))
    while scheduler.has_work():
        scheduler.turn()
    out = []
    for i, reference in enumerate(solo):
        got = results[i].token_ids if isinstance(results[i], GenerationResult) else []
        out.append(next((j for j, (a, b) in enumerate(zip(got, reference)) if a != b), None))
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="HF-format model folder (dense qwen3 with an MTP head)")
    source.add_argument("--dims", help="random weights of these dimensions (bench/verify.py DIMS)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--context", type=int, default=512, help="cached tokens per row")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--widths", default="1,3,8")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--divergence-tokens", type=int, default=128)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    from mtplxd.engine.model.batched import batched_supported

    widths = [int(w) for w in args.widths.split(",")]
    started = time.perf_counter()
    model = None
    if args.model:
        from mtplxd.engine.loaded_model import load_model

        model = load_model(args.model)
        trunk, vocab = model.trunk, model.info.vocab_size
    else:
        from mtplxd.engine.bench.verify import DIMS, build_random_model
        from mtplxd.engine.model.families import get_family
        from mtplxd.engine.model.trunk import Trunk

        if args.dims not in DIMS:
            parser.error(f"--dims must be one of {', '.join(sorted(DIMS))}")
        random_model, config = build_random_model(args.dims, getattr(mx, args.dtype))
        trunk, vocab = Trunk(random_model, get_family("qwen3")), config["vocab_size"]
    if not batched_supported(trunk):
        print("cohort bench: needs a dense qwen3 trunk (batched verify)", file=sys.stderr)
        return 2
    caches = []
    for row in range(max(widths)):
        cache = trunk.make_cache()
        prompt = mx.random.randint(0, vocab, (args.context,), key=mx.random.key(row)).tolist()
        trunk.prefill(prompt, cache)
        caches.append(cache)
    report: dict[str, Any] = {
        "bench": "cohort", "device": device_name(), "mlx_version": mx.__version__,
        "model": args.model or f"random {args.dims} {args.dtype}", "context": args.context,
        "depth": args.depth, "widths": widths, "setup_seconds": round(time.perf_counter() - started, 1),
        "cycle_cost": cycle_costs(trunk, caches, widths, [1, args.depth + 1], vocab, args.repeats),
        "max_abs_logit_difference_batched_vs_per_row": {
            str(w): logit_difference(trunk, caches, w, args.depth + 1, vocab) for w in widths},
    }
    if model is not None and model.head is not None:
        report["draft_cost"] = draft_costs(model, widths, args.context, args.depth, args.repeats)
    if model is not None:
        report["first_divergence_vs_solo_ar"] = {
            "tokens": args.divergence_tokens,
            **{str(w): first_divergences(model, w, args.depth, args.divergence_tokens)
               for w in widths}}
    report["command"] = command_line(PROG, argv)
    return print_and_save(report, args.json_out)


if __name__ == "__main__":
    sys.exit(main())
