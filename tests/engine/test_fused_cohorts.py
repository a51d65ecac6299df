"""Fused cohort cycles (decoding/fused_cohort.py): every row exact, whatever runs beside it (CPU).

The scheduler is turned by hand on the test thread, so "joins at cycle n" is exact. Rows run
with cohort_cycle "fused" and numerics "throughput" (the fused cycle's forwards are batched);
on the reference BLAS the batched forwards compute each row alone, so greedy rows equal their
solo greedy AR output and seeded sampled rows their solo fused output, bit for bit; the
reference-BLAS child runs them there when this machine's BLAS is OpenBLAS. The chi-square
tests of sampled rows, the slow reader and the cancelled row run for both cohort cycles in
test_cohorts.py.
"""

from __future__ import annotations

import pytest

from mtplxd.engine import GenerationRequest, SamplingParams
from mtplxd.engine.decoding.fused_cohort import FusedCohortRow
from mtplxd.engine.scheduler import Row, Scheduler
from support.numerics import ROWS_ALONE, run_on_reference_blas
from support.rows import PROMPTS, Collector, assert_each_row_equals, run_until_idle


def request_for(model, index: int, *, depth: int, max_tokens: int, **sampling) -> GenerationRequest:
    ids = model.tokenizer.encode(PROMPTS[index % len(PROMPTS)])
    return GenerationRequest(ids, SamplingParams(max_tokens=max_tokens, **sampling), depth=depth)


def fused_scheduler(**settings) -> Scheduler:
    return Scheduler(cohort_mode="always", numerics="throughput", cohort_cycle="fused", **settings)


def add_row(scheduler: Scheduler, model, request: GenerationRequest, sink) -> Row:
    return scheduler.submit(Row(request, lambda stop, cohort: model.generate_steps(
        request, stop, cohort=cohort), sink, cohort_capable=True))


def joining(model, scheduler: Scheduler, requests: list[GenerationRequest],
            gaps: list[int] | None = None) -> list[Collector]:
    """Row i joins after gaps[i] turns (default 1) of the rows before it; turn until idle."""
    log: list = []
    sinks = []
    for i, request in enumerate(requests):
        sinks.append(Collector(f"r{i}", log))
        add_row(scheduler, model, request, sinks[-1])
        for _ in range(1 if gaps is None else gaps[i]):
            scheduler.turn()
    run_until_idle(scheduler)
    return sinks


@pytest.mark.parametrize("width", [3, 8])
def test_fused_cohort_rows_joining_at_different_cycles_equal_their_solo_greedy_ar_output(
        tiny_qwen3, width, monkeypatch):
    model = tiny_qwen3
    rows_made = []
    real_init = FusedCohortRow.__init__

    def counting_init(self, *args, **kwargs):
        rows_made.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(FusedCohortRow, "__init__", counting_init)
    depths = [3, 3, 2, 0, 3, 3, 0, 3]  # depth 2 forms its own fused cohort; depth 0: AR lane
    # Different lengths; row 1 may stop at EOS; rows join 1 to 3 turns apart.
    requests = [request_for(model, i, depth=depths[i], max_tokens=30 + 7 * i, ignore_eos=i != 1)
                for i in range(width)]
    references = [model.complete(GenerationRequest(list(r.prompt_ids), r.sampling, depth=0))
                  for r in requests]
    scheduler = fused_scheduler(max_concurrent=width)
    sinks = joining(model, scheduler, requests, gaps=[1 + i % 3 for i in range(width)])
    assert_each_row_equals(sinks, references, depths)
    assert len(rows_made) == sum(d > 0 for d in depths[:width])  # every MTP row ran fused
    mtp = [s for s, d in zip(sinks, depths) if d > 0]
    assert all(s.result.stats.cycles > 0 and s.result.stats.cohort_widths for s in mtp)
    widths_run = {w for w, n in scheduler.status()["cohorts_by_width"].items() if n}
    assert widths_run >= ({3, 8} if width == 8 else {3})
    assert not any(c.rows for c in scheduler.fused.cohorts)  # every slot was freed


def test_a_greedy_fused_row_with_penalties_equals_its_solo_fused_output(tiny_qwen3):
    model = tiny_qwen3
    penalised = dict(repetition_penalty=1.3, presence_penalty=0.4, ignore_eos=True)
    requests = [request_for(model, i, depth=3, max_tokens=24, **penalised) for i in range(3)]
    references = [model.complete(r) for r in requests]  # the solo fused loop
    scheduler = fused_scheduler(max_concurrent=3)
    sinks = joining(model, scheduler, requests)
    assert_each_row_equals(sinks, references, [3, 3, 3])


