"""The runaway-loop guard: the detector on token streams, and generations of a model that
really loops (a scripted checkpoint) and of healthy models, AR and MTP."""

from __future__ import annotations

import random

import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.decoding.repetition import RepetitionDetector
from mtplxd.engine.fixtures.scripted import write_scripted_checkpoint
from mtplxd.engine.interface import GenerationResult, RepetitionPolicy, TokenDelta

POLICY = RepetitionPolicy(min_tokens=60, min_repeats=6, hold_tokens=8)
LOOP = ["Intro text.", " one", " two", " three"]


def feed(tokens: list[int], policy: RepetitionPolicy = POLICY) -> tuple[list[bool], int]:
    detector = RepetitionDetector(policy)
    forming = []
    for token in tokens:
        detector.add(token)
        forming.append(detector.forming)
        if detector.loop_period():
            return forming, detector.loop_period()
    return forming, 0


def test_a_span_repeated_past_both_thresholds_is_a_loop_of_its_period():
    span = [5, 9, 2, 7]
    forming, period = feed([1, 2, 3] + span * 40)
    assert period == 4
    # 6 repeats of 4 tokens is 24 < 60: min_tokens decides when it ends.
    assert len(forming) == 3 + 60


def test_long_period_needs_min_repeats_copies():
    span = list(range(100, 150))  # 50 tokens
    _, period = feed(span * 5)
    assert period == 0  # 5 copies < min_repeats
    forming, period = feed(span * 7)
    assert period == 50 and len(forming) == 300


def test_random_text_never_holds_or_stops():
    rng = random.Random(0)
    tokens = [rng.randrange(400) for _ in range(5000)]
    forming, period = feed(tokens, RepetitionPolicy())
    assert period == 0 and not any(forming)


def test_a_repeat_that_breaks_is_released():
    forming, period = feed([1, 2, 3] * 5 + [9, 8, 7])
    assert period == 0
    assert any(forming) and not forming[-1]


@pytest.fixture(scope="module")
def looping(tmp_path_factory):
    return load_model(write_scripted_checkpoint(tmp_path_factory.mktemp("loop") / "loop", LOOP, loop_to=1))


def run(model, depth: int, repetition: RepetitionPolicy | None, max_tokens: int = 400, **sampling):
    request = GenerationRequest(model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "count"}], add_generation_prompt=True),
        SamplingParams(max_tokens=max_tokens, **sampling), depth=depth, repetition=repetition)
    items = list(model.generate(request))
    deltas = [i for i in items if isinstance(i, TokenDelta)]
    [result] = [i for i in items if isinstance(i, GenerationResult)]
    return deltas, result


@pytest.mark.parametrize("depth", [0, 3])
def test_a_loop_ends_early_as_length_and_its_repeats_never_stream(looping, depth):
    deltas, result = run(looping, depth, POLICY, temperature=0)
    streamed = "".join(d.text for d in deltas)
    assert result.finish_reason == "length" and result.stats.repetition_stop
    assert result.stats.repetition_period == 3
    assert result.stats.completion_tokens < 100  # not 400
    assert streamed == result.text
    assert streamed.startswith("Intro text. one two three one two three")
    # Kept: the intro, the first copy and the repeats written before holding began.
    assert len(result.token_ids) == 1 + 3 + POLICY.hold_tokens - 1
    # Every token generated is either kept or trimmed: decoding stopped at the detection.
    assert result.stats.completion_tokens == len(result.token_ids) + result.stats.repetition_trimmed_tokens


def test_greedy_mtp_equals_ar_with_the_guard_on(looping, tiny_qwen3):
    for model in (looping, tiny_qwen3):
        _, ar = run(model, 0, POLICY, temperature=0)
        _, mtp = run(model, 3, POLICY, temperature=0)
        assert (ar.token_ids, ar.text, ar.finish_reason) == (mtp.token_ids, mtp.text, mtp.finish_reason)


@pytest.mark.parametrize("depth", [0, 3])
def test_healthy_output_streams_the_same_deltas_with_the_guard_on_or_off(tiny_qwen3, depth):
    # Sampled (seeded) output of the random model does not repeat itself; its greedy output does.
    off_deltas, off = run(tiny_qwen3, depth, None, max_tokens=300, temperature=1.0, seed=7, ignore_eos=True)
    on_deltas, on = run(tiny_qwen3, depth, RepetitionPolicy(), max_tokens=300, temperature=1.0, seed=7, ignore_eos=True)
    assert not on.stats.repetition_stop and len(on.token_ids) > 100
    assert [(d.token_ids, d.text) for d in on_deltas] == [(d.token_ids, d.text) for d in off_deltas]
    assert (on.text, on.token_ids, on.finish_reason) == (off.text, off.token_ids, off.finish_reason)


def test_without_the_guard_a_loop_runs_to_max_tokens(looping):
    _, result = run(looping, 3, None, max_tokens=150, temperature=0)
    assert result.finish_reason == "length" and not result.stats.repetition_stop
    assert result.stats.completion_tokens == 150
