"""The scheduler interleaves rows a cycle at a time and each row stays exact (CPU, bitwise).

The tests turn the scheduler by hand on the test thread (the owner thread's loop does the same,
one turn after another), so "joins at cycle n" is exact and event order is deterministic.
"""

from __future__ import annotations

import pytest

from mtplxd.engine import GenerationRequest, GenerationResult, SamplingParams, load_model
from mtplxd.engine.interface import QueueFull
from mtplxd.engine.owner import ModelOwner
from mtplxd.engine.scheduler import Row, RowFailure, Scheduler
from mtplxd.engine.session.bank import BankSettings
from support.rows import PROMPTS, Collector, assert_each_row_equals, run_until_idle


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def model(tiny_model_factory, request):
    """A dense and a hybrid (Gated DeltaNet + attention) tiny model, each with its MTP head."""
    return load_model(tiny_model_factory(request.param))


def request_for(model, index: int, *, depth: int, max_tokens: int, chunk: int | None = None,
                **sampling) -> GenerationRequest:
    ids = model.tokenizer.encode(PROMPTS[index % len(PROMPTS)])
    return GenerationRequest(ids, SamplingParams(max_tokens=max_tokens, **sampling), depth=depth,
                             prefill_chunk=chunk)


def solo(model, request: GenerationRequest) -> GenerationResult:
    copy = GenerationRequest(list(request.prompt_ids), request.sampling, depth=request.depth,
                             prefill_chunk=request.prefill_chunk)
    return model.complete(copy)


def add_row(scheduler: Scheduler, model, request: GenerationRequest, name: str, log: list) -> Collector:
    sink = Collector(name, log)
    scheduler.submit(Row(request, lambda stop: model.generate_steps(request, stop), sink))
    return sink


def joining_rows(model, scheduler: Scheduler, requests: list[GenerationRequest]) -> list[Collector]:
    """Row i joins after i turns of the rows before it."""
    log: list = []
    sinks = []
    for i, request in enumerate(requests):
        sinks.append(add_row(scheduler, model, request, f"r{i}", log))
        scheduler.turn()
    run_until_idle(scheduler)
    return sinks


@pytest.mark.parametrize("width", [3, 8])
def test_rows_joining_at_different_cycles_equal_their_solo_greedy_ar_output(model, width):
    depths = [0, 1, 2, 3, 4, 2, 1, 3]
    requests = [request_for(model, i, depth=depths[i], max_tokens=12 + 5 * i, chunk=(3, 4, None)[i % 3])
                for i in range(width)]
    references = [solo(model, GenerationRequest(r.prompt_ids, r.sampling, depth=0,
                                                prefill_chunk=r.prefill_chunk)) for r in requests]
    sinks = joining_rows(model, Scheduler(max_concurrent=width), requests)
    assert_each_row_equals(sinks, references, depths)
    assert max(sink.result.stats.rows_max for sink in sinks) == width


def test_seeded_sampled_rows_equal_their_solo_output_whatever_runs_beside_them(model):
    sampled = dict(temperature=0.9, top_p=0.95, seed=1234)
    requests = [request_for(model, i, depth=(0, 2, 3)[i % 3], max_tokens=16, **sampled)
                for i in range(3)]
    references = [solo(model, r).token_ids for r in requests]
    neighbours = [request_for(model, 5 + i, depth=2, max_tokens=20, temperature=0.7, seed=i)
                  for i in range(2)]
    sinks = joining_rows(model, Scheduler(max_concurrent=5), [neighbours[0], *requests, neighbours[1]])
    assert [s.result.token_ids for s in sinks[1:4]] == references


def test_a_short_request_gets_its_first_token_before_two_long_generations_finish(model):
    scheduler = Scheduler(max_concurrent=3)
    log: list = []
    long = [add_row(scheduler, model, request_for(model, i, depth=2, max_tokens=60, ignore_eos=True),
                    f"long{i}", log) for i in range(2)]
    for _ in range(3):
        scheduler.turn()
    short = add_row(scheduler, model, request_for(model, 2, depth=2, max_tokens=4), "short", log)
    run_until_idle(scheduler)
    first_short = log.index(("short", "TokenDelta"))
    assert all(log.index((s.name, "GenerationResult")) > first_short for s in long)
    assert short.result.stats.completion_tokens > 0


