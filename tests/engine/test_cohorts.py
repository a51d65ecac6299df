"""MTP cohorts: rows verified together in one batched forward each stay exact (CPU).

The scheduler is turned by hand on the test thread, so "joins at cycle n" is exact. Rows are
made with `cohort=True`: every decode cycle's verify goes through cohort.run_cohort, in both
numerics profiles ("throughput": one batched forward; "exact": per-row forwards). These are the
phased cohorts (cohort_cycle "phased"); test_fused_cohorts.py tests the fused cohort cycle.
"""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import pytest

from mtplxd.engine import GenerationRequest, GenerationResult, SamplingParams, TokenDelta, load_model
from mtplxd.engine.cohort import group, normalize_widths, resolve_numerics, run_cohort, seal
from mtplxd.engine.decoding.cohort_rows import VerifyCall
from mtplxd.engine.model.batched import batched_forward, batched_supported
from mtplxd.engine.scheduler import Row, RowFailure, Scheduler
from support.distribution import EOS, N_TOKENS, chi_square_p_value, exact_joint
from support.numerics import ROWS_ALONE, run_on_reference_blas, same
from support.rows import PROMPTS, Collector, assert_each_row_equals, run_until_idle


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def model(tiny_model_factory, request):
    """A dense model and a hybrid one (Gated DeltaNet + gated attention: mixers per row)."""
    return load_model(tiny_model_factory(request.param))


def request_for(model, index: int, *, depth: int, max_tokens: int, **sampling) -> GenerationRequest:
    ids = model.tokenizer.encode(PROMPTS[index % len(PROMPTS)])
    return GenerationRequest(ids, SamplingParams(max_tokens=max_tokens, **sampling), depth=depth)


def solo_ar(model, request: GenerationRequest):
    return model.complete(GenerationRequest(list(request.prompt_ids), request.sampling, depth=0))


def cohort_scheduler(**settings) -> Scheduler:
    settings.setdefault("cohort_cycle", "phased")
    return Scheduler(cohort_mode="always", **settings)


def add_cohort_row(scheduler: Scheduler, model, request: GenerationRequest, sink) -> Row:
    """A row the scheduler may put in cohorts (every test here sets cohort_mode "always")."""
    return scheduler.submit(Row(request, lambda stop, cohort: model.generate_steps(
        request, stop, cohort=cohort), sink, cohort_capable=True))


def joining(model, scheduler: Scheduler, requests: list[GenerationRequest]) -> list[Collector]:
    """Row i joins after i turns of the rows before it; turn until all have left."""
    log: list = []
    sinks = []
    for i, request in enumerate(requests):
        sinks.append(Collector(f"r{i}", log))
        add_cohort_row(scheduler, model, request, sinks[-1])
        scheduler.turn()
    run_until_idle(scheduler)
    return sinks


@pytest.mark.parametrize("numerics", ["throughput", "exact"])
@pytest.mark.parametrize("width", [3, 8])
def test_cohort_rows_joining_at_different_cycles_equal_their_solo_greedy_ar_output(
        model, width, numerics):
    depths = [3, 3, 2, 0, 3, 3, 0, 3]  # same-depth rows share cohorts; depth 0: the AR lane
    # Most rows run to max_tokens so that the wide cohorts fill; row 1 may stop at EOS.
    requests = [request_for(model, i, depth=depths[i], max_tokens=40 + 5 * i, ignore_eos=i != 1)
                for i in range(width)]
    references = [solo_ar(model, r) for r in requests]
    scheduler = cohort_scheduler(max_concurrent=width, numerics=numerics)
    sinks = joining(model, scheduler, requests)
    assert_each_row_equals(sinks, references, depths)
    assert all(sum(sink.result.stats.cohort_widths.values()) >= 1 for sink in sinks)
    widths_run = {w for w, n in scheduler.status()["cohorts_by_width"].items() if n}
    assert widths_run >= ({3, 8} if width == 8 else {3})


