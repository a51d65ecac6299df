"""Concurrent streams through the scheduler: aggregate and per-request tok/s, TTFT p50/p99.

    python -m mtplxd.engine.bench.concurrency --model PATH [--streams 1,2,3,4,8]
        [--max-tokens 128] [--repeats 3] [--arms ARMS] [--numerics throughput]
        [--depth K] [--json-out FILE]

At each stream count N, N greedy requests (the bench prompts in turn, ignore_eos,
`--max-tokens` each) arrive at the same instant and run on the real owner thread, once per arm:
- serial_mtp: the scheduler with one row (max_concurrent 1), MTP at depth K: one at a time,
  today's serial MTP;
- interleaved_mtp: N rows stepped a cycle at a time, each its own verify (cohorts off:
  phase 1 of issue #20);
- ar_batch: N rows at depth 0 in the AR batch lane (cohorts always: one batched forward per
  token for all rows);
- mtp_cohorts: N rows at depth K in fused MTP cohorts (cohorts always, cohort cycle "fused":
  each cohort's whole cycle, drafting, verify and accept for all its rows, is one compiled
  graph on device-resident state, read one cycle late; widths 1/3/8);
- mtp_cohorts_phased: N rows in phased MTP cohorts (cohort cycle "phased": the rows' MTP
  heads draft together, one batched forward per depth step, their drafts are verified in
  one batched forward, and one host sync settles every row);
- mtp_cohorts_per_row: the phased cohorts with each row drafting alone and a sync per row
  (cohort drafting "per-row": the cohorts as first built, to measure batched drafting by);
- mtp_cohorts_solo_prefill: mtp_cohorts with each row's prefill forwards its own (the rows
  arriving together are otherwise prefilled in shared forwards: cohort.run_prefills);
- direct_mtp and direct_ar (1 stream only): one request run whole by LoadedModel.complete,
  the single-stream speed (solo decode loop, no scheduler), in the same run.
Then a late short request: two long MTP generations decode, a short one arrives, and its
TTFT is set against its own solo prefill plus two of the long rows' decode cycles (cohorts
off and always). And a late long request (cohorts auto): one long generation decodes alone,
a second as long arrives after 16 of its tokens (each `--max-tokens` long, at least 64),
and the first moves into the second's
cohort (`moves`) or, with the move turned off, stays in its solo loop while the two take
turns (`stays`): wall time, aggregate tok/s and each row's own decode rate.
With --json-out the report is rewritten after each stream count ("complete": false until the
end), so a run cut short by a time limit keeps what it measured.
TTFT counts from arrival (queue wait included); aggregate tok/s is all tokens over the wall
time from arrival to the last result; per-request tok/s is each request's own decode rate.
`shared_prefill_forwards` counts, per repeat, the prefill forwards that rows arriving together
shared (cohort.run_prefills; 0 where each row prefills alone).
That wall time is split three ways (medians over the repeats), to show where an aggregate
falls short of N times a per-request rate: `ramp_seconds`, arrival to the last first token
(prefills and queue waits); `tail_seconds`, the first request's end to the last one's (rows
left decoding alone); and `all_decoding_seconds`, what lies between (negative when the
first request ends before the last one starts, as in serial MTP).
`aggregate_decode_tokens_per_second` leaves the prefills out on both sides: the tokens after
each request's first over the time at least one request was decoding (the union of the
spans from a request's first token to its end; prefill and queue time are TTFT's);
`aggregate_decode_by_repeat` lists it per repeat (the spread), and `decode_ms_per_cycle` is
that decode time over the cycles on the critical path (every row's cycles for serial MTP and
the direct arms, the longest row's for the others), so `mtp_cohorts_cycle_over_serial_mtp_cycle`
in the ratios is what a cohort cycle costs in serial MTP cycles of the same run.
The arms alternate within each repeat so the machine's drift hits them alike.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from typing import Any

from mtplxd.engine.bench.harness import (
    PROMPTS, add_dequantize_option, add_quantize_option, add_small_m_kernel_option, bench_parser,
    command_line, exit_without_teardown, machine, prompt_ids_for, write_report,
)
from mtplxd.engine.interface import GenerationRequest, GenerationResult, SamplingParams
from mtplxd.engine.owner import ModelOwner
from mtplxd.engine.scheduler import Row, RowFailure, Scheduler

ARMS = ("serial_mtp", "interleaved_mtp", "ar_batch", "mtp_cohorts_per_row", "mtp_cohorts_phased",
        "mtp_cohorts_solo_prefill", "mtp_cohorts")
SINGLE_STREAM_ARMS = ("direct_mtp", "direct_ar")
# arm -> (MTP or AR, row slots: "one" or "n", cohort mode, cohort drafting, cohort cycle,
# prefills of rows arriving together batched)
ARM_SETUP = {
    "serial_mtp": ("mtp", "one", "off", "batched", "fused", True),
    "interleaved_mtp": ("mtp", "n", "off", "batched", "fused", True),
    "ar_batch": ("ar", "n", "always", "batched", "fused", True),
    "mtp_cohorts_per_row": ("mtp", "n", "always", "per-row", "phased", True),
    "mtp_cohorts_phased": ("mtp", "n", "always", "batched", "phased", True),
    "mtp_cohorts_solo_prefill": ("mtp", "n", "always", "batched", "fused", False),
    "mtp_cohorts": ("mtp", "n", "always", "batched", "fused", True),
}


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


def run_rows(owner: ModelOwner, model: Any, requests: list[GenerationRequest], rows: int,
             cohorts: str = "off", drafting: str = "batched", cycle: str = "fused",
             batch_prefills: bool = True) -> list[tuple[GenerationResult, float]]:
    """The requests through the scheduler with `rows` row slots, cohort mode `cohorts`, cohort
    drafting `drafting`, cohort cycle `cycle` and prefills batched or not; (result, finish
    time) each."""
    owner.scheduler.configure(max_concurrent=rows, max_queued=len(requests), cohort_mode=cohorts,
                              cohort_drafting=drafting, cohort_cycle=cycle,
                              batch_prefills=batch_prefills)
    results: list[Any] = [None] * len(requests)
    done = threading.Semaphore(0)

    def sink(index: int):
        def deliver(item: Any) -> None:
            if isinstance(item, (GenerationResult, RowFailure)):
                results[index] = (item, time.perf_counter())
                done.release()
        return deliver

    rows = [Row(request, lambda stop, cohort, r=request: model.generate_steps(r, stop, cohort=cohort),
                sink(i), cohort_capable=True) for i, request in enumerate(requests)]
    # Queued from the owner thread, between two turns: the requests arrive together, as the
    # bench says, and no turn admits the first before the others are queued.
    owner.submit(lambda: [owner.scheduler.submit(row) for row in rows]).result()
    for _ in requests:
        done.acquire()
    for item, _ in results:
        if isinstance(item, RowFailure):
            raise item.error
    return results


def summarize(runs: list[list[tuple[GenerationResult, float]]], arrived: list[float],
              one_at_a_time: bool = False) -> dict[str, Any]:
    """Figures of one arm at one stream count over its repeats. `one_at_a_time`: the arm runs
    its requests one after another (serial MTP, the direct arms), so its cycles add up where a
    batched arm's overlap."""
    ttfts = [r.stats.ttft_seconds for run in runs for r, _ in run]
    per_request = [r.stats.decode_tokens_per_second for run in runs for r, _ in run]
    aggregate, aggregate_decode, ramps, tails, overlaps, bounds = [], [], [], [], [], []
    cycle_ms = []
    for run, start in zip(runs, arrived):
        row_cycles = [r.stats.cycles for r, _ in run]
        bounds.append(cycle_bound(row_cycles))
        tokens = sum(r.stats.completion_tokens for r, _ in run)
        first_end, last_end = min(end for _, end in run), max(end for _, end in run)
        aggregate.append(tokens / (last_end - start))
        decoding = [(start + r.stats.ttft_seconds, end) for r, end in run]
        busy = busy_seconds(decoding)
        aggregate_decode.append((tokens - len(run)) / busy if busy > 0 else 0.0)
        critical = sum(row_cycles) if one_at_a_time else max(row_cycles, default=0)
        cycle_ms.append(1e3 * busy / critical if critical else 0.0)
        last_first_token = start + max(r.stats.ttft_seconds for r, _ in run)
        ramps.append(last_first_token - start)
        tails.append(last_end - first_end)
        overlaps.append(first_end - last_first_token)
    return {
        "aggregate_tokens_per_second": round(statistics.median(aggregate), 2),
        "aggregate_decode_tokens_per_second": round(statistics.median(aggregate_decode), 2),
        "aggregate_decode_by_repeat": [round(value, 1) for value in aggregate_decode],
        "decode_ms_per_cycle": round(statistics.median(cycle_ms), 3),
        "ramp_seconds": round(statistics.median(ramps), 4),
        "all_decoding_seconds": round(statistics.median(overlaps), 4),
        "tail_seconds": round(statistics.median(tails), 4),
        "per_request_tokens_per_second_median": round(statistics.median(per_request), 2),
        "per_request_tokens_per_second_min": round(min(per_request), 2),
        "ttft_p50_seconds": round(percentile(ttfts, 50), 4),
        "ttft_p99_seconds": round(percentile(ttfts, 99), 4),
        "mean_accepted_length": round(statistics.mean(
            r.stats.mean_accepted_length for run in runs for r, _ in run), 3),
        "cohort_width_cycles": _width_cycles(runs),
        "cycle_bound_over_serial": round(statistics.median(bounds), 3),
    }


