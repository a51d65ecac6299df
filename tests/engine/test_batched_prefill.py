"""Rows that prefill in the same scheduler turn share their prefill forwards (cohort.run_prefills).

With "throughput" numerics each cohort row hands its prefill chunks to the scheduler, which
runs the turn's chunks as one batched forward (right-padded to the longest, each row's
attention and cache its own, at most one solo chunk's tokens per forward). The rows' output
stays their solo output: greedy rows equal their solo greedy AR output (bitwise on the
reference BLAS: a child process runs these tests there), with the session bank's restore and
on the hybrid family too. "exact" numerics run each chunk alone.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.cohort import _packed, run_prefills
from mtplxd.engine.model.trunk import PrefillChunk
from mtplxd.engine.scheduler import Row, Scheduler
from support.numerics import ROWS_ALONE, run_on_reference_blas, same
from support.rows import PROMPTS, Collector, assert_each_row_equals, run_until_idle

CHUNK = 6  # tokens per prefill forward: the prompts below take 1 to 5 chunks


def arriving_together(model, requests: list[GenerationRequest], numerics: str = "throughput",
                      cycle: str = "fused") -> tuple[Scheduler, list[Collector]]:
    """Submit every request before the first turn (they arrive together); turn until idle."""
    scheduler = Scheduler(max_concurrent=len(requests), cohort_mode="always", numerics=numerics,
                          cohort_cycle=cycle)
    log: list = []
    sinks = [Collector(f"r{i}", log) for i in range(len(requests))]
    for request, sink in zip(requests, sinks):
        scheduler.submit(Row(request, lambda stop, cohort, r=request: model.generate_steps(r, stop, cohort=cohort),
                             sink, cohort_capable=True))
    run_until_idle(scheduler)
    return scheduler, sinks


def request(model, index: int, depth: int, max_tokens: int = 16) -> GenerationRequest:
    return GenerationRequest(model.tokenizer.encode(PROMPTS[index]), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                             depth=depth, prefill_chunk=CHUNK)


def solo_ar(model, r: GenerationRequest):
    return model.complete(GenerationRequest(list(r.prompt_ids), r.sampling, depth=0, prefill_chunk=r.prefill_chunk))


@pytest.mark.parametrize("cycle", ["fused", "phased"])
def test_rows_arriving_together_prefill_in_shared_forwards_and_equal_their_solo_greedy_ar_output(tiny_qwen3, cycle):
    model = tiny_qwen3
    depths = [3, 2, 0, 3]  # an AR-lane row (depth 0) prefills with the MTP rows
    requests = [request(model, i, depths[i]) for i in (0, 1, 2, 3)]
    requests[3] = request(model, 6, 3)  # the longest prompt: chunks go on after the others end
    references = [solo_ar(model, r) for r in requests]
    scheduler, sinks = arriving_together(model, requests, cycle=cycle)
    assert_each_row_equals(sinks, references, depths)
    chunks = [math.ceil(len(r.prompt_ids) / CHUNK) for r in requests]
    assert [s.result.stats.prefill_chunks for s in sinks] == chunks
    counters = scheduler.status()
    # Turn t batches the rows that still have a chunk t: a forward for every turn that two share.
    assert counters["prefill_batches"] == sum(1 for t in range(max(chunks)) if sum(c > t for c in chunks) > 1)
    assert counters["prefill_batched_chunks"] == sum(sum(c > t for c in chunks) for t in range(max(chunks))
                                                     if sum(c > t for c in chunks) > 1)


def test_exact_numerics_prefill_each_row_alone(tiny_qwen3):
    model = tiny_qwen3
    requests = [request(model, i, 3) for i in (0, 3, 6)]
    references = [solo_ar(model, r) for r in requests]
    scheduler, sinks = arriving_together(model, requests, numerics="exact", cycle="phased")
    assert_each_row_equals(sinks, references, [3, 3, 3])
    assert scheduler.status()["prefill_batches"] == 0


def test_a_banked_prefix_and_cold_prompts_prefill_together(tiny_model_factory):
    """A row restores its prefix from the session bank and prefills only the rest, in the
    same forwards as rows that prefill cold."""
    from mtplxd.engine.session.bank import BankSettings

    model = load_model(tiny_model_factory("qwen3"))
    model.enable_session_bank(BankSettings())
    base = request(model, 6, 3, max_tokens=8)
    _, (first,) = arriving_together(model, [base])
    follow = GenerationRequest(base.prompt_ids + first.result.token_ids + model.tokenizer.encode(" pop(self)"),
                               SamplingParams(max_tokens=12, ignore_eos=True), depth=3, prefill_chunk=CHUNK)
    requests = [follow, request(model, 3, 3), request(model, 0, 2)]
    references = [solo_ar(load_model(tiny_model_factory("qwen3")), r) for r in requests]
    scheduler, sinks = arriving_together(model, requests)
    assert_each_row_equals(sinks, references, [3, 3, 2])
    assert sinks[0].result.stats.restored_from == "ram" and sinks[0].result.stats.cached_tokens > len(base.prompt_ids)
    assert scheduler.status()["prefill_batches"] > 0


def test_hybrid_rows_prefill_together_with_their_deltanet_state_their_own(tiny_model_factory):
    model = load_model(tiny_model_factory("qwen3_5"))
    requests = [request(model, i, 2, max_tokens=12) for i in (0, 3, 6)]
    references = [solo_ar(model, r) for r in requests]
    scheduler, sinks = arriving_together(model, requests)
    assert_each_row_equals(sinks, references, [2, 2, 2])
    assert scheduler.status()["prefill_batches"] > 0


def test_a_failing_shared_prefill_ends_its_rows_only_and_later_rows_prefill_together(tiny_qwen3, monkeypatch):
    from mtplxd.engine import cohort
    from mtplxd.engine.scheduler import RowFailure

    model = tiny_qwen3
    shared = cohort._prefill_together
    failures = []

    def failing_once(trunk, calls):
        if not failures:
            failures.append(len(calls))
            raise RuntimeError("out of memory")
        return shared(trunk, calls)

    monkeypatch.setattr(cohort, "_prefill_together", failing_once)
    requests = [request(model, i, 3) for i in (0, 3)]
    scheduler, sinks = arriving_together(model, requests)
    assert failures == [2]
    assert all(isinstance(s.items[-1], RowFailure) and "out of memory" in str(s.items[-1].error) for s in sinks)
    assert scheduler.status()["failed"] == 2 and scheduler.status()["running"] == 0
    later = [request(model, i, 2) for i in (1, 6)]
    scheduler, sinks = arriving_together(model, later)
    assert_each_row_equals(sinks, [solo_ar(model, r) for r in later], [2, 2])
    assert scheduler.status()["prefill_batches"] > 0


def test_a_prefill_that_fails_alone_ends_its_own_row_only(tiny_qwen3, monkeypatch):
    from mtplxd.engine.scheduler import RowFailure

    model = tiny_qwen3
    requests = [request(model, i, 3) for i in (0, 3, 6)]
    broken = requests[1].prompt_ids[:CHUNK]
    run = PrefillChunk.run

    def failing_for_one_prompt(self):
        if self.tokens[0].tolist() == broken:
            raise RuntimeError("out of memory")
        return run(self)

    monkeypatch.setattr(PrefillChunk, "run", failing_for_one_prompt)
    scheduler, sinks = arriving_together(model, requests, numerics="exact", cycle="phased")
    assert isinstance(sinks[1].items[-1], RowFailure) and "out of memory" in str(sinks[1].items[-1].error)
    monkeypatch.setattr(PrefillChunk, "run", run)
    assert_each_row_equals([sinks[0], sinks[2]], [solo_ar(model, requests[i]) for i in (0, 2)], [3, 3])
    assert scheduler.status()["failed"] == 1


def test_a_shared_prefill_forward_gives_each_row_its_solo_hidden_logits_and_cache(tiny_qwen3):
    trunk = tiny_qwen3.trunk
    prompts = [tiny_qwen3.tokenizer.encode(PROMPTS[i])[:CHUNK] for i in (0, 2, 6)]
    solo, together = [], []
    for answers, batched in ((solo, False), (together, True)):
        caches = [trunk.make_cache() for _ in prompts]
        calls = [PrefillChunk(trunk, mx.array(p)[None], c) for p, c in zip(prompts, caches)]
        got, forwards = run_prefills(calls, share=True) if batched else ([c.run() for c in calls], [])
        assert forwards == ([3] if batched else [])
        answers += [(hidden, logits, [(layer.keys, layer.values) for layer in cache])
                    for (hidden, logits), cache in zip(got, caches)]
    for (h1, l1, c1), (h2, l2, c2), p in zip(solo, together, prompts):
        assert h2.shape == (1, len(p), h1.shape[-1]) and l2.shape == l1.shape == (1, 1, l1.shape[-1])
        assert same(h2, h1) and same(l2, l1)
        for (k1, v1), (k2, v2) in zip(c1, c2):
            assert same(k2[..., :len(p), :], k1[..., :len(p), :]) and same(v2[..., :len(p), :], v1[..., :len(p), :])


def test_a_shared_forward_holds_at_most_one_solo_chunks_tokens():
    lengths = [3, 4, 2, 9, 1, 16, 1]
    batches = [[lengths[i] for i in batch] for batch in _packed(list(range(len(lengths))), lengths, 16)]
    assert batches == [[3, 4, 2], [9], [1], [16], [1]]
    assert all(len(batch) * max(batch) <= 16 for batch in batches)


def test_only_chunks_near_their_prompts_start_share_a_forward(tiny_qwen3):
    """Chunks that end past SHARED_PREFILL_SPAN (a long prompt's later chunks, bound by
    attention over their context) run alone; the others still share, in their order."""
    from mtplxd.engine.cohort import SHARED_PREFILL_SPAN

    trunk = tiny_qwen3.trunk
    caches = [trunk.make_cache() for _ in range(3)]
    far = SHARED_PREFILL_SPAN - 1  # its 2 tokens end one past the span
    tokens = [mx.array([[5, 6, 7, 8]]), mx.array([[9, 10]]), mx.array([[11, 12, 13]])]
    calls = [PrefillChunk(trunk, t, c, position=p) for t, c, p in zip(tokens, caches, (0, far, 0))]
    answers, forwards = run_prefills(calls, share=True)
    assert forwards == [2]  # rows 0 and 2 shared one forward; row 1 ran alone
    for call, (hidden, logits), t in zip(calls, answers, tokens):
        alone = PrefillChunk(trunk, t, trunk.make_cache()).run()
        assert hidden.shape == alone[0].shape and same(logits, alone[1])


@pytest.mark.skipif(ROWS_ALONE, reason="already on the reference BLAS")
def test_batched_prefill_rows_are_exact_on_the_reference_blas():
    run_on_reference_blas(f"{__file__}::test_rows_arriving_together_prefill_in_shared_forwards_and_equal_their_solo_greedy_ar_output",
                          f"{__file__}::test_a_shared_prefill_forward_gives_each_row_its_solo_hidden_logits_and_cache",
                          expect_passed=3)