def test_two_rows_run_in_a_three_wide_cohort_with_a_padding_row(tiny_qwen3):
    scheduler = cohort_scheduler(max_concurrent=2, numerics="throughput")
    requests = [request_for(tiny_qwen3, i, depth=2, max_tokens=12, ignore_eos=True) for i in (0, 1)]
    references = [solo_ar(tiny_qwen3, r).token_ids for r in requests]
    log: list = []
    sinks = [Collector(f"r{i}", log) for i in (0, 1)]
    for request, sink in zip(requests, sinks):
        add_cohort_row(scheduler, tiny_qwen3, request, sink)
    run_until_idle(scheduler)
    assert [s.result.token_ids for s in sinks] == references
    # They joined together: every cycle ran 3 wide (one padding row) until one of them left,
    # then the other ran alone, 1 wide.
    first, second = (sink.result.stats.cohort_widths for sink in sinks)
    assert first["3"] == second["3"] > 0
    assert first.get("1", 0) * second.get("1", 0) == 0
    assert scheduler.status()["cohorts_by_width"][3] == first["3"]


def test_seeded_sampled_cohort_rows_equal_their_solo_output_whatever_runs_beside_them(model):
    sampled = dict(temperature=0.9, top_p=0.95, seed=1234)
    requests = [request_for(model, i, depth=(0, 2, 2)[i % 3], max_tokens=16, **sampled)
                for i in range(3)]
    # The stepwise loop is the cohort row's solo twin (the fused loop draws its random
    # numbers per cycle, so its seeded samples differ; both are exact in distribution).
    loop, model.trunk.decode_loop = model.trunk.decode_loop, "stepwise"
    try:
        references = [model.complete(r).token_ids for r in requests]
    finally:
        model.trunk.decode_loop = loop
    neighbours = [request_for(model, 5 + i, depth=2, max_tokens=20, temperature=0.7, seed=i)
                  for i in range(2)]
    for numerics in ("exact", "throughput"):
        scheduler = cohort_scheduler(max_concurrent=5, numerics=numerics)
        sinks = joining(model, scheduler, [neighbours[0], *requests, neighbours[1]])
        assert [s.result.token_ids for s in sinks[1:4]] == references, numerics


def _cohort_counts(model, prompt, params, depth, n, cycle="phased"):
    """n seeded rows through 8-wide cohorts (phased or fused: `cycle`); the first N_TOKENS
    tokens of each, counted."""
    scheduler = cohort_scheduler(max_concurrent=8, max_queued=n, numerics="throughput",
                                 cohort_cycle=cycle)
    log: list = []
    sinks = []
    for seed in range(n):
        sampling = SamplingParams(temperature=params.temperature, top_p=params.top_p,
                                  top_k=params.top_k, seed=seed, max_tokens=N_TOKENS)
        sinks.append(Collector(str(seed), log))
        add_cohort_row(scheduler, model, GenerationRequest(prompt, sampling, depth=depth), sinks[-1])
    run_until_idle(scheduler)
    counts = Counter()
    for sink in sinks:
        result = sink.result
        counts[tuple(result.token_ids) + ((EOS,) if result.finish_reason == "stop" else ())] += 1
    assert scheduler.status()["cohorts_by_width"][8] > 0
    return counts


@pytest.mark.parametrize("cycle", ["phased", "fused"])
@pytest.mark.parametrize(("params", "depth"), [
    pytest.param(SamplingParams(temperature=0.6, top_p=0.5), 2, id="T0.6-top_p0.5-depth2"),
    pytest.param(SamplingParams(temperature=1.0, top_k=4), 1, id="T1.0-top_k4-depth1"),
])
def test_sampled_cohort_rows_match_the_exact_target_distribution(tiny_qwen3, params, depth, cycle):
    prompt = tiny_qwen3.tokenizer.encode("def add(a, b):\n    ret")
    joint = exact_joint(tiny_qwen3, prompt, params)
    assert math.isclose(sum(joint.values()), 1.0, abs_tol=1e-4)
    counts = _cohort_counts(tiny_qwen3, prompt, params, depth, 600, cycle)
    assert chi_square_p_value(joint, counts, 600) > 1e-3


