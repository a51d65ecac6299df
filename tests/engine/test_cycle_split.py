"""The draft/verify time split of the flight recorder's decode samples (decoding/split.py).

One cycle per sample window runs timed (a sync after its drafts and after its verify); these
tests pin the sampling logic, that a timed cycle commits exactly what an untimed one does in
every decode loop (stepwise, fused, cohort rows; greedy and seeded sampled), and that the AR
lane carries no split at all.
"""

from __future__ import annotations

import pytest

import mtplxd.engine.generation as generation
from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.decoding.speculative import AcceptanceStats
from mtplxd.engine.decoding.split import CycleSplit
from mtplxd.engine.interface import GenerationStats
from mtplxd.engine.scheduler import Row, Scheduler
from support.rows import Collector, run_until_idle

SPLIT_KEYS = {"draft_ms", "verify_ms", "split_cycles", "split_source"}


def test_a_split_window_reports_per_cycle_means_then_starts_empty():
    split = CycleSplit()
    assert split.take() == {}  # no timed cycle: no keys, not zeros
    split.arm()
    split.record(0.002, 0.006)
    assert not split.armed  # one cycle per arm
    split.record(0.004, 0.010)
    assert split.take() == {"draft_ms": 3.0, "verify_ms": 8.0, "split_cycles": 2,
                            "split_source": "sampled"}
    assert split.take() == {}


def test_decode_samples_arm_one_timed_cycle_per_window_and_at_most_one_in_n_cycles(monkeypatch):
    monkeypatch.setattr(generation, "SPLIT_EVERY_CYCLES", 3)
    stats = GenerationStats(prompt_tokens=10, depth=2)
    acceptance, split = AcceptanceStats(2), CycleSplit()
    samples = generation.DecodeSamples(stats, arrived=0.0, start=1.0, acceptance=acceptance,
                                       split=split)
    assert split.armed  # the first window's first cycle is timed
    split.record(0.001, 0.003)
    acceptance.record(1, 2)
    samples.tick(1.5, generated=3)  # half a second: the window stays open, nothing re-arms
    assert not stats.samples and not split.armed
    acceptance.record(2, 3)
    samples.tick(2.0, generated=6)
    (sample,) = stats.samples
    assert sample["draft_ms"] == 1.0 and sample["verify_ms"] == 3.0 and sample["split_cycles"] == 1
    assert sample["cycles"] == 2 and not split.armed  # 2 cycles since the first: too soon
    acceptance.record(0, 1)
    samples.tick(3.0, generated=7)  # the third cycle: the window asks for its timed cycle
    assert split.armed and SPLIT_KEYS.isdisjoint(stats.samples[-1])
    acceptance.record(0, 1)
    samples.tick(3.2, generated=8, force=True)  # a window whose timed cycle never ran
    assert SPLIT_KEYS.isdisjoint(stats.samples[-1])


@pytest.fixture(scope="module")
def dense(tiny_model_factory):
    return load_model(tiny_model_factory("qwen3"), decode_loop="fused")


@pytest.fixture(scope="module")
def hybrid(tiny_model_factory):
    return load_model(tiny_model_factory("qwen3_5"))


def complete(model, depth: int, loop: str | None = None, **sampling):
    previous = model.trunk.decode_loop
    model.trunk.decode_loop = loop or previous
    try:
        ids = model.tokenizer.encode("def add(a, b):\n    ret")
        return model.complete(GenerationRequest(
            ids, SamplingParams(max_tokens=48, ignore_eos=True, **sampling), depth=depth))
    finally:
        model.trunk.decode_loop = previous


def timed_every_cycle(monkeypatch) -> None:
    """Close a sample window after every cycle and allow a timed one in each, so every cycle
    runs timed."""
    monkeypatch.setattr(generation, "SAMPLE_SECONDS", 0.0)
    monkeypatch.setattr(generation, "SPLIT_EVERY_CYCLES", 1)


def assert_split_in_every_sample(result) -> None:
    samples = result.stats.samples
    assert samples
    for sample in samples:
        assert sample["split_source"] == "sampled" and sample["split_cycles"] >= 1
        assert sample["draft_ms"] > 0 and sample["verify_ms"] > 0
        # A timed cycle runs inside its window: its two phases fit in the window's wall time
        # (`seconds` is rounded to the millisecond, hence the half millisecond).
        split_ms = (sample["draft_ms"] + sample["verify_ms"]) * sample["split_cycles"]
        assert split_ms <= sample["seconds"] * 1000 + 0.5


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("loop", ["fused", "stepwise"])
def test_timed_cycles_commit_the_same_tokens_as_untimed_ones(dense, monkeypatch, loop, sampling):
    untimed = complete(dense, 3, loop, **sampling)  # one timed cycle in a < 1 s request
    timed_every_cycle(monkeypatch)
    timed = complete(dense, 3, loop, **sampling)
    assert timed.token_ids == untimed.token_ids
    assert_split_in_every_sample(timed)
    if not sampling:  # and the exactness gate holds through timed cycles
        assert timed.token_ids == complete(dense, 0, loop).token_ids


def test_hybrid_timed_cycles_keep_greedy_mtp_equal_to_ar(hybrid, monkeypatch):
    reference = complete(hybrid, 0)
    timed_every_cycle(monkeypatch)
    timed = complete(hybrid, 2)
    assert timed.token_ids == reference.token_ids
    assert_split_in_every_sample(timed)


def test_ar_samples_carry_no_split(dense, monkeypatch):
    timed_every_cycle(monkeypatch)
    result = complete(dense, 0)
    assert result.stats.samples
    assert all(SPLIT_KEYS.isdisjoint(sample) for sample in result.stats.samples)


@pytest.mark.parametrize(("cycle", "sampling"), [("phased", {}), ("fused", {}),
                                                 ("fused", {"temperature": 0.8, "seed": 7})],
                         ids=["phased", "fused", "fused-seeded"])
def test_cohort_rows_time_the_shared_forward_and_commit_the_same_tokens(dense, monkeypatch,
                                                                        cycle, sampling):
    ids = [dense.tokenizer.encode(text) for text in ("def add(a, b):", "import os\nprint(")]
    requests = [GenerationRequest(i, SamplingParams(max_tokens=24, ignore_eos=True, **sampling),
                                  depth=2) for i in ids]
    # Greedy: each row's solo AR output; seeded: its solo (untimed) MTP output.
    references = [dense.complete(GenerationRequest(list(r.prompt_ids), r.sampling,
                                                   depth=2 if sampling else 0))
                  for r in requests]
    timed_every_cycle(monkeypatch)
    scheduler = Scheduler(cohort_mode="always", max_concurrent=2, numerics="throughput",
                          cohort_cycle=cycle)
    log: list = []
    sinks = [Collector(f"r{i}", log) for i in range(2)]
    for request, sink in zip(requests, sinks):
        scheduler.submit(Row(request, lambda stop, cohort, request=request: dense.generate_steps(
            request, stop, cohort=cohort), sink, cohort_capable=True))
    run_until_idle(scheduler)
    assert [s.result.token_ids for s in sinks] == [r.token_ids for r in references]
    for sink in sinks:
        assert sink.result.stats.cohort_widths.get("3", 0) > 0  # they did share cohorts
        assert_split_in_every_sample(sink.result)