def test_seeded_sampled_fused_rows_equal_their_solo_output_whatever_runs_beside_them(tiny_qwen3):
    model = tiny_qwen3
    sampled = dict(temperature=0.9, top_p=0.95, seed=1234)
    requests = [request_for(model, i, depth=2, max_tokens=16, **sampled) for i in range(3)]
    # The solo fused loop draws the same per-cycle numbers (same seed, same position).
    references = [model.complete(r).token_ids for r in requests]
    neighbours = [request_for(model, 5 + i, depth=2, max_tokens=20 + 9 * i, temperature=0.9,
                              top_p=0.95, seed=i) for i in range(2)]
    scheduler = fused_scheduler(max_concurrent=5)
    sinks = joining(model, scheduler, [neighbours[0], *requests, neighbours[1]])
    assert [s.result.token_ids for s in sinks[1:4]] == references
    # Alone in its own cohort, with other neighbours, each row gives the same again.
    scheduler = fused_scheduler(max_concurrent=2)
    sinks = joining(model, scheduler, [requests[2], neighbours[1]], gaps=[3, 1])
    assert sinks[0].result.token_ids == references[2]


def test_a_fused_row_hands_the_session_bank_its_committed_caches(tiny_model_factory):
    from mtplxd.engine import load_model
    from mtplxd.engine.session.bank import BankSettings

    model = load_model(tiny_model_factory("qwen3"))
    model.enable_session_bank(BankSettings())
    base = model.tokenizer.encode(PROMPTS[6])
    scheduler = fused_scheduler(max_concurrent=3)
    log: list = []
    first = Collector("first", log)
    add_row(scheduler, model, request_for(model, 3, depth=3, max_tokens=30), Collector("n", log))
    add_row(scheduler, model, GenerationRequest(base, SamplingParams(max_tokens=12), depth=2), first)
    run_until_idle(scheduler)
    follow = base + first.result.token_ids + model.tokenizer.encode(" pop")
    reference = load_model(tiny_model_factory("qwen3")).complete(
        GenerationRequest(follow, SamplingParams(max_tokens=10), depth=0))
    warm = Collector("warm", log)
    add_row(scheduler, model, request_for(model, 4, depth=2, max_tokens=20), Collector("m", log))
    add_row(scheduler, model, GenerationRequest(follow, SamplingParams(max_tokens=10), depth=2), warm)
    run_until_idle(scheduler)
    stats = warm.result.stats
    assert stats.restored_from == "ram" and stats.cached_tokens > len(base)  # its output too
    assert warm.result.token_ids == reference.token_ids
    assert stats.cohort_widths  # it ran in a cohort


def test_a_row_that_moved_into_a_cohort_hands_the_session_bank_its_committed_caches(tiny_model_factory):
    """Auto mode: a turn decodes alone, another request joins, the first moves into the fused
    cohort mid-turn; the bank keeps what it committed, and the follow-up turn restores it and
    gives the solo answer."""
    from mtplxd.engine import load_model
    from mtplxd.engine.session.bank import BankSettings

    model = load_model(tiny_model_factory("qwen3"))
    model.enable_session_bank(BankSettings())
    base = model.tokenizer.encode(PROMPTS[6])
    scheduler = Scheduler(max_concurrent=3, cohort_mode="auto", numerics="throughput", cohort_cycle="fused")
    log: list = []
    first = Collector("first", log)
    add_row(scheduler, model, GenerationRequest(base, SamplingParams(max_tokens=30, ignore_eos=True), depth=2),
            first)
    for _ in range(3):
        scheduler.turn()
    add_row(scheduler, model, request_for(model, 3, depth=2, max_tokens=40, ignore_eos=True), Collector("n", log))
    run_until_idle(scheduler)
    assert scheduler.status()["moved_into_cohorts"] == 1 and first.result.stats.cohort_widths
    follow = base + first.result.token_ids + model.tokenizer.encode(" pop")
    reference = load_model(tiny_model_factory("qwen3")).complete(
        GenerationRequest(follow, SamplingParams(max_tokens=10), depth=0))
    warm = Collector("warm", log)
    add_row(scheduler, model, GenerationRequest(follow, SamplingParams(max_tokens=10), depth=2), warm)
    run_until_idle(scheduler)
    stats = warm.result.stats
    assert stats.restored_from == "ram" and stats.cached_tokens > len(base) + 20  # its output too
    assert warm.result.token_ids == reference.token_ids


