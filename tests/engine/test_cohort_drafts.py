"""Batched drafting: a cohort's MTP heads run together and each row drafts what it drafts alone.

Each row is built twice from the same state (trunk prefill, head cache, PENDING pairs): one
copy drafts alone (the solo code, CohortSpeculativeDecoder.prepare), the other with its
neighbours through cohort_drafts.draft_together. Drafts, their q and the head caches after
drafting must agree: bitwise on the reference BLAS (the child run below), to rounding under
OpenBLAS (drafts are tokens: equal there too on these tiny models).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.cohort import group, run_drafts
from mtplxd.engine.decoding.cohort_drafts import draft_together
from mtplxd.engine.decoding.cohort_rows import CohortSpeculativeDecoder, DraftCall
from mtplxd.engine.decoding.sampling import TokenHistory
from support.numerics import ROWS_ALONE, run_on_reference_blas, same
from support.rows import PROMPTS

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
PENALISED = SamplingParams(temperature=0.7, presence_penalty=0.5, seed=3)
GREEDY_PENALISED = SamplingParams(frequency_penalty=0.4)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def model(tiny_model_factory, request):
    return load_model(tiny_model_factory(request.param))


def row_twins(model, index: int, params: SamplingParams, depth: int, pending: int):
    """Two identical rows (solo, cohort) at a cycle start with `pending` PENDING pairs; the
    head cache already holds a few pairs. Returns their DraftCalls."""
    trunk, head = model.trunk, model.head
    prompt = model.tokenizer.encode(PROMPTS[index])
    size = trunk.embed(mx.array([[0]])).shape[-1]
    key = mx.random.key(100 + index)
    earlier = mx.random.normal((1, 5, size), key=key).astype(trunk.embed(mx.array([[0]])).dtype)
    pending_h = mx.random.normal((1, pending, size), key=mx.random.split(key)[0]).astype(earlier.dtype)
    pending_tokens = [(7 * index + 3 * j) % 60 + 1 for j in range(pending)]
    twins = []
    for _ in range(2):
        cache = trunk.make_cache()
        trunk.prefill(prompt, cache)
        decoder = CohortSpeculativeDecoder(trunk, head, cache, params, TokenHistory(
            model.info.vocab_size, prompt), seed=params.seed or 0, depth=depth)
        head(earlier, trunk.embed(mx.array([[5, 9, 2, 4, 1]])), decoder.head_cache)
        twins.append(DraftCall(decoder, len(prompt), prompt[-1], pending_h, pending_tokens))
    return twins


def assert_drafts_agree(solo, together, solo_calls, cohort_calls) -> None:
    for i, (a, b) in enumerate(zip(solo, together)):
        assert a.drafts.tolist() == b.drafts.tolist(), f"row {i}: drafts"
        assert same(b.block, a.block) and (a.head_start, a.head_committed) == (b.head_start, b.head_committed)
        assert len(a.q_rows) == len(b.q_rows) and all(same(q, p) for p, q in zip(a.q_rows, b.q_rows)), f"row {i}: q"
        head_a, head_b = solo_calls[i].decoder.head_cache[0], cohort_calls[i].decoder.head_cache[0]
        assert head_a.offset == head_b.offset, f"row {i}: head cache offset"
        n = head_a.offset
        assert same(head_b.keys[..., :n, :], head_a.keys[..., :n, :]), f"row {i}: head keys"
        assert same(head_b.values[..., :n, :], head_a.values[..., :n, :]), f"row {i}: head values"


@pytest.mark.parametrize("width", [3, 8])
def test_batched_drafting_gives_each_row_its_solo_drafts_with_ragged_pending_and_mixed_depths(
        model, width):
    # (params, depth, PENDING pairs): greedy and sampled rows, penalties, depths 3 and 2, PENDING
    # of 1..depth+1 pairs (ragged), and a first cycle's long PENDING (the row's pass runs alone).
    rows = [(GREEDY, 3, 4), (SAMPLED, 3, 1), (GREEDY, 2, 2), (PENALISED, 2, 3),
            (GREEDY_PENALISED, 3, 2), (GREEDY, 3, 9)][:width]
    twins = [row_twins(model, i, *row) for i, row in enumerate(rows)]
    solo_calls, cohort_calls = [t[0] for t in twins], [t[1] for t in twins]
    solo = [call.decoder.prepare(call) for call in solo_calls]
    together = draft_together(cohort_calls, width)
    assert_drafts_agree(solo, together, solo_calls, cohort_calls)
    assert [len(d.drafts.tolist()) for d in together] == [depth for _, depth, _ in rows]


def test_draft_calls_of_different_depths_share_one_cohort_and_exact_numerics_drafts_alone(model):
    twins = [row_twins(model, i, GREEDY, depth, 1) for i, depth in enumerate((3, 1, 2))]
    calls = [t[1] for t in twins]
    assert group(calls, (1, 3, 8)) == [([0, 1, 2], 3)]
    exact = run_drafts([t[0] for t in twins], 3, "exact")
    batched = run_drafts(calls, 3, "throughput")
    assert [d.drafts.tolist() for d in exact] == [d.drafts.tolist() for d in batched]


def test_a_cohort_cycle_runs_the_head_at_most_depth_times_whatever_its_width(tiny_qwen3, monkeypatch):
    """3 MTP rows at depth 3: each cohort cycle runs the batched head at most 3 times (the
    PENDING pass and 2 chained steps) for all its rows, and one verify."""
    import mtplxd.engine.cohort as cohort
    import mtplxd.engine.decoding.cohort_drafts as cohort_drafts
    from mtplxd.engine.scheduler import Row, Scheduler
    from support.rows import run_until_idle

    head_widths, draft_cohorts = [], []
    real_head, real_drafts = cohort_drafts.batched_head, cohort.draft_together
    monkeypatch.setattr(cohort_drafts, "batched_head",
                        lambda *args: head_widths.append(args[1].shape[0]) or real_head(*args))
    monkeypatch.setattr(cohort, "draft_together",
                        lambda calls, width: draft_cohorts.append(len(calls)) or real_drafts(calls, width))
    scheduler = Scheduler(max_concurrent=3, cohort_mode="always", numerics="throughput",
                          cohort_cycle="phased")
    results = {}
    for i in range(3):
        request = GenerationRequest(tiny_qwen3.tokenizer.encode(PROMPTS[i]),
                                    SamplingParams(max_tokens=12, ignore_eos=True), depth=3)
        scheduler.submit(Row(request, lambda stop, cohort, r=request: tiny_qwen3.generate_steps(
            r, stop, cohort=cohort), lambda item, i=i: results.__setitem__(i, item),
            cohort_capable=True))
    run_until_idle(scheduler)
    verifies = sum(scheduler.status()["cohorts_by_width"].values())
    assert len(draft_cohorts) == verifies and draft_cohorts[0] == 3
    assert len(head_widths) <= 3 * verifies and head_widths.count(3) >= 2 * draft_cohorts.count(3)
    assert all(len(results[i].token_ids) == 12 for i in range(3))


@pytest.mark.skipif(ROWS_ALONE, reason="already on the reference BLAS")
def test_batched_drafting_is_bitwise_on_the_reference_blas():
    run_on_reference_blas(f"{__file__}::test_batched_drafting_gives_each_row_its_solo_drafts_with_ragged_pending_and_mixed_depths",
                          expect_passed=4)
