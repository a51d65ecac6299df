"""The fused loop on hybrid models (Gated DeltaNet + attention; fused.py, fused_gdn.py), on
the CPU backend: a request's MTP decode runs one compiled graph a cycle, greedy output equals
AR token for token, and the caches it hands back hold exactly the committed history, GDN
state included. The GDN rollback with the accepted count on the device is checked against
the host-side one (rollback.py) for every count."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest

from mtplxd.engine import GenerationRequest, GenerationResult, SamplingParams, generation, load_model
from mtplxd.engine.decoding.fused import FusedSpeculativeDecoder, fused_supported
from mtplxd.engine.decoding.fused_gdn import FusedGDNCache, chunked_state_at
from mtplxd.engine.decoding.speculative import SpeculativeDecoder
from mtplxd.engine.fixtures.tiny_hybrid import write_tiny_hybrid_checkpoint
from mtplxd.engine.model import gdn_chunked
from mtplxd.engine.model.hybrid import HYBRID_MODEL_TYPES
from mtplxd.engine.model.rollback import RollbackArraysCache
from support.cycles import assert_cache_holds, run_cycles
from support.distribution import EOS, N_TOKENS, chi_square_p_value, exact_joint

N_SAMPLES = 600

PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module", params=HYBRID_MODEL_TYPES)
def model(request, tmp_path_factory):
    path = write_tiny_hybrid_checkpoint(tmp_path_factory.mktemp(request.param), request.param,
                                        draft_friendly=True)
    return load_model(path, decode_loop="fused")


def generate(model, depth, loop="fused", max_tokens=40, **sampling):
    model.trunk.decode_loop = loop
    try:
        request = GenerationRequest(model.tokenizer.encode(PROMPT),
                                    SamplingParams(max_tokens=max_tokens, **sampling), depth=depth)
        return next(x for x in model.generate(request) if isinstance(x, GenerationResult))
    finally:
        model.trunk.decode_loop = "fused"


def test_a_hybrid_request_decodes_in_the_fused_loop(model):
    assert model.info.decode_loop == "fused"
    assert fused_supported(model.trunk, model.trunk.make_cache(), hybrid=True)
    # Cohorts of hybrid rows keep the stepwise loops: their rows' caches are not fused's.
    assert not fused_supported(model.trunk, model.trunk.make_cache())
    model.trunk.compiled_graphs.clear()
    result = generate(model, 3)
    assert result.stats.cycles > 0 and result.stats.accepted > 0
    assert ("mtp", 3) in [key[:2] for _, key in model.trunk.compiled_graphs]


def test_a_seeded_sampled_hybrid_request_keeps_the_stepwise_loop(model):
    """Its tokens must not depend on whether it decodes alone or in (phased) cohorts, which
    draw as the stepwise loop does; unseeded sampling has no tokens to keep and fuses."""
    model.trunk.compiled_graphs.clear()
    seeded = generate(model, 3, temperature=0.8, seed=5)
    assert not model.trunk.compiled_graphs and seeded.stats.cycles > 0
    stepwise = generate(model, 3, "stepwise", temperature=0.8, seed=5)
    assert seeded.token_ids == stepwise.token_ids
    generate(model, 3, temperature=0.8)
    assert ("mtp", 3) in [key[:2] for _, key in model.trunk.compiled_graphs]


def test_greedy_fused_equals_ar_and_the_stepwise_loop(model):
    ar = generate(model, 0, temperature=0.0)
    for depth in (1, 2, 4):
        fused = generate(model, depth, temperature=0.0)
        stepwise = generate(model, depth, "stepwise", temperature=0.0)
        assert fused.token_ids == ar.token_ids == stepwise.token_ids, depth
        # Same drafts, same verdicts: the rollback kept the same state.
        assert fused.stats.accepted_by_depth == stepwise.stats.accepted_by_depth


def test_a_one_token_turn_and_a_long_one_in_the_fused_loop(model):
    ar = generate(model, 0, temperature=0.0, max_tokens=120, ignore_eos=True)
    assert generate(model, 3, temperature=0.0, max_tokens=120, ignore_eos=True).token_ids == ar.token_ids
    assert generate(model, 3, temperature=0.0, max_tokens=1).token_ids == ar.token_ids[:1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_handed_back_cache_equals_a_fresh_run_over_the_committed_history(model, temperature):
    """What the session bank stores after a fused hybrid turn: attention KV up to the
    committed length, and each GDN layer's conv and recurrent state after exactly the
    committed tokens (a launched, unread cycle left no trace)."""
    params = SamplingParams(temperature=temperature, top_k=5)
    prompt = model.tokenizer.encode(PROMPT)
    decoder, cache, committed = run_cycles(model, prompt, params, 3, 6, FusedSpeculativeDecoder)
    n = len(prompt) + len(committed) - 1  # the last committed token is not fed yet
    assert_cache_holds(model, cache, (prompt + committed)[:n])
    assert decoder.head_cache[0].offset + decoder.pending_hidden.shape[1] == n


def test_fused_and_stepwise_hand_back_the_same_gdn_state_bitwise(model):
    prompt = model.tokenizer.encode(PROMPT)
    _, fused_cache, fused_tokens = run_cycles(model, prompt, SamplingParams(), 2, 5, FusedSpeculativeDecoder)
    _, stepwise_cache, stepwise_tokens = run_cycles(model, prompt, SamplingParams(), 2, 5, SpeculativeDecoder)
    assert fused_tokens == stepwise_tokens
    for ours, want in zip(fused_cache, stepwise_cache):
        if isinstance(want, RollbackArraysCache):
            assert mx.array_equal(ours[0], want[0]) and mx.array_equal(ours[1], want[1])


def _captured_verify(model, tokens):
    """A GDN layer's FusedGDNCache after a verify forward of `tokens` over a short prefill,
    and the same layer's stepwise rollback cache after the same forward."""
    trunk = model.trunk
    cache = trunk.make_cache()
    trunk.forward(mx.array([[5, 17, 42, 99, 3]]), cache, all_logits=False)
    index = next(i for i, e in enumerate(cache) if isinstance(e, RollbackArraysCache))
    fused = [FusedGDNCache(e[0], e[1]) if i == index else e for i, e in enumerate(cache)]
    # The fused cache's layer only: the other layers run on copies of the same state.
    stepwise = trunk.make_cache()
    trunk.forward(mx.array([[5, 17, 42, 99, 3]]), stepwise, all_logits=False)
    block = mx.array([tokens])
    trunk.forward(block, fused, all_logits=False)
    trunk.forward(block, stepwise, all_logits=False)
    return fused[index], stepwise[index]