def test_rows_of_different_sampling_settings_share_one_fused_cohort_and_each_stays_its_solo_self(
        tiny_qwen3):
    """Greedy, penalised and sampled rows (top-p, top-k, min-p, each its own temperature and
    seed) in one cohort: one graph, each row's settings a row of its table (row_sampling.py);
    each row gives its solo fused loop's tokens."""
    model = tiny_qwen3
    settings = [dict(ignore_eos=True),
                dict(repetition_penalty=1.3, frequency_penalty=0.2, ignore_eos=True),
                dict(temperature=0.9, top_p=0.95, seed=11),
                dict(temperature=0.7, top_k=5, seed=12),
                dict(temperature=1.0, min_p=0.1, presence_penalty=0.5, seed=13)]
    requests = [request_for(model, i, depth=2, max_tokens=18 + 3 * i, **sampling)
                for i, sampling in enumerate(settings)]
    references = [model.complete(r).token_ids for r in requests]  # the solo fused loop
    scheduler = fused_scheduler(max_concurrent=5)
    sinks = joining(model, scheduler, requests, gaps=[1, 2, 1, 3, 1])
    assert [s.result.token_ids for s in sinks] == references
    assert all(s.result.stats.cohort_widths.get("8", 0) > 0 for s in sinks)  # together


@pytest.mark.skipif(ROWS_ALONE, reason="already on the reference BLAS")
def test_fused_cohort_rows_are_exact_on_the_reference_blas():
    run_on_reference_blas(f"{__file__}::test_fused_cohort_rows_joining_at_different_cycles_equal_their_solo_greedy_ar_output",
                          f"{__file__}::test_a_greedy_fused_row_with_penalties_equals_its_solo_fused_output",
                          f"{__file__}::test_seeded_sampled_fused_rows_equal_their_solo_output_whatever_runs_beside_them",
                          f"{__file__}::test_rows_of_different_sampling_settings_share_one_fused_cohort_and_each_stays_its_solo_self",
                          expect_passed=5)


def test_the_per_row_write_fallback_writes_what_the_scatter_writes(monkeypatch):
    """RowsKVCache writes each row at its own offset; where put_along_axis is missing it
    writes row by row (slice_update, as the single-stream cache does), to the same bits."""
    import mlx.core as mx

    from mtplxd.engine.decoding import fused

    buffers = mx.random.normal((3, 2, 16, 8), key=mx.random.key(1))
    new = mx.random.normal((3, 2, 4, 8), key=mx.random.key(2))
    offsets = mx.array([0, 5, 12], mx.int32)
    written = {}
    for works in (True, False):
        monkeypatch.setattr(fused, "_SCATTER_WORKS", works)
        written[works] = fused.RowsKVCache(buffers, buffers, offsets).update_and_fetch(new, new)[0]
    assert mx.array_equal(written[True], written[False])
    for w, offset in enumerate([0, 5, 12]):
        assert mx.array_equal(written[True][w, :, offset:offset + 4], new[w])
        assert mx.array_equal(written[True][w, :, :offset], buffers[w, :, :offset])


def test_a_failing_fused_cohort_ends_its_rows_only_and_the_next_rows_run(tiny_qwen3, monkeypatch):
    from mtplxd.engine.decoding.fused_cohort import FusedCohort
    from mtplxd.engine.scheduler import RowFailure

    model = tiny_qwen3
    launch = FusedCohort._launch
    calls = []

    def failing_launch(self, active):
        if self.depth == 2:  # the depth-2 cohort's third cycle fails
            calls.append(len(active))
            if len(calls) == 3:
                raise RuntimeError("device lost")
        return launch(self, active)

    monkeypatch.setattr(FusedCohort, "_launch", failing_launch)
    scheduler = fused_scheduler(max_concurrent=3)
    log: list = []
    sinks = [Collector(f"r{i}", log) for i in range(3)]
    requests = [request_for(model, i, depth=(2, 2, 3)[i], max_tokens=30, ignore_eos=True)
                for i in range(3)]
    for request, sink in zip(requests, sinks):
        add_row(scheduler, model, request, sink)
    run_until_idle(scheduler)
    assert all(isinstance(s.items[-1], RowFailure) and "device lost" in str(s.items[-1].error)
               for s in sinks[:2])
    assert scheduler.status()["failed"] == 2
    # The depth-3 row ran in its own fused cohort, which went on.
    neighbour = model.complete(GenerationRequest(list(requests[2].prompt_ids), requests[2].sampling, depth=0))
    assert sinks[2].result.token_ids == neighbour.token_ids
    later = Collector("later", log)
    request = request_for(model, 4, depth=2, max_tokens=12, ignore_eos=True)
    add_row(scheduler, model, request, later)
    run_until_idle(scheduler)
    reference = model.complete(GenerationRequest(list(request.prompt_ids), request.sampling, depth=0))
    assert later.result.token_ids == reference.token_ids