@pytest.mark.parametrize(("cycle", "module"), [("phased", "speculative"), ("fused", "fused_cohort")])
def test_a_wrong_accept_rule_in_cohorts_fails_the_same_test(tiny_qwen3, monkeypatch, cycle, module):
    import importlib

    rules = importlib.import_module(f"mtplxd.engine.decoding.{module}")
    monkeypatch.setattr(rules, "residual_distribution", lambda p, q: p)
    tiny_qwen3.trunk.compiled_graphs.clear()  # the fused graphs must trace the wrong rule
    try:
        params = SamplingParams(temperature=0.6, top_p=0.5)
        prompt = tiny_qwen3.tokenizer.encode("def add(a, b):\n    ret")
        joint = exact_joint(tiny_qwen3, prompt, params)
        counts = _cohort_counts(tiny_qwen3, prompt, params, 2, 600, cycle)
        assert chi_square_p_value(joint, counts, 600) < 1e-3
    finally:
        tiny_qwen3.trunk.compiled_graphs.clear()


def prefilled_twins(trunk, prompts: list[list[int]]) -> tuple[list, list]:
    """Two trunk caches per prompt, each prefilled with it: (solo caches, cohort caches)."""
    solo_caches, cohort_caches = [], []
    for ids in prompts:
        for caches in (solo_caches, cohort_caches):
            cache = trunk.make_cache()
            trunk.prefill(ids, cache)
            caches.append(cache)
    return solo_caches, cohort_caches


def test_batched_verify_logits_equal_each_rows_solo_forward(model):
    """The batched forward against per-row forwards on copies of the same caches: bitwise
    under a row-alone BLAS, to rounding under OpenBLAS (the reference-BLAS child checks bits)."""
    trunk = model.trunk
    assert batched_supported(trunk)
    prompts = [model.tokenizer.encode(PROMPTS[i]) for i in (0, 3, 6)]
    blocks = [mx.array([[5, 9, 11, 2]]), mx.array([[7, 7, 1, 3]]), mx.array([[1, 2, 3, 4]])]
    solo_caches, cohort_caches = prefilled_twins(trunk, prompts)
    solo = [trunk.forward(block, cache, all_logits=True) for block, cache in zip(blocks, solo_caches)]
    hidden, logits = batched_forward(trunk, mx.concatenate(blocks + [mx.zeros_like(blocks[0])]),
                                     cohort_caches + [None])
    for i, (solo_hidden, solo_logits) in enumerate(solo):
        assert same(logits[i:i + 1], solo_logits) and same(hidden[i:i + 1], solo_hidden), f"row {i}"
        offsets = [[e.offset for e in c if hasattr(e, "offset")] for c in (cohort_caches[i], solo_caches[i])]
        assert offsets[0] == offsets[1] and set(offsets[0]) == {len(prompts[i]) + 4}


@pytest.mark.skipif(ROWS_ALONE, reason="already on the reference BLAS")
def test_batched_verify_is_bitwise_on_the_reference_blas():
    run_on_reference_blas(f"{__file__}::test_batched_verify_logits_equal_each_rows_solo_forward",
                          f"{__file__}::test_two_rows_run_in_a_three_wide_cohort_with_a_padding_row",
                          f"{__file__}::test_a_mixed_depth_verify_gives_each_row_its_solo_forward",
                          expect_passed=5)


def test_cohorts_are_sealed_at_the_narrowest_width_that_holds_them():
    widths = normalize_widths([8, 3, 3])
    assert widths == (1, 3, 8)
    assert seal(1, widths) == [(1, 1)] and seal(2, widths) == [(2, 3)]
    assert seal(4, widths) == [(4, 8)] and seal(11, widths) == [(8, 8), (3, 3)]
    with pytest.raises(ValueError, match="numerics"):
        resolve_numerics("fast")
    assert resolve_numerics("exact") == "exact"


def test_mtp_rows_of_different_depths_share_a_cohort_and_ar_rows_keep_their_lane(tiny_qwen3):
    trunk = tiny_qwen3.trunk
    calls = [VerifyCall(trunk, mx.zeros((1, n), mx.int32), []) for n in (4, 1, 4, 3, 1, 7)]
    cohorts = group(calls, (1, 3, 8))
    assert cohorts == [([0, 2, 3, 5], 8), ([1, 4], 3)]