def cycle_bound(row_cycles: list[int]) -> float:
    """The most a cohort of these rows can gain over running them one after another, if a
    cohort cycle cost a lone one and prefills were free: serial time is the sum of the rows'
    cycles, the cohort's is the longest row's (the others' slots idle once they finish)."""
    longest = max(row_cycles, default=0)
    return sum(row_cycles) / longest if longest else 1.0


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) spans: the time at least one of them ran."""
    total, reach = 0.0, float("-inf")
    for begin, end in sorted(spans):
        begin = max(begin, reach)
        if end > begin:
            total += end - begin
            reach = end
    return total


def _width_cycles(runs: list[list[tuple[GenerationResult, float]]]) -> dict[str, int]:
    """Row decode cycles by cohort width, over all the arm's requests (empty outside cohorts)."""
    total: dict[str, int] = {}
    for run in runs:
        for result, _ in run:
            for width, cycles in result.stats.cohort_widths.items():
                total[width] = total.get(width, 0) + cycles
    return dict(sorted(total.items(), key=lambda item: int(item[0])))


def run_arm(owner: ModelOwner, model: Any, arm: str, n: int, depth: int,
            max_tokens: int) -> tuple[list[tuple[GenerationResult, float]], float]:
    """One repeat of one arm at n streams: (results with finish times, arrival time)."""
    if arm in SINGLE_STREAM_ARMS:
        requests = requests_for(model, 1, depth if arm == "direct_mtp" else 0, max_tokens)
        return run_direct(owner, model, requests), requests[0].arrived_at
    mode, slots, cohorts, drafting, cycle, batch_prefills = ARM_SETUP[arm]
    requests = requests_for(model, n, depth if mode == "mtp" else 0, max_tokens)
    rows = 1 if slots == "one" else n
    return (run_rows(owner, model, requests, rows, cohorts, drafting, cycle, batch_prefills),
            requests[0].arrived_at)


