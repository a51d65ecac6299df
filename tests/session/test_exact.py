"""Warm restores are exact: the same logits, caches, drafts and outputs as a cold prefill.

Bitwise where each row of a matmul is computed alone (MLX's bundled reference BLAS). An
optimized BLAS (OpenBLAS, the default on the Linux CPU) picks its kernels by matrix shape, so
a row's last bits depend on the rows computed with it: a restored prefix, computed by turn 1's
prefill chunks and decode steps, then matches a cold prefill to float32 rounding, and the
tokens still match exactly. The bitwise check runs under the reference BLAS in a child process.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache


from mtplxd.engine.session.bank import BankSettings
from support.numerics import ROWS_ALONE, run_on_reference_blas
from support.numerics import same as _same

FAMILY_PARAMS = ["qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next"]


def _assert_caches_equal(warm: list, cold: list) -> None:
    for w, c in zip(warm, cold):
        if isinstance(c, KVCache):
            assert w.offset == c.offset
            assert _same(w.keys[..., :w.offset, :], c.keys[..., :c.offset, :])
            assert _same(w.values[..., :w.offset, :], c.values[..., :c.offset, :])
        else:
            assert isinstance(c, ArraysCache)
            assert _same(w.cache[0], c.cache[0])
            assert _same(w.cache[1], c.cache[1])


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_logits_and_caches_after_restore_equal_cold_prefill(loaded, gen, toks, family):
    model = loaded(family)
    bank = model.enable_session_bank(BankSettings())
    try:
        first = toks(1, 150)
        turn1 = gen(model, first, max_tokens=8)
        follow = first + turn1.token_ids + toks(2, 40)

        turn = bank.begin(model.trunk, model.head, follow)
        assert turn.cached > len(first) // 2
        warm_hiddens, warm_logits = turn.prefill(32)
        cold_cache = model.trunk.make_cache()
        cold_hiddens, cold_logits = model.trunk.prefill(follow, cold_cache, 32)

        assert _same(warm_logits, cold_logits)
        assert mx.argmax(warm_logits).item() == mx.argmax(cold_logits).item()
        cold_all = mx.concatenate(cold_hiddens, axis=1)
        assert _same(mx.concatenate(warm_hiddens, axis=1), cold_all[:, turn.pending_from:])
        _assert_caches_equal(turn.cache, cold_cache)
    finally:
        model.bank = None


@pytest.mark.skipif(ROWS_ALONE, reason="this run is the bitwise one already")
def test_restores_are_bitwise_under_the_reference_blas():
    """The test above, in a child whose MLX runs on its bundled BLAS (rows computed alone)."""
    run_on_reference_blas(f"{Path(__file__)}::test_logits_and_caches_after_restore_equal_cold_prefill",
                          expect_passed=len(FAMILY_PARAMS))


@pytest.mark.parametrize("depth", [0, 3])
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_greedy_follow_up_identical_warm_and_cold(loaded, gen, toks, family, depth):
    model = loaded(family)
    first = toks(3, 120)
    cold1 = gen(model, first, depth=depth)
    model.enable_session_bank(BankSettings())
    try:
        warm1 = gen(model, first, depth=depth)
        assert warm1.stats.cached_tokens == 0
        follow = first + warm1.token_ids + toks(4, 30)
        warm2 = gen(model, follow, depth=depth)
    finally:
        model.bank = None
    cold2 = gen(model, follow, depth=depth)
    assert warm1.token_ids == cold1.token_ids
    assert warm2.token_ids == cold2.token_ids
    assert warm2.stats.cached_tokens >= len(first)
    assert cold2.stats.cached_tokens == 0
    # The head's restored cache and PENDING pairs are exact too: it drafts the same tokens.
    assert warm2.stats.drafted_by_depth == cold2.stats.drafted_by_depth
    assert warm2.stats.accepted_by_depth == cold2.stats.accepted_by_depth


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_seeded_sampling_identical_warm_and_cold(loaded, gen, toks, family):
    model = loaded(family)
    first = toks(5, 100)
    bank = model.enable_session_bank(BankSettings())
    try:
        turn1 = gen(model, first, temperature=0.8, seed=7)
        follow = first + turn1.token_ids + toks(6, 20)
        warm = gen(model, follow, temperature=0.8, seed=11)
        assert bank.stats()["hits"] == 1
    finally:
        model.bank = None
    cold = gen(model, follow, temperature=0.8, seed=11)
    assert warm.stats.cached_tokens > 0
    assert warm.token_ids == cold.token_ids
    assert warm.stats.accepted_by_depth == cold.stats.accepted_by_depth


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, seed=7)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("depth", [0, 3])
def test_fused_loop_stores_and_resumes_exactly(loaded, gen, toks, depth, sampling):
    """The fused loop hands back ordinary caches: the bank stores them, and a warm follow-up
    equals a cold one (tokens, drafts and acceptance)."""
    model = loaded("qwen3")
    default = model.trunk.decode_loop
    model.trunk.decode_loop = "fused"
    try:
        first = toks(6, 110)
        model.enable_session_bank(BankSettings())
        try:
            turn1 = gen(model, first, depth=depth, **sampling)
            follow = first + turn1.token_ids + toks(7, 25)
            warm = gen(model, follow, depth=depth, **sampling)
        finally:
            model.bank = None
        cold = gen(model, follow, depth=depth, **sampling)
    finally:
        model.trunk.decode_loop = default
    assert warm.stats.cached_tokens >= len(first)
    assert warm.token_ids == cold.token_ids
    assert warm.stats.accepted_by_depth == cold.stats.accepted_by_depth


@pytest.mark.parametrize("family,loop", [("qwen3", "stepwise"), ("qwen3", "fused"),
                                         ("qwen3_5", "stepwise")])
def test_a_one_token_turn_stores_the_head_kv_and_serves_a_later_mtp_request_exactly(
        loaded, gen, toks, family, loop):
    """A `max_tokens: 1` turn ends before any speculative cycle feeds the head; its entry must
    still carry the head's KV, or every later MTP request with that prefix misses the bank."""
    model = loaded(family)
    default = model.trunk.decode_loop
    model.trunk.decode_loop = loop
    first = toks(7, 120)
    follow = first + toks(8, 30)
    try:
        cold = gen(model, follow, depth=3)
        bank = model.enable_session_bank(BankSettings())
        gen(model, first, depth=3, max_tokens=1)
        [entry] = bank.entries()
        assert entry.head_kv is not None and entry.head_len == len(first) - 1
        warm = gen(model, follow, depth=3)
    finally:
        model.bank = None
        model.trunk.decode_loop = default
    assert warm.stats.cached_tokens == len(first)
    assert warm.token_ids == cold.token_ids
    assert warm.stats.drafted_by_depth == cold.stats.drafted_by_depth
    assert warm.stats.accepted_by_depth == cold.stats.accepted_by_depth