def test_a_mixed_depth_verify_gives_each_row_its_solo_forward(model):
    """Blocks of 4, 2 and 7 tokens (depths 3, 1, 6) right-padded into one forward: each row's
    logits and hidden are its solo ones, and its cache advances by its own length only."""
    trunk = model.trunk
    prompts = [model.tokenizer.encode(PROMPTS[i]) for i in (0, 3, 6)]
    blocks = [mx.array([[5, 9, 11, 2]]), mx.array([[7, 7]]), mx.array([[1, 2, 3, 4, 8, 6, 5]])]
    solo_caches, cohort_caches = prefilled_twins(trunk, prompts)
    solo = [trunk.forward(block, cache, all_logits=True) for block, cache in zip(blocks, solo_caches)]
    calls = [VerifyCall(trunk, block, cache) for block, cache in zip(blocks, cohort_caches)]
    answers = run_cohort(calls, 3, "throughput")
    for i, ((solo_hidden, solo_logits), (hidden, logits)) in enumerate(zip(solo, answers)):
        assert same(logits, solo_logits) and same(hidden, solo_hidden), f"row {i}"
        offsets = [[e.offset for e in c if hasattr(e, "offset")] for c in (cohort_caches[i], solo_caches[i])]
        assert offsets[0] == offsets[1] and set(offsets[0]) == {len(prompts[i]) + blocks[i].shape[1]}
    # The caches hold the same state: the next (uniform) verify agrees too.
    after = [trunk.forward(mx.array([[3, 1]]), cache, all_logits=True)[1] for cache in solo_caches]
    again = run_cohort([VerifyCall(trunk, mx.array([[3, 1]]), c) for c in cohort_caches], 3, "throughput")
    assert all(same(logits, want) for (_, logits), want in zip(again, after))


def test_a_failing_cohort_row_ends_only_itself(tiny_qwen3):
    model = tiny_qwen3
    scheduler = cohort_scheduler(max_concurrent=3, numerics="throughput")
    good = [request_for(model, i, depth=2, max_tokens=15) for i in (0, 3)]
    references = [solo_ar(model, r).token_ids for r in good]
    bad_request = request_for(model, 1, depth=2, max_tokens=50, ignore_eos=True)
    log: list = []
    bad = Collector("bad", log)

    def failing(stop, cohort):
        steps = model.generate_steps(bad_request, stop, cohort=cohort)
        answer, seen = None, 0
        while True:  # forwards the cohort's answers, and fails at its 4th verify
            item = steps.send(answer)
            if isinstance(item, VerifyCall):
                seen += 1
                if seen == 4:
                    raise FloatingPointError("NaN in the logits")
            answer = yield item

    sinks = [Collector("g0", log)]
    add_cohort_row(scheduler, model, good[0], sinks[0])
    scheduler.submit(Row(bad_request, failing, bad, cohort_capable=True))
    sinks.append(Collector("g1", log))
    add_cohort_row(scheduler, model, good[1], sinks[1])
    run_until_idle(scheduler)
    assert isinstance(bad.items[-1], RowFailure) and "NaN" in str(bad.items[-1].error)
    assert [s.result.token_ids for s in sinks] == references


def test_a_cohort_row_that_asks_for_a_verify_twice_in_one_cycle_fails_alone(tiny_qwen3):
    model = tiny_qwen3
    scheduler = cohort_scheduler(max_concurrent=2, numerics="throughput")
    good = request_for(model, 0, depth=2, max_tokens=12)
    bad_request = request_for(model, 1, depth=2, max_tokens=30, ignore_eos=True)
    log: list = []
    bad, sink = Collector("bad", log), Collector("good", log)

    def repeating(stop, cohort):
        steps = model.generate_steps(bad_request, stop, cohort=cohort)
        answer, verifies = None, 0
        while True:  # at its 3rd verify, asks for the same verify again instead of settling
            item = steps.send(answer)
            answer = yield item
            if isinstance(item, VerifyCall):
                verifies += 1
                if verifies == 3:
                    yield item

    add_cohort_row(scheduler, model, good, sink)
    scheduler.submit(Row(bad_request, repeating, bad, cohort_capable=True))
    run_until_idle(scheduler)
    assert isinstance(bad.items[-1], RowFailure) and "VerifyCall again" in str(bad.items[-1].error)
    assert sink.result.token_ids == solo_ar(model, good).token_ids