def _one_at_a_time(arm: str) -> bool:
    return arm in SINGLE_STREAM_ARMS or ARM_SETUP[arm][1] == "one"


def bench_streams(owner: ModelOwner, model: Any, arms: list[str], depth: int, streams: list[int],
                  max_tokens: int, repeats: int) -> dict[str, Any]:
    """Every arm at every stream count (the single-stream arms at 1 stream only)."""
    out: dict[str, Any] = {}
    for n in streams:
        here = arms + (list(SINGLE_STREAM_ARMS) if n == 1 else [])
        runs: dict[str, list] = {arm: [] for arm in here}
        starts: dict[str, list[float]] = {arm: [] for arm in here}
        shared: dict[str, list[int]] = {arm: [] for arm in here}  # prefill forwards rows shared
        counters = owner.scheduler.counters
        for _ in range(repeats):
            for arm in here:
                before = counters["prefill_batches"]
                results, arrived = run_arm(owner, model, arm, n, depth, max_tokens)
                runs[arm].append(results)
                starts[arm].append(arrived)
                shared[arm].append(counters["prefill_batches"] - before)
        out[str(n)] = {arm: {**summarize(runs[arm], starts[arm], one_at_a_time=_one_at_a_time(arm)),
                             "shared_prefill_forwards": shared[arm]}
                       for arm in here}
        print(f"streams {n}: " + "; ".join(
            f"{arm} {fig['aggregate_tokens_per_second']} tok/s agg "
            f"({fig['aggregate_decode_tokens_per_second']} decoding), "
            f"{fig['per_request_tokens_per_second_median']} per req, TTFT p50 "
            f"{fig['ttft_p50_seconds']}s p99 {fig['ttft_p99_seconds']}s"
            for arm, fig in out[str(n)].items()), flush=True)
    return out