@pytest.mark.parametrize("loop", ["stepwise", "fused"])
def test_a_capped_mtp_turn_is_banked_as_returned_and_the_next_turn_supersedes_it(loaded, gen, toks, loop):
    """A depth-3 cycle that reaches the cap may commit tokens past it; they are in no later
    prompt, so the dense model's entry ends with the returned tokens: every entry stays a
    prefix of prompt + answer, each longer turn supersedes the last (one entry left, not one
    per turn), and a follow-up restored from it equals a cold one."""
    model = loaded("qwen3")
    default = model.trunk.decode_loop
    model.trunk.decode_loop = loop
    first = toks(8, 60)
    bank = model.enable_session_bank(BankSettings())
    try:
        for cap in range(5, 13):  # caps that end mid-cycle and caps that end on a cycle's end
            answer = tuple(first + gen(model, first, depth=3, max_tokens=cap).token_ids)
            assert all(len(e.tokens) <= len(answer) and answer[:len(e.tokens)] == e.tokens
                       for e in bank.entries()), cap
        assert bank.stats()["entries"] == 1
        follow = list(answer) + toks(9, 20)
        warm = gen(model, follow, depth=3)
    finally:
        model.bank = None
        model.trunk.decode_loop = default
    cold = gen(model, follow, depth=3)
    assert warm.stats.cached_tokens > len(first)  # the answer's tokens came from the bank too
    assert warm.token_ids == cold.token_ids
    assert warm.stats.accepted_by_depth == cold.stats.accepted_by_depth