def test_a_long_prompt_is_prefilled_in_chunks_between_the_running_rows_cycles(model):
    scheduler = Scheduler(max_concurrent=2)
    log: list = []
    first = request_for(model, 0, depth=2, max_tokens=300, ignore_eos=True)
    running_ids = first.prompt_ids
    running = add_row(scheduler, model, first, "running", log)
    scheduler.turn()
    long_ids = model.tokenizer.encode(" ".join(PROMPTS))
    long_request = GenerationRequest(long_ids, SamplingParams(max_tokens=3), depth=2, prefill_chunk=8)
    reference = solo(model, long_request)
    joined = add_row(scheduler, model, long_request, "long", log)
    chunks = -(-len(long_ids) // 8)
    rows = {}
    for _ in range(chunks):
        scheduler.turn()
        rows = {r["prompt_tokens"]: r for r in scheduler.status()["rows"]}
        if rows[len(long_ids)]["phase"] != "prefill":
            break
    # Each turn stepped every row once: one prefill chunk of the long prompt, one decode
    # cycle of the running stream, which never waited for the whole prompt.
    steps = {name: r["steps"] for name, r in rows.items()}
    assert steps[len(long_ids)] == steps[len(running_ids)] - 1
    run_until_idle(scheduler)
    stats = joined.result.stats
    assert stats.prefill_chunks >= chunks and joined.result.token_ids == reference.token_ids
    assert running.result.stats.completion_tokens == 300


def test_a_cancelled_row_leaves_at_the_next_cycle_and_frees_its_reservation(model):
    released = []
    scheduler = Scheduler(max_concurrent=2, admit=lambda request: lambda: released.append(request))
    log: list = []
    request = request_for(model, 0, depth=2, max_tokens=200, ignore_eos=True)
    sink = Collector("gone", log)
    row = scheduler.submit(Row(request, lambda stop: model.generate_steps(request, stop), sink))
    other = add_row(scheduler, model, request_for(model, 1, depth=1, max_tokens=10), "other", log)
    for _ in range(3):
        scheduler.turn()
    row.cancel()
    scheduler.turn()
    assert sink.result.finish_reason == "cancelled"
    assert scheduler.status()["running"] == 1 and released == [request]
    run_until_idle(scheduler)
    assert other.result.finish_reason in ("stop", "length") and len(released) == 2


def _fails_after(steps, n):
    for i, item in enumerate(steps):
        if i == n:
            raise FloatingPointError("NaN in the logits")
        yield item


def test_a_failing_row_ends_only_itself(model):
    scheduler = Scheduler(max_concurrent=3)
    log: list = []
    good = [request_for(model, i, depth=2, max_tokens=15) for i in (0, 3)]
    references = [solo(model, r).token_ids for r in good]
    bad_request = request_for(model, 1, depth=2, max_tokens=50, ignore_eos=True)
    bad = Collector("bad", log)
    sinks = [add_row(scheduler, model, good[0], "g0", log)]
    scheduler.submit(Row(bad_request, lambda stop: _fails_after(model.generate_steps(bad_request, stop), 4), bad))
    sinks.append(add_row(scheduler, model, good[1], "g1", log))
    run_until_idle(scheduler)
    assert isinstance(bad.items[-1], RowFailure) and "NaN" in str(bad.items[-1].error)
    assert [s.result.token_ids for s in sinks] == references
    assert scheduler.status()["failed"] == 1


def test_a_bad_depth_fails_its_row_with_the_engine_error(model):
    scheduler = Scheduler(max_concurrent=2)
    log: list = []
    sink = add_row(scheduler, model, request_for(model, 0, depth=99, max_tokens=5), "bad", log)
    ok = add_row(scheduler, model, request_for(model, 1, depth=1, max_tokens=5), "ok", log)
    run_until_idle(scheduler)
    assert isinstance(sink.items[-1], RowFailure) and isinstance(sink.items[-1].error, ValueError)
    assert ok.result.stats.completion_tokens > 0


def test_the_queue_is_fifo_bounded_and_full_means_queue_full(model):
    scheduler = Scheduler(max_concurrent=1, max_queued=1)
    log: list = []
    first = add_row(scheduler, model, request_for(model, 0, depth=1, max_tokens=5), "first", log)
    scheduler.turn()  # first runs; the queue is empty again
    second = add_row(scheduler, model, request_for(model, 1, depth=1, max_tokens=5), "second", log)
    with pytest.raises(QueueFull) as refused:
        add_row(scheduler, model, request_for(model, 2, depth=1, max_tokens=5), "third", log)
    assert refused.value.retry_after_seconds >= 1
    run_until_idle(scheduler)
    results = [event for event in log if event[1] == "GenerationResult"]
    assert results == [("first", "GenerationResult"), ("second", "GenerationResult")]
    assert second.result.stats.queue_wait_seconds > 0
    assert second.result.stats.ttft_seconds >= second.result.stats.queue_wait_seconds
    assert first.result.stats.rows_max == 1


def test_a_request_that_does_not_fit_now_waits_for_memory_and_keeps_fifo(model):
    budget = {"free": 1}

    def admit(request):
        if budget["free"] == 0:
            return None
        budget["free"] -= 1
        return lambda: budget.__setitem__("free", budget["free"] + 1)

    scheduler = Scheduler(max_concurrent=4, admit=admit)
    log: list = []
    sinks = [add_row(scheduler, model, request_for(model, i, depth=1, max_tokens=6), f"r{i}", log)
             for i in range(3)]
    scheduler.turn()
    assert scheduler.status()["running"] == 1 and scheduler.status()["queued"] == 2
    run_until_idle(scheduler)
    order = [name for name, kind in log if kind == "GenerationResult"]
    assert order == ["r0", "r1", "r2"] and all(s.result.stats.rows_max == 1 for s in sinks)


def test_rows_restore_from_the_session_bank_while_others_run(tiny_model_factory):
    model = load_model(tiny_model_factory("qwen3"))
    model.enable_session_bank(BankSettings())
    base = model.tokenizer.encode(PROMPTS[6])
    first = GenerationRequest(base, SamplingParams(max_tokens=8), depth=2)
    scheduler = Scheduler(max_concurrent=3)
    log: list = []
    add_row(scheduler, model, first, "first", log)
    run_until_idle(scheduler)
    follow = base + model.tokenizer.encode(" pop")
    reference = load_model(tiny_model_factory("qwen3")).complete(
        GenerationRequest(follow, SamplingParams(max_tokens=10), depth=0))
    neighbour = add_row(scheduler, model, request_for(model, 3, depth=3, max_tokens=20), "n", log)
    scheduler.turn()
    warm = add_row(scheduler, model, GenerationRequest(follow, SamplingParams(max_tokens=10), depth=2),
                   "warm", log)
    run_until_idle(scheduler)
    assert warm.result.stats.cached_tokens > 0 and warm.result.stats.restored_from == "ram"
    assert warm.result.token_ids == reference.token_ids
    assert neighbour.result.stats.restored_from == "cold"


def test_the_owner_thread_steps_rows_and_runs_jobs_between_turns(model):
    owner = ModelOwner(scheduler=Scheduler(max_concurrent=3))
    owner.start()
    import threading

    done = threading.Event()
    log: list = []
    requests = [request_for(model, i, depth=(0, 2, 3)[i], max_tokens=20) for i in range(3)]
    references = [solo(model, r).token_ids for r in requests]
    sinks = []
    for i, request in enumerate(requests):
        sink = Collector(f"r{i}", log)
        sinks.append(sink)
        owner.submit_row(Row(request, lambda stop, r=request: model.generate_steps(r, stop), sink))
    assert owner.submit(lambda: 7).result(timeout=30) == 7  # a job is not stuck behind the rows
    owner.submit(done.set)
    deadline = 60
    import time

    start = time.monotonic()
    while any(not s.items or not isinstance(s.items[-1], GenerationResult) for s in sinks):
        assert time.monotonic() - start < deadline
        time.sleep(0.01)
    owner.stop()
    assert [s.result.token_ids for s in sinks] == references