@pytest.mark.parametrize("cycle", ["phased", "fused"])
def test_a_slow_reader_pauses_only_its_own_row(tiny_qwen3, cycle):
    """Fused: the paused row stays in its slot, masked (its state kept) until it goes on."""
    scheduler = cohort_scheduler(max_concurrent=2, max_backlog=3, numerics="throughput",
                                 cohort_cycle=cycle)
    log: list = []
    slow, fast = Collector("slow", log), Collector("fast", log)
    slow_request = request_for(tiny_qwen3, 0, depth=2, max_tokens=40, ignore_eos=True)
    fast_request = request_for(tiny_qwen3, 1, depth=2, max_tokens=40, ignore_eos=True)
    slow_row = add_cohort_row(scheduler, tiny_qwen3, slow_request, slow)
    fast_row = add_cohort_row(scheduler, tiny_qwen3, fast_request, fast)
    turns = 0
    while not fast.items or not isinstance(fast.items[-1], GenerationResult):
        scheduler.turn()
        fast_row.consumed(fast_row.backlog)  # the fast reader takes everything at once
        turns += 1
        assert turns < 500
    assert slow_row.backlog == 3 and len(slow.items) == 3  # paused after its 3rd item
    assert scheduler.status()["paused"] == 1 and not scheduler.has_work()
    slow_row.consumed(3)
    run_until_idle_consuming(scheduler, slow_row)
    assert slow.result.token_ids == solo_ar(tiny_qwen3, slow_request).token_ids
    assert fast.result.token_ids == solo_ar(tiny_qwen3, fast_request).token_ids


def run_until_idle_consuming(scheduler: Scheduler, row: Row) -> None:
    turns = 0
    while scheduler.has_work():
        scheduler.turn()
        row.consumed(row.backlog)
        turns += 1
        assert turns < 1000


@pytest.mark.parametrize("cycle", ["phased", "fused"])
def test_auto_mode_moves_a_row_decoding_alone_into_the_cohorts_of_rows_that_join_it(model, cycle):
    """A long turn decodes alone in its solo loop; a second and third request arrive while it
    decodes. They decode in cohorts, and at its next cycle boundary the first row moves into
    them from its committed state: every row still equals its solo greedy AR output, and the
    first row's stats count the cycles of both loops."""
    scheduler = Scheduler(max_concurrent=4, cohort_mode="auto", numerics="throughput", cohort_cycle=cycle)
    log: list = []
    requests = [request_for(model, i, depth=2, max_tokens=(60, 30, 30)[i], ignore_eos=True)
                for i in range(3)]
    references = [solo_ar(model, r).token_ids for r in requests]
    sinks = [Collector(f"r{i}", log) for i in range(3)]
    rows = [add_cohort_row(scheduler, model, requests[0], sinks[0])]
    for _ in range(4):  # the first row starts alone: prefill and first token, then 3 solo cycles
        scheduler.turn()
    assert not rows[0].in_cohorts and rows[0].tokens > 1
    rows += [add_cohort_row(scheduler, model, r, s) for r, s in zip(requests[1:], sinks[1:])]
    run_until_idle(scheduler)
    assert [row.in_cohorts for row in rows] == [True, True, True]
    assert scheduler.status()["moved_into_cohorts"] == 1
    assert all(s.result.stats.cohort_widths.get("3", 0) > 0 for s in sinks)
    assert [s.result.token_ids for s in sinks] == references
    first = sinks[0].result.stats
    assert first.cycles > sum(first.cohort_widths.values())  # solo cycles, then cohort ones
    assert first.mean_accepted_length * first.cycles == pytest.approx(len(references[0]) - 1, abs=first.depth)