@pytest.mark.parametrize("chunked", [False, True], ids=["per-token", "chunked"])
def test_device_side_rollback_equals_the_host_side_trim_for_every_count(model, chunked):
    tokens = [11, 300, 64, 128, 9]
    gdn_chunked.force(chunked)
    try:
        for keep in range(1, len(tokens) + 1):
            fused, stepwise = _captured_verify(model, tokens)
            conv, state = fused.committed(mx.array(keep, mx.int32))
            stepwise.trim(len(tokens) - keep)
            if chunked:  # the chunked sums may round in another order with the extra zero rows
                assert mx.allclose(state, stepwise[1], atol=1e-5), keep
            else:
                assert mx.array_equal(state, stepwise[1]), keep
            assert mx.array_equal(conv, stepwise[0]), keep
    finally:
        gdn_chunked.force(None)


def test_chunked_state_at_a_device_count_equals_state_after():
    keys = iter(mx.random.split(mx.random.key(0), 4))
    B, Hv, T, Dv, Dk = 1, 4, 6, 8, 16
    s0 = mx.random.normal((B, Hv, Dv, Dk), key=next(keys))
    u = mx.random.normal((B, Hv, T, Dv), key=next(keys))
    k32 = mx.random.normal((B, Hv, T, Dk), key=next(keys))
    log_gamma = mx.cumsum(-mx.abs(mx.random.normal((B, Hv, T), key=next(keys))), axis=-1)
    for keep in range(1, T + 1):
        want = gdn_chunked.state_after(s0, u, k32, log_gamma, keep)
        got = chunked_state_at(s0, u, k32, log_gamma, mx.array(keep, mx.int32))
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5), keep


def test_committing_without_a_captured_forward_is_refused():
    cache = FusedGDNCache(mx.zeros((1, 3, 8)), mx.zeros((1, 2, 4, 4)))
    with pytest.raises(ValueError, match="captured"):
        cache.committed(mx.array(1, mx.int32))


def test_sampled_fused_hybrid_matches_the_exact_target_distribution(model, monkeypatch):
    """Exactness gate (c) through the fused hybrid loop: its first three sampled tokens over
    many seeds against the enumerated joint distribution (support/distribution.py). Seeded
    requests keep the stepwise loop when served (the test above); here they are let into the
    fused one, so that the draws under test are its own and the test is reproducible."""
    monkeypatch.setattr(generation, "_hybrid_may_fuse", lambda params, positions: True)
    model.trunk.compiled_graphs.clear()
    prompt = model.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.6, top_p=0.5)
    joint = exact_joint(model, prompt, params)
    counts = Counter()
    for seed in range(N_SAMPLES):
        sampling = SamplingParams(temperature=0.6, top_p=0.5, seed=seed, max_tokens=N_TOKENS)
        result = model.complete(GenerationRequest(prompt, sampling, depth=2))
        counts[tuple(result.token_ids) + ((EOS,) if result.finish_reason == "stop" else ())] += 1
    assert ("mtp", 2) in [key[:2] for _, key in model.trunk.compiled_graphs]
    assert chi_square_p_value(joint, counts, N_SAMPLES) > 1e-3
