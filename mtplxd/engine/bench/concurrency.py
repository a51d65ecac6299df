"""Concurrent streams through the scheduler: aggregate and per-request tok/s, TTFT p50/p99.

    python -m mtplxd.engine.bench.concurrency --model PATH [--streams 1,2,3,4,8]
        [--max-tokens 128] [--repeats 3] [--modes mtp,ar] [--json-out FILE]

Per mode (mtp: the model's depth; ar: depth 0) and per stream count N, N greedy requests
(the bench prompts in turn, ignore_eos, `--max-tokens` each) arrive at the same instant and
run three ways on the real owner thread:
- direct: each request run whole by `LoadedModel.complete`, one after another (the engine as
  it was before the scheduler: the single-stream baseline, no scheduler in the way);
- serial: through the scheduler with one row (max_concurrent 1): FIFO, one at a time;
- interleaved: through the scheduler with N rows, stepped a cycle at a time.
TTFT counts from arrival (queue wait included); aggregate tok/s is all tokens over the wall
time from arrival to the last result; per-request tok/s is each request's own decode rate.
The arms alternate within each repeat so the machine's drift hits them alike. Interleaving
does not batch (phase 1 of issue #20): it trades per-request speed for TTFT, and aggregate
tok/s stays about the serial figure.
"""

from __future__ import annotations

import gc
import statistics
import sys
import threading
import time
from typing import Any

from mtplxd.engine.bench.harness import (
    PROMPTS, add_quantize_option, bench_parser, command_line, machine, prompt_ids_for, write_report,
)
from mtplxd.engine.interface import GenerationRequest, GenerationResult, SamplingParams
from mtplxd.engine.owner import ModelOwner
from mtplxd.engine.scheduler import Row, RowFailure, Scheduler

ARMS = ("direct", "serial", "interleaved")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def requests_for(model: Any, streams: int, depth: int, max_tokens: int) -> list[GenerationRequest]:
    """`streams` greedy requests over the bench prompts, all arriving now."""
    now = time.perf_counter()
    return [GenerationRequest(prompt_ids_for(model.tokenizer, PROMPTS[i % len(PROMPTS)]),
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True), depth=depth,
                              arrived_at=now)
            for i in range(streams)]


def run_direct(owner: ModelOwner, model: Any, requests: list[GenerationRequest]
               ) -> list[tuple[GenerationResult, float]]:
    """Each request whole, one after another, on the owner thread (no scheduler). TTFT still
    counts from the shared arrival: the generation reads request.arrived_at."""
    def work() -> list[tuple[GenerationResult, float]]:
        return [(model.complete(request), time.perf_counter()) for request in requests]

    return owner.submit(work).result()


def run_rows(owner: ModelOwner, model: Any, requests: list[GenerationRequest], rows: int
             ) -> list[tuple[GenerationResult, float]]:
    """The requests through the scheduler with `rows` row slots; (result, finish time) each."""
    owner.scheduler.configure(max_concurrent=rows, max_queued=len(requests))
    results: list[Any] = [None] * len(requests)
    done = threading.Semaphore(0)

    def sink(index: int):
        def deliver(item: Any) -> None:
            if isinstance(item, (GenerationResult, RowFailure)):
                results[index] = (item, time.perf_counter())
                done.release()
        return deliver

    for i, request in enumerate(requests):
        owner.submit_row(Row(request, lambda stop, r=request: model.generate_steps(r, stop), sink(i)))
    for _ in requests:
        done.acquire()
    for item, _ in results:
        if isinstance(item, RowFailure):
            raise item.error
    return results


def summarize(runs: list[list[tuple[GenerationResult, float]]], arrived: list[float]) -> dict[str, Any]:
    """Figures of one arm at one stream count over its repeats."""
    ttfts = [r.stats.ttft_seconds for run in runs for r, _ in run]
    per_request = [r.stats.decode_tokens_per_second for run in runs for r, _ in run]
    aggregate = []
    for run, start in zip(runs, arrived):
        tokens = sum(r.stats.completion_tokens for r, _ in run)
        aggregate.append(tokens / (max(end for _, end in run) - start))
    return {
        "aggregate_tokens_per_second": round(statistics.median(aggregate), 2),
        "per_request_tokens_per_second_median": round(statistics.median(per_request), 2),
        "per_request_tokens_per_second_min": round(min(per_request), 2),
        "ttft_p50_seconds": round(percentile(ttfts, 50), 4),
        "ttft_p99_seconds": round(percentile(ttfts, 99), 4),
        "mean_accepted_length": round(statistics.mean(
            r.stats.mean_accepted_length for run in runs for r, _ in run), 3),
    }


def bench_mode(owner: ModelOwner, model: Any, depth: int, streams: list[int], max_tokens: int,
               repeats: int) -> dict[str, Any]:
    """Every arm at every stream count for one depth."""
    out: dict[str, Any] = {}
    for n in streams:
        runs: dict[str, list] = {arm: [] for arm in ARMS}
        starts: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for _ in range(repeats):
            for arm in ARMS:
                requests = requests_for(model, n, depth, max_tokens)
                starts[arm].append(requests[0].arrived_at)
                if arm == "direct":
                    runs[arm].append(run_direct(owner, model, requests))
                else:
                    runs[arm].append(run_rows(owner, model, requests, 1 if arm == "serial" else n))
        out[str(n)] = {arm: summarize(runs[arm], starts[arm]) for arm in ARMS}
        print(f"depth {depth} streams {n}: " + "; ".join(
            f"{arm} {fig['aggregate_tokens_per_second']} tok/s agg, "
            f"{fig['per_request_tokens_per_second_median']} per req, TTFT p50 "
            f"{fig['ttft_p50_seconds']}s p99 {fig['ttft_p99_seconds']}s"
            for arm, fig in out[str(n)].items()), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("python -m mtplxd.engine.bench.concurrency", __doc__)
    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--streams", default="1,2,3,4,8", help="comma-separated stream counts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="mtp,ar", help="mtp (the model's depth), ar (depth 0)")
    parser.add_argument("--json-out", default=None)
    add_quantize_option(parser)
    args = parser.parse_args(argv)
    from mtplxd.engine.loaded_model import load_model

    owner = ModelOwner(scheduler=Scheduler())
    owner.start()
    held: list[Any] = []
    try:
        held.append(owner.submit(lambda: load_model(args.model, quantize=args.quantize)).result())
        model = held[0]
        streams = [int(s) for s in args.streams.split(",")]
        depths = {"mtp": model.info.depth, "ar": 0}
        modes = [m for m in args.modes.split(",") if m == "ar" or model.head is not None]
        # Warm-up: compiled graphs and first-call costs stay out of the figures.
        for mode in modes:
            run_rows(owner, model, requests_for(model, 2, depths[mode], 16), 2)
        report = {
            "bench": "concurrency",
            "command": command_line("python -m mtplxd.engine.bench.concurrency", argv),
            "model": model.info.id, "machine": machine(), "max_tokens": args.max_tokens,
            "repeats": args.repeats, "arms": list(ARMS),
            "modes": {mode: {"depth": depths[mode],
                             "streams": bench_mode(owner, model, depths[mode], streams,
                                                   args.max_tokens, args.repeats)}
                      for mode in modes},
        }
    finally:
        model = None
        # MLX arrays must die on the thread that made them (else the process aborts at exit).
        owner.submit(lambda: (held.clear(), gc.collect())).result()
        owner.stop(timeout=60)
    if args.json_out:
        write_report(args.json_out, report, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