def test_a_seeded_sampled_row_that_moves_into_cohorts_draws_what_it_draws_alone(model):
    """The move hands over the row's whole state (caches, PENDING pairs, penalty history,
    seed): a seeded sampled row with a penalty gives its solo output token for token. The
    stepwise loop is the phased cohort row's solo twin (see the seeded test above)."""
    first = request_for(model, 0, depth=3, max_tokens=40, ignore_eos=True, temperature=0.9, top_p=0.95,
                        seed=77, presence_penalty=0.5)
    second = request_for(model, 1, depth=3, max_tokens=12, ignore_eos=True, temperature=0.7, seed=5)
    loop, model.trunk.decode_loop = model.trunk.decode_loop, "stepwise"
    try:
        reference = model.complete(first).token_ids
        scheduler = Scheduler(max_concurrent=2, cohort_mode="auto", numerics="throughput",
                              cohort_cycle="phased")
        log: list = []
        sinks = [Collector("first", log), Collector("second", log)]
        add_cohort_row(scheduler, model, first, sinks[0])
        for _ in range(3):
            scheduler.turn()
        add_cohort_row(scheduler, model, second, sinks[1])
        run_until_idle(scheduler)
    finally:
        model.trunk.decode_loop = loop
    assert scheduler.status()["moved_into_cohorts"] == 1
    assert sinks[0].result.stats.cohort_widths and sinks[0].result.token_ids == reference


def test_a_row_decoding_alone_stays_there_under_exact_numerics_and_when_cohorts_are_off(tiny_qwen3):
    """Under "exact" a cohort's rows run their own forwards, so moving would gain nothing;
    with cohorts "off" rows never batch."""
    for settings in (dict(cohort_mode="auto", numerics="exact"), dict(cohort_mode="off", numerics="throughput")):
        scheduler = Scheduler(max_concurrent=4, cohort_cycle="phased", **settings)
        log: list = []
        requests = [request_for(tiny_qwen3, i, depth=2, max_tokens=30, ignore_eos=True) for i in range(2)]
        references = [solo_ar(tiny_qwen3, r).token_ids for r in requests]
        sinks = [Collector(f"r{i}", log) for i in range(2)]
        rows = [add_cohort_row(scheduler, tiny_qwen3, requests[0], sinks[0])]
        scheduler.turn()
        scheduler.turn()
        rows.append(add_cohort_row(scheduler, tiny_qwen3, requests[1], sinks[1]))
        run_until_idle(scheduler)
        assert rows[0].in_cohorts is False and sinks[0].result.stats.cohort_widths == {}, settings
        assert scheduler.status()["moved_into_cohorts"] == 0
        assert [s.result.token_ids for s in sinks] == references


@pytest.mark.parametrize("cycle", ["phased", "fused"])
def test_auto_mode_puts_a_row_in_cohorts_when_others_arrive_before_it_decodes(tiny_qwen3, cycle):
    """Requests an agent sends together reach the daemon milliseconds apart: the first is
    admitted alone, but rows that arrive while it prefills (here: before its first decode
    cycle) find it in their cohort."""
    scheduler = Scheduler(max_concurrent=4, cohort_mode="auto", numerics="throughput", cohort_cycle=cycle)
    log: list = []
    requests = [request_for(tiny_qwen3, i, depth=2, max_tokens=30, ignore_eos=True) for i in range(3)]
    references = [solo_ar(tiny_qwen3, r).token_ids for r in requests]
    sinks = [Collector(f"r{i}", log) for i in range(3)]
    rows = [add_cohort_row(scheduler, tiny_qwen3, requests[0], sinks[0])]
    scheduler.turn()  # alone: prefilled, first token out, no decode cycle yet
    assert not rows[0].in_cohorts
    rows += [add_cohort_row(scheduler, tiny_qwen3, r, s) for r, s in zip(requests[1:], sinks[1:])]
    run_until_idle(scheduler)
    assert [row.in_cohorts for row in rows] == [True, True, True]
    assert all(s.result.stats.cohort_widths.get("3", 0) > 0 for s in sinks)
    assert [s.result.token_ids for s in sinks] == references
    # A row alone from start to end keeps the solo loop.
    lone = Collector("lone", log)
    add_cohort_row(scheduler, tiny_qwen3, requests[0], lone)
    run_until_idle(scheduler)
    assert lone.result.stats.cohort_widths == {} and lone.result.token_ids == references[0]