def late_short_request(owner: ModelOwner, model: Any, depth: int, cohorts: str,
                       long_tokens: int = 256) -> dict[str, Any]:
    """Two long generations decode; a short request arrives once both have streamed 8 tokens.
    Its TTFT against its own solo prefill plus two of the long rows' decode cycles (the issue's
    target: first token within that). Cohort mode `cohorts` for all three rows."""
    owner.scheduler.configure(max_concurrent=3, max_queued=3, cohort_mode=cohorts,
                              cohort_drafting="batched", cohort_cycle="fused", batch_prefills=True)
    streamed = [0, 0]
    started = threading.Event()
    finished = threading.Semaphore(0)
    results: dict[int, Any] = {}

    def sink(index: int):
        def deliver(item: Any) -> None:
            if isinstance(item, (GenerationResult, RowFailure)):
                results[index] = item
                finished.release()
            elif index < 2 and getattr(item, "token_ids", None):
                streamed[index] += len(item.token_ids)
                if min(streamed) >= 8:
                    started.set()
        return deliver

    def submit(index: int, request: GenerationRequest) -> Row:
        return owner.submit_row(Row(request, lambda stop, cohort: model.generate_steps(
            request, stop, cohort=cohort), sink(index), cohort_capable=True))

    long_rows = [submit(i, r) for i, r in enumerate(requests_for(model, 2, depth, long_tokens))]
    started.wait(300)
    short = requests_for(model, 3, depth, 8)[2]
    submit(2, short)
    finished.acquire()  # the short one finishes first; then stop the long ones
    for row in long_rows:
        row.cancel()
    finished.acquire()
    finished.acquire()
    for item in results.values():
        if isinstance(item, RowFailure):
            raise item.error
    solo = owner.submit(lambda: model.complete(GenerationRequest(
        list(short.prompt_ids), SamplingParams(max_tokens=1), depth=depth))).result()
    cycle = statistics.median(r.stats.decode_seconds / max(r.stats.cycles, 1) for i, r in results.items()
                              if i < 2)
    ttft = results[2].stats.ttft_seconds
    budget = solo.stats.prefill_seconds + 2 * cycle
    return {"ttft_seconds": round(ttft, 4), "solo_prefill_seconds": round(solo.stats.prefill_seconds, 4),
            "long_rows_cycle_seconds": round(cycle, 4), "budget_seconds": round(budget, 4),
            "ttft_over_budget": round(ttft / budget, 3) if budget > 0 else None}


