"""Exactness gates (b) and (c): sampled MTP output follows the target distribution exactly.

The joint distribution of the first three generated tokens of a tiny model is enumerated
exactly (one uncached forward per prefix), then compared by a chi-square test with the
tokens that MTP speculative decoding samples over many seeds. The same test must reject a
deliberately wrong sampler (the residual taken as p instead of norm(max(0, p - q))).
"""

import math
from collections import Counter

import mlx.core as mx
import pytest

import mtplxd.engine.decoding.fused as fused
import mtplxd.engine.decoding.speculative as speculative
from mtplxd.engine import GenerationRequest, SamplingParams
from support.distribution import EOS, N_TOKENS, chi_square_p_value, exact_joint


def sampled_counts(model, prompt, params, depth, n):
    counts = Counter()
    for seed in range(n):
        sampling = SamplingParams(temperature=params.temperature, top_p=params.top_p,
                                  top_k=params.top_k, seed=seed, max_tokens=N_TOKENS)
        result = model.complete(GenerationRequest(prompt, sampling, depth=depth))
        key = tuple(result.token_ids) + ((EOS,) if result.finish_reason == "stop" else ())
        counts[key] += 1
    return counts


CONFIGS = [
    pytest.param(SamplingParams(temperature=0.6, top_p=0.5), 2, id="T0.6-top_p0.5-depth2"),
    pytest.param(SamplingParams(temperature=1.0, top_k=4), 1, id="T1.0-top_k4-depth1"),
]
N_SAMPLES = 600


@pytest.fixture(scope="module")
def prompt(tiny_qwen3):
    return tiny_qwen3.tokenizer.encode("def add(a, b):\n    ret")


@pytest.fixture(params=["stepwise", "fused"], autouse=True)
def decode_loop(request, tiny_qwen3):
    """Every test here runs once per decode loop (fused.py and speculative.py)."""
    default = tiny_qwen3.trunk.decode_loop
    tiny_qwen3.trunk.decode_loop = request.param
    yield request.param
    tiny_qwen3.trunk.decode_loop = default


@pytest.mark.parametrize(("params", "depth"), CONFIGS)
def test_sampled_mtp_matches_the_exact_target_distribution(tiny_qwen3, prompt, params, depth):
    joint = exact_joint(tiny_qwen3, prompt, params)
    assert math.isclose(sum(joint.values()), 1.0, abs_tol=1e-4)
    counts = sampled_counts(tiny_qwen3, prompt, params, depth, N_SAMPLES)
    assert chi_square_p_value(joint, counts, N_SAMPLES) > 1e-3


@pytest.mark.parametrize(("params", "depth"), CONFIGS)
def test_a_wrong_residual_fails_the_same_test(tiny_qwen3, prompt, params, depth, monkeypatch):
    monkeypatch.setattr(speculative, "residual_distribution", lambda p, q: p)
    monkeypatch.setattr(fused, "residual_distribution", lambda p, q: p)
    monkeypatch.setattr(tiny_qwen3.trunk, "compiled_graphs", {})  # trace with the wrong rule
    joint = exact_joint(tiny_qwen3, prompt, params)
    counts = sampled_counts(tiny_qwen3, prompt, params, depth, N_SAMPLES)
    assert chi_square_p_value(joint, counts, N_SAMPLES) < 1e-3


def test_same_seed_same_sampled_mtp_output(tiny_qwen3, prompt):
    def run(seed, depth):
        sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=40)
        return tiny_qwen3.complete(GenerationRequest(prompt, sampling, depth=depth)).token_ids

    assert run(5, 3) == run(5, 3)
    assert run(5, 3) != run(6, 3)
    assert run(7, 2) == run(7, 2)


def test_accept_and_residual_rules_reproduce_p_exactly():
    """One draft from q: P(emit x) = q(x) min(1, p/q)(x) + P(reject) residual(x) = p(x)."""
    p = mx.array([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    q = mx.array([[0.2, 0.2, 0.2, 0.4], [0.7, 0.1, 0.1, 0.1]])
    accept = speculative.acceptance_probability(p, q)
    reject = 1.0 - mx.sum(q * accept, axis=-1, keepdims=True)
    emitted = q * accept + reject * speculative.residual_distribution(p, q)
    assert mx.allclose(emitted, p, atol=1e-6)
    assert mx.allclose(speculative.residual_distribution(p, p), p)  # nothing to correct: falls back to p


AR_PARAMS = SamplingParams(temperature=0.6, top_p=0.5)


def test_sampled_ar_matches_the_exact_target_distribution(tiny_qwen3, prompt, decode_loop):
    """AR (depth 0) samples through the compiled chain with device-made keys: same test."""
    if decode_loop != "stepwise":
        pytest.skip("AR runs one loop whatever the MTP decode loop is")
    joint = exact_joint(tiny_qwen3, prompt, AR_PARAMS)
    counts = sampled_counts(tiny_qwen3, prompt, AR_PARAMS, 0, N_SAMPLES)
    assert chi_square_p_value(joint, counts, N_SAMPLES) > 1e-3


def test_an_ar_sampler_without_top_p_fails_the_same_test(tiny_qwen3, prompt, decode_loop, monkeypatch):
    if decode_loop != "stepwise":
        pytest.skip("AR runs one loop whatever the MTP decode loop is")
    import mtplxd.engine.decoding.sampling as sampling

    joint = exact_joint(tiny_qwen3, prompt, AR_PARAMS)  # before the wrong rule goes in
    exact, exact_sorted = sampling.scaled_logits, sampling.sorted_scaled_logits
    monkeypatch.setattr(sampling, "_ROW_SAMPLERS", {})  # trace with the wrong rule
    # Both definitions lose top-p: the first token's (`pick`) and the compiled chain's, which
    # draws in sorted order, so every sampled token is drawn by the wrong rule.
    monkeypatch.setattr(sampling, "scaled_logits",
                        lambda penalised, params: exact(penalised, SamplingParams(temperature=params.temperature)))
    monkeypatch.setattr(sampling, "sorted_scaled_logits", lambda penalised, params: exact_sorted(
        penalised, SamplingParams(temperature=params.temperature)))
    counts = sampled_counts(tiny_qwen3, prompt, AR_PARAMS, 0, N_SAMPLES)
    assert chi_square_p_value(joint, counts, N_SAMPLES) < 1e-3
