"""Logprobs of generated tokens: the target's distribution after the request's penalties,
equal for AR and MTP, and equal to an independent full-sequence forward (CPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtplxd.engine import GenerationRequest, SamplingParams
from mtplxd.engine.interface import GenerationResult, TokenDelta

TOLERANCE = 1e-4


def generate(model, depth: int, top: int | None = 5, **sampling):
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "write a function"}],
                                              add_generation_prompt=True)
    request = GenerationRequest(ids, SamplingParams(max_tokens=40, ignore_eos=True, **sampling),
                                depth=depth, logprobs=top)
    items = list(model.generate(request))
    deltas = [i for i in items if isinstance(i, TokenDelta)]
    [result] = [i for i in items if isinstance(i, GenerationResult)]
    entries = [e for d in deltas for e in (d.logprobs or [])]
    return ids, result, entries


def reference(model, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output_i | prompt, output_<i) from one forward over the whole sequence."""
    cache = model.trunk.make_cache()
    _, logits = model.trunk.forward(mx.array(prompt + output)[None], cache, all_logits=True)
    rows = logits[0, len(prompt) - 1:-1].astype(mx.float32)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    return mx.take_along_axis(logprobs, mx.array(output)[:, None], axis=-1)[:, 0].tolist()


@pytest.mark.parametrize("depth", [0, 3])
def test_greedy_logprobs_are_the_targets_and_the_chosen_token_is_the_best(tiny_qwen3, depth):
    prompt, result, entries = generate(tiny_qwen3, depth, temperature=0)
    assert [e.token for e in entries] == result.token_ids
    expected = reference(tiny_qwen3, prompt, result.token_ids)
    assert max(abs(e.logprob - r) for e, r in zip(entries, expected)) < TOLERANCE
    for entry in entries:
        assert len(entry.top) == 5 and entry.top[0][0] == entry.token
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)


def test_mtp_and_ar_report_the_same_logprobs(tiny_qwen3):
    _, ar, ar_entries = generate(tiny_qwen3, 0, temperature=0, repetition_penalty=1.3, presence_penalty=0.5)
    _, mtp, mtp_entries = generate(tiny_qwen3, 3, temperature=0, repetition_penalty=1.3, presence_penalty=0.5)
    assert ar.token_ids == mtp.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(ar_entries, mtp_entries)) < TOLERANCE
    assert [[t for t, _ in a.top] for a in ar_entries] == [[t for t, _ in b.top] for b in mtp_entries]
    # Penalties are part of the distribution: the chosen (greedy) token is still the best.
    assert all(e.top[0][0] == e.token for e in mtp_entries)


def test_sampled_mtp_logprobs_come_from_the_target_not_the_drafter(tiny_qwen3):
    prompt, result, entries = generate(tiny_qwen3, 3, temperature=1.0, seed=3)
    assert result.stats.drafted > 0
    expected = reference(tiny_qwen3, prompt, result.token_ids)
    assert max(abs(e.logprob - r) for e, r in zip(entries, expected)) < TOLERANCE


def test_without_alternatives_only_the_chosen_logprob_is_reported(tiny_qwen3):
    _, result, entries = generate(tiny_qwen3, 3, top=0, temperature=0)
    assert len(entries) == len(result.token_ids) and all(e.top == [] for e in entries)
    _, _, none = generate(tiny_qwen3, 3, top=None, temperature=0)
    assert none == []