def late_long_request(owner: ModelOwner, model: Any, depth: int, move: bool,
                      tokens: int = 256) -> dict[str, Any]:
    """One long generation decodes alone (cohorts auto); once it has streamed 16 tokens a
    second as long arrives. With `move` the first moves into the second's cohort
    (Scheduler._joins), without it stays in its solo loop and the two take turns."""
    owner.scheduler.configure(max_concurrent=2, max_queued=2, cohort_mode="auto",
                              cohort_drafting="batched", cohort_cycle="fused", batch_prefills=True)
    owner.scheduler.move_solo_rows = move
    moved_before = owner.scheduler.counters["moved_into_cohorts"]
    streamed = threading.Event()
    finished = threading.Semaphore(0)
    results: dict[int, tuple[Any, float]] = {}

    def sink(index: int):
        count = [0]

        def deliver(item: Any) -> None:
            if isinstance(item, (GenerationResult, RowFailure)):
                results[index] = (item, time.perf_counter())
                finished.release()
            elif getattr(item, "token_ids", None):
                count[0] += len(item.token_ids)
                if index == 0 and count[0] >= 16:
                    streamed.set()
        return deliver

    def submit(index: int, request: GenerationRequest) -> None:
        owner.submit_row(Row(request, lambda stop, cohort: model.generate_steps(
            request, stop, cohort=cohort), sink(index), cohort_capable=True))

    first, second = requests_for(model, 2, depth, tokens)
    try:
        submit(0, first)
        streamed.wait(300)
        second.arrived_at = time.perf_counter()
        submit(1, second)
        finished.acquire()
        finished.acquire()
    finally:
        owner.scheduler.move_solo_rows = True
    for item, _ in results.values():
        if isinstance(item, RowFailure):
            raise item.error
    wall = max(at for _, at in results.values()) - first.arrived_at
    rates = [round(results[i][0].stats.completion_tokens / results[i][0].stats.decode_seconds, 2)
             if results[i][0].stats.decode_seconds else 0.0 for i in (0, 1)]
    return {"wall_seconds": round(wall, 4),
            "aggregate_tokens_per_second": round(2 * tokens / wall, 2),
            "decode_tokens_per_second_by_row": rates,
            "first_row_cohort_widths": results[0][0].stats.cohort_widths,
            "moved": owner.scheduler.counters["moved_into_cohorts"] - moved_before}