def test_a_hybrid_model_keeps_the_phased_cohorts_under_the_fused_setting(tiny_model_factory, monkeypatch):
    """Gated DeltaNet state is rolled back on the host: hybrid rows run phased cohorts even
    with cohort_cycle "fused", and stay exact."""
    from mtplxd.engine import load_model

    model = load_model(tiny_model_factory("qwen3_5"))
    made = []
    monkeypatch.setattr(FusedCohortRow, "__init__", lambda self, *a, **k: made.append(self))
    requests = [request_for(model, i, depth=2, max_tokens=20, ignore_eos=True) for i in range(3)]
    references = [model.complete(GenerationRequest(list(r.prompt_ids), r.sampling, depth=0))
                  for r in requests]
    scheduler = fused_scheduler(max_concurrent=3)
    sinks = joining(model, scheduler, requests)
    assert_each_row_equals(sinks, references, [2, 2, 2])
    assert made == [] and scheduler.status()["cohorts_by_width"][3] > 0


def test_each_rows_sampling_steps_give_its_solo_numbers_bit_for_bit():
    """row_sampling's per-row penalties, filters and temperature against sampling.py's with
    each row's own scalars: equal bits for every row, whatever the other rows use."""
    import mlx.core as mx

    from mtplxd.engine.decoding import row_sampling, sampling

    settings = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9),
                SamplingParams(temperature=1.3, top_k=7, repetition_penalty=1.2),
                SamplingParams(temperature=0.5, min_p=0.05, frequency_penalty=0.3,
                               presence_penalty=0.4),
                SamplingParams(temperature=0.9, top_p=1.0, top_k=0)]
    vocab = 64
    logits = mx.random.normal((len(settings), 3, vocab), key=mx.random.key(7)) * 4
    counts = mx.floor(mx.random.uniform(shape=(len(settings), 3, vocab), key=mx.random.key(8)) * 2)
    seen = counts + (mx.random.uniform(shape=counts.shape, key=mx.random.key(9)) > 0.7)
    features = row_sampling.features_of(settings, vocab)
    table = row_sampling.settings_table(settings, vocab)
    penalised = row_sampling.penalties(logits, features, table, counts, seen)
    scaled = row_sampling.scaled_logits(penalised, features, table)
    drafted = row_sampling.draft_weights(penalised, features, table)
    for i, params in enumerate(settings):
        solo = sampling.apply_penalties(logits[i], params, counts[i], seen[i])
        assert mx.array_equal(penalised[i], solo), f"row {i} penalties"
        if not params.greedy:
            assert mx.array_equal(scaled[i], sampling.scaled_logits(solo, params), equal_nan=True), i
            assert mx.array_equal(drafted[i], sampling.draft_weights(solo, params)), f"row {i} q"


def test_a_fused_cohort_cycle_launches_as_many_kernels_at_every_width_about_the_lone_cycles(tiny_qwen3):
    """On a launch-bound GPU a cycle costs its kernels: a cohort cycle of 8 rows must launch
    as many as one of 3 (nothing per row in the graph), and at most a few more than the lone
    fused cycle (the inactive rows' selects of the next state; on the embedded model's 22
    layers the shared write index makes it fewer). bench.cycle_kernels counts them from the
    compiled graphs."""
    from mtplxd.engine.bench.cycle_kernels import measure
    from mtplxd.engine.decoding.fused import route_static_cache_attention

    route_static_cache_attention()
    figures = measure(tiny_qwen3.trunk, tiny_qwen3.head, 3, [1, 3, 8], builds=1)
    for mode, work in figures.items():
        kernels = {name: figure["kernels"] for name, figure in work.items()}
        assert kernels["3"] == kernels["8"], (mode, kernels)
        assert abs(kernels["1"] - kernels["3"]) <= 1, (mode, kernels)  # fusion at W=1 may differ
        assert kernels["3"] <= kernels["lone"] + 8, (mode, kernels)


def test_the_cycle_bench_times_lone_and_cohort_cycles_with_their_state_threaded(tiny_qwen3):
    """bench.cycle_kernels --time-cycles runs each cycle on from its own output state (as the
    loops do) and reports pipelined and synced ms per cycle beside the kernel counts."""
    from mtplxd.engine.bench.cycle_kernels import measure
    from mtplxd.engine.decoding.fused import route_static_cache_attention

    route_static_cache_attention()
    figures = measure(tiny_qwen3.trunk, tiny_qwen3.head, 2, [3], builds=1, modes=["greedy"],
                      time_cycles=3)
    assert list(figures) == ["greedy"]
    for name in ("lone", "3"):
        work = figures["greedy"][name]
        assert work["kernels"] > 0 and work["pipelined_ms"] > 0 and work["synced_ms"] > 0, (name, work)