def test_on_the_owner_thread_a_paused_row_resumes_when_its_reader_catches_up(tiny_qwen3):
    import threading
    import time

    from mtplxd.engine.owner import ModelOwner

    owner = ModelOwner(scheduler=cohort_scheduler(max_concurrent=2, max_backlog=2,
                                                  numerics="throughput"))
    owner.start()
    requests = [request_for(tiny_qwen3, i, depth=2, max_tokens=30, ignore_eos=True) for i in (0, 1)]
    references = [solo_ar(tiny_qwen3, r).token_ids for r in requests]
    done = [threading.Event(), threading.Event()]
    items: list[list] = [[], []]
    rows: list[Row] = []

    def sink(i):
        def deliver(item):
            items[i].append(item)
            if i == 1:
                rows[1].consumed()  # the fast reader takes each item at once
            if isinstance(item, GenerationResult):
                done[i].set()
        return deliver

    try:
        for i, request in enumerate(requests):
            rows.append(Row(request, lambda stop, cohort, r=request: tiny_qwen3.generate_steps(
                r, stop, cohort=cohort), sink(i), cohort_capable=True))
        for row in rows:
            owner.submit_row(row)
        assert done[1].wait(60), "the fast row was held back by the slow reader"
        assert not done[0].is_set() and len(items[0]) == 2
        assert owner.scheduler.status()["paused"] == 1
        deadline = time.monotonic() + 60
        while not done[0].is_set():  # the slow reader now takes what waits, a bit at a time
            rows[0].consumed(rows[0].backlog)
            time.sleep(0.01)
            assert time.monotonic() < deadline
    finally:
        owner.stop()
    tokens = [t for item in items[0] if isinstance(item, TokenDelta) for t in item.token_ids]
    assert items[0][-1].token_ids == tokens == references[0]
    assert items[1][-1].token_ids == references[1]


@pytest.mark.parametrize("cycle", ["phased", "fused"])
def test_a_cancelled_cohort_row_leaves_at_the_next_cycle_and_its_neighbours_stay_exact(model, cycle):
    """Fused (dense model): its slot is freed and its cycle in flight dropped."""
    released = []
    scheduler = Scheduler(max_concurrent=3, cohort_mode="always", numerics="throughput",
                          cohort_cycle=cycle, admit=lambda request: lambda: released.append(request))
    requests = [request_for(model, i, depth=2, max_tokens=40, ignore_eos=True) for i in range(3)]
    references = [solo_ar(model, r).token_ids for r in (requests[0], requests[2])]
    log: list = []
    sinks = [Collector(f"r{i}", log) for i in range(3)]
    rows = [add_cohort_row(scheduler, model, r, s) for r, s in zip(requests, sinks)]
    for _ in range(4):
        scheduler.turn()
    rows[1].cancel()  # its client left mid-stream
    scheduler.turn()
    assert sinks[1].result.finish_reason == "cancelled" and released == [requests[1]]
    run_until_idle(scheduler)
    assert [sinks[0].result.token_ids, sinks[2].result.token_ids] == references
    assert len(released) == 3


def test_one_token_turns_beside_cohort_rows_end_on_their_first_token(tiny_qwen3):
    scheduler = cohort_scheduler(max_concurrent=4, numerics="throughput")
    requests = [request_for(tiny_qwen3, i, depth=(2, 2, 0, 2)[i], max_tokens=(1, 20, 1, 20)[i],
                            ignore_eos=True) for i in range(4)]
    references = [solo_ar(tiny_qwen3, r).token_ids for r in requests]
    log: list = []
    sinks = [Collector(f"r{i}", log) for i in range(4)]
    for request, sink in zip(requests, sinks):
        add_cohort_row(scheduler, tiny_qwen3, request, sink)
    run_until_idle(scheduler)
    assert [s.result.token_ids for s in sinks] == references
    assert [len(s.result.token_ids) for s in sinks] == [1, 20, 1, 20]
    assert sinks[0].result.stats.cohort_widths == {} and sinks[1].result.stats.cohort_widths