def ratios(figures: dict[str, Any]) -> dict[str, Any]:
    """Side-by-side ratios per stream count: cohorts' aggregate over serial MTP and over the AR
    batch lane, and cohorts' per-request rate over the AR lane's."""
    out = {}
    for n, arms in figures.items():
        row = {}
        cohorts = arms.get("mtp_cohorts")
        for base in ("serial_mtp", "interleaved_mtp", "ar_batch", "mtp_cohorts_per_row",
                     "mtp_cohorts_phased", "mtp_cohorts_solo_prefill"):
            if cohorts and base in arms and arms[base]["aggregate_tokens_per_second"] > 0:
                row[f"mtp_cohorts_over_{base}_aggregate"] = round(
                    cohorts["aggregate_tokens_per_second"] / arms[base]["aggregate_tokens_per_second"], 3)
            if cohorts and base in arms and arms[base].get("aggregate_decode_tokens_per_second"):
                row[f"mtp_cohorts_over_{base}_aggregate_decode"] = round(
                    cohorts["aggregate_decode_tokens_per_second"]
                    / arms[base]["aggregate_decode_tokens_per_second"], 3)
        if cohorts and arms.get("serial_mtp", {}).get("decode_ms_per_cycle"):
            # What a cohort cycle costs in lone cycles of the same run: the part of the
            # aggregate ratio that the scheduler and the kernels decide (the rows' lengths in
            # cycles decide the rest, cycle_bound_over_serial).
            row["mtp_cohorts_cycle_over_serial_mtp_cycle"] = round(
                cohorts["decode_ms_per_cycle"] / arms["serial_mtp"]["decode_ms_per_cycle"], 3)
        if cohorts and "ar_batch" in arms and arms["ar_batch"]["per_request_tokens_per_second_median"] > 0:
            row["mtp_cohorts_over_ar_batch_per_request"] = round(
                cohorts["per_request_tokens_per_second_median"]
                / arms["ar_batch"]["per_request_tokens_per_second_median"], 3)
        out[n] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("python -m mtplxd.engine.bench.concurrency", __doc__)
    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--streams", default="1,2,3,4,8", help="comma-separated stream counts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated: " + ", ".join(ARMS))
    parser.add_argument("--depth", type=int, default=None, help="MTP depth (default: the model's)")
    parser.add_argument("--numerics", default="throughput", choices=("exact", "throughput"),
                        help="cohort numerics (docs/concurrency.md); default throughput")
    parser.add_argument("--json-out", default=None)
    add_quantize_option(parser)
    add_dequantize_option(parser)
    add_small_m_kernel_option(parser)
    args = parser.parse_args(argv)
    from mtplxd.engine.loaded_model import load_model

    def load() -> Any:
        return load_model(args.model, quantize=args.quantize, dequantize_weights=args.dequantize,
                          small_m_kernel=args.small_m_kernel or None)

    owner = ModelOwner(scheduler=Scheduler())
    owner.start()
    held: list[Any] = []
    try:
        held.append(owner.submit(load).result())
        model = held[0]
        streams = [int(s) for s in args.streams.split(",")]
        arms = [arm for arm in args.arms.split(",") if arm]
        unknown = [arm for arm in arms if arm not in ARMS]
        if unknown:
            parser.error(f"unknown arm {unknown[0]}; choose from {', '.join(ARMS)}")
        if model.head is None:
            arms = [arm for arm in arms if ARM_SETUP[arm][0] == "ar"]
        depth = model.info.depth if args.depth is None else args.depth
        owner.scheduler.configure(numerics=args.numerics)
        # Warm-up: compiled graphs (on CUDA seconds each, per shape: every cohort width the
        # stream counts reach, the narrower ones rows fall back to as they leave, and every
        # capacity step the caches grow through on the way to --max-tokens) and first-call
        # costs stay out of the figures. A 16-token warm-up left the capacity steps to the
        # first timed repeat (a likely cause of the H200 runs' slowest repeats, about half
        # their arm's median).
        for n in sorted(set(streams) | {3}):
            for arm in arms:
                run_arm(owner, model, arm, n, depth, args.max_tokens)
        figures: dict[str, Any] = {}
        late: dict[str, Any] = {}
        late_long: dict[str, Any] = {}

        def report_so_far(complete: bool) -> dict[str, Any]:
            return {
                "bench": "concurrency",
                "command": command_line("python -m mtplxd.engine.bench.concurrency", argv),
                "model": model.info.id, "quantization": model.info.quantization,
                "dtype": model.info.dtype, "quantized_matmul": model.info.kernels.get("quantized_matmul"),
                "machine": machine(), "max_tokens": args.max_tokens,
                "repeats": args.repeats, "depth": depth, "numerics": args.numerics,
                "cohort_widths": list(owner.scheduler.widths), "arms": arms,
                "streams": figures, "ratios": ratios(figures),
                "late_short_request_beside_two_long": late, "late_long_request": late_long,
                "complete": complete,
            }

        for n in streams:
            figures.update(bench_streams(owner, model, arms, depth, [n], args.max_tokens, args.repeats))
            if args.json_out:  # a run stopped by a time limit keeps what it measured
                write_report(args.json_out, report_so_far(False))
        if model.head is not None:
            for mode in ("off", "always"):
                late[f"cohorts_{mode}"] = late_short_request(owner, model, depth, mode)
                print(f"late short request, cohorts {mode}: {late[f'cohorts_{mode}']}", flush=True)
            for move in (False, True, False, True):  # twice each, alternating: medians of noisy runs
                name = "moves" if move else "stays"
                late_long.setdefault(name, []).append(
                    late_long_request(owner, model, depth, move, tokens=max(args.max_tokens, 64)))
                print(f"late long request, the first row {name}: {late_long[name][-1]}", flush=True)
        report = report_so_far(True)
    finally:
        model = None
        # MLX arrays must die on the thread that made them (else the process aborts at exit).
        owner.submit(lambda: (held.clear(), gc.collect())).result()
        owner.stop(timeout=60)
    if args.json_out:
        write_report(args.json_out, report, announce=True)
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
