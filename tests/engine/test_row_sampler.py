"""The AR step's compiled sampler chain (sampling.row_sampler): the same tokens as the
uncompiled definition (`pick`) where both are deterministic, keys from the device, a bounded
cache of compiled settings, and AR with no penalty leaves the history alone."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtplxd.engine import GenerationRequest, SamplingParams
from mtplxd.engine.decoding import sampling
from mtplxd.engine.decoding.sampling import TokenHistory, pick, row_sampler, seed_words

V = 97


def _rows(seed):
    logits = mx.random.normal((1, V), key=mx.random.key(seed)) * 3
    history = TokenHistory(V, [3, 5, 5, 9])
    history.append([7, 7, 11])
    counts, seen = history.rows(None, 1)
    return logits, counts, seen


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4),
], ids=["plain", "repetition", "presence-frequency"])
def test_greedy_compiled_chain_picks_what_pick_picks(params):
    sample = row_sampler(params)
    for seed in range(20):
        logits, counts, seen = _rows(seed)
        token, following = sample(logits, counts, seen, seed_words(1), mx.array([40], mx.uint32))
        assert token.tolist() == pick(logits, params, counts, seen, None).tolist()
        # Plain greedy reads no position, so it hands it back without a kernel to advance it.
        assert following.tolist() == ([40] if not params.has_penalties else [41])


def test_plain_greedy_picks_from_bfloat16_logits_as_from_their_float32_copy():
    sample = row_sampler(SamplingParams(temperature=0.0))
    for seed in range(20):
        logits = (mx.random.normal((1, V), key=mx.random.key(seed)) * 3).astype(mx.bfloat16)
        logits = mx.concatenate([logits[:, :-4], logits[:, :4]], axis=-1)  # ties: first index wins
        token, _ = sample(logits, *_rows(seed)[1:], seed_words(1), mx.array([40], mx.uint32))
        assert token.tolist() == mx.argmax(logits.astype(mx.float32), axis=-1).tolist()


def test_a_sampled_draw_depends_on_seed_and_position_only():
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, min_p=0.01)
    sample = row_sampler(params)
    logits, counts, seen = _rows(0)

    def draw(seed, position):
        return sample(logits, counts, seen, seed_words(seed), mx.array([position], mx.uint32))[0].item()

    assert draw(1, 40) == draw(1, 40)
    draws = {draw(1, p) for p in range(40)}
    assert len(draws) > 1  # positions give different keys
    assert {draw(s, 40) for s in range(40)} != {draw(1, 40)}


def test_sampled_draws_stay_inside_the_filtered_support():
    params = SamplingParams(temperature=0.7, top_k=3)
    sample = row_sampler(params)
    logits, counts, seen = _rows(4)
    allowed = set(mx.argsort(-logits[0])[:3].tolist())
    drawn = {sample(logits, counts, seen, seed_words(0), mx.array([p], mx.uint32))[0].item()
             for p in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_compiled_samplers_are_reused_and_bounded():
    first = row_sampler(SamplingParams(temperature=0.5))
    assert row_sampler(SamplingParams(temperature=0.5, seed=9, max_tokens=3)) is first
    for i in range(40):
        row_sampler(SamplingParams(temperature=0.1 + i / 100))
    assert len(sampling._ROW_SAMPLERS) <= sampling._ROW_SAMPLER_SLOTS


def test_ar_without_penalties_records_no_history(tiny_qwen3, monkeypatch):
    appended = []
    original = TokenHistory.append

    def spy(self, token_ids):
        appended.append(token_ids)
        original(self, token_ids)

    monkeypatch.setattr(TokenHistory, "append", spy)
    prompt = tiny_qwen3.tokenizer.encode("def add(a, b):")
    plain = tiny_qwen3.complete(GenerationRequest(prompt, SamplingParams(temperature=0.6, max_tokens=12,
                                                                          seed=1, ignore_eos=True), depth=0))
    assert len(plain.token_ids) == 12 and len(appended) == 1  # the first token's (pick_first) only
    penalised = tiny_qwen3.complete(GenerationRequest(prompt, SamplingParams(
        temperature=0.6, max_tokens=12, seed=1, ignore_eos=True, repetition_penalty=1.2), depth=0))
    assert len(penalised.token_ids) == 12 and len(appended) > 2


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.6, top_p=0.95, top_k=20, min_p=0.02),
    SamplingParams(temperature=1.3, top_p=0.5, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=500),  # k above the vocabulary: no filter
], ids=["top_p", "top_k", "all-three", "top_p-min_p", "k-over-vocab"])
def test_the_sorted_draw_has_exactly_the_distribution_of_scaled_logits(params):
    for seed in range(10):
        logits = mx.random.normal((1, V), key=mx.random.key(seed)) * 3
        logits = mx.concatenate([logits[:, :-4], logits[:, :4]], axis=-1)  # ties at 4 values
        want = mx.softmax(sampling.scaled_logits(logits, params), axis=-1)
        order, weights = sampling.sorted_scaled_logits(logits, params)
        got = mx.put_along_axis(mx.zeros_like(want), order, mx.softmax(weights, axis=-1), axis=-1)
        assert mx.allclose(got, want, atol=1e-6).item(), seed
