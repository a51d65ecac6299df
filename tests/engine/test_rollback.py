"""RollbackArraysCache: trimming a verify forward leaves exactly the state of the accepted prefix."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load_model

from mtplxd.engine.fixtures.tiny_hybrid import write_tiny_hybrid_checkpoint
from mtplxd.engine.model.hybrid import HYBRID_MODEL_TYPES
from mtplxd.engine.model.rollback import (
    RollbackArraysCache,
    enable_gdn_capture,
    make_rollback_cache,
    rollback_by_reforward,
)
from support.numerics import ROWS_ALONE, run_on_reference_blas, same

PROMPT = [5, 17, 42, 99, 3, 250, 7]
VERIFY = [11, 300, 64, 128, 9]  # x_n followed by K = 4 drafts
K = len(VERIFY) - 1


@pytest.fixture(scope="module", params=HYBRID_MODEL_TYPES)
def model(request, tmp_path_factory):
    path = write_tiny_hybrid_checkpoint(
        tmp_path_factory.mktemp(request.param), request.param, draft_friendly=False
    )
    model, _ = load_model(path)
    return model


def _run(model, cache, tokens):
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return logits


def _fresh(model, tokens):
    cache = make_rollback_cache(model)
    _run(model, cache, tokens)
    return cache


def _assert_same_state(got, want):
    """Equality of GDN conv + recurrent state and of the live attention KV (bitwise where the
    BLAS computes rows alone, see support.numerics)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, ArraysCache):
            for slot in (0, 1):
                assert g[slot].dtype == w[slot].dtype
                assert same(g[slot], w[slot]), f"layer {i} GDN slot {slot}"
        else:
            assert g.offset == w.offset, f"layer {i} KV offset"
            gk, gv = g.keys_and_values() if hasattr(g, "keys_and_values") else g.state[:2]
            wk, wv = w.keys_and_values()
            assert same(gk, wk) and same(gv, wv), f"layer {i} KV"


@pytest.mark.parametrize("accepted", range(K + 1))
def test_trim_after_verify_equals_direct_forward_of_accepted_prefix(model, accepted):
    cache = _fresh(model, PROMPT)
    _run(model, cache, VERIFY)
    assert trim_prompt_cache(cache, K - accepted) == K - accepted
    direct = _fresh(model, PROMPT)
    _run(model, direct, VERIFY[: accepted + 1])
    _assert_same_state(cache, direct)
    # And the next step computes the same logits as after the direct prefix.
    nxt = [77]
    assert same(_run(model, cache, nxt), _run(model, direct, nxt))


def test_r0_reforward_oracle_agrees_with_r1_replay(model):
    for accepted in range(K + 1):
        r1 = _fresh(model, PROMPT)
        _run(model, r1, VERIFY)
        trim_prompt_cache(r1, K - accepted)
        r0 = _fresh(model, PROMPT)
        _run(model, r0, VERIFY)
        rollback_by_reforward(model, r0, mx.array(VERIFY)[None], accepted + 1)
        mx.eval([c.state for c in r0])
        _assert_same_state(r1, r0)


def test_trim_after_uncaptured_long_prefill_then_verify(model):
    long_prompt = [(i * 37) % 400 for i in range(40)]  # > max_capture_tokens: snapshot only
    cache = _fresh(model, long_prompt)
    _run(model, cache, VERIFY)
    trim_prompt_cache(cache, 2)
    direct = _fresh(model, long_prompt)
    _run(model, direct, VERIFY[:-2])
    _assert_same_state(cache, direct)


def test_trim_whole_first_forward_restores_empty_cache(model):
    cache = _fresh(model, VERIFY)
    assert trim_prompt_cache(cache, len(VERIFY)) == len(VERIFY)
    assert all(c[0] is None and c[1] is None for c in cache if isinstance(c, ArraysCache))
    _run(model, cache, PROMPT)
    _assert_same_state(cache, _fresh(model, PROMPT))


def test_trim_zero_is_a_noop_and_clears_the_capture(model):
    cache = _fresh(model, PROMPT)
    _run(model, cache, VERIFY)
    before = [(c[0], c[1]) for c in cache if isinstance(c, ArraysCache)]
    assert trim_prompt_cache(cache, 0) == 0
    after = [(c[0], c[1]) for c in cache if isinstance(c, ArraysCache)]
    assert all(b[0] is a[0] and b[1] is a[1] for b, a in zip(before, after))
    gdn = next(c for c in cache if isinstance(c, RollbackArraysCache))
    with pytest.raises(ValueError, match="no forward since the last trim"):
        gdn.trim(1)


def test_over_trim_raises(model):
    cache = _fresh(model, PROMPT)
    _run(model, cache, VERIFY)
    gdn = next(c for c in cache if isinstance(c, RollbackArraysCache))
    with pytest.raises(ValueError, match="only 5"):
        gdn.trim(len(VERIFY) + 1)
    with pytest.raises(ValueError, match="negative"):
        gdn.trim(-1)
    assert gdn.trim(1) == 1  # a failed trim leaves the capture usable


def test_trim_of_uncaptured_forward_raises(model):
    long_prompt = list(range(1, 41))
    cache = _fresh(model, long_prompt)
    gdn = next(c for c in cache if isinstance(c, RollbackArraysCache))
    with pytest.raises(ValueError, match="not captured"):
        gdn.trim(3)
    gdn.restore()  # R0 still works from the snapshot
    assert gdn[0] is None and gdn[1] is None


def test_mlx_lm_trim_helpers_work_on_the_hybrid_cache(model):
    cache = make_rollback_cache(model)
    assert can_trim_prompt_cache(cache)
    assert any(isinstance(c, RollbackArraysCache) for c in cache)
    assert any(isinstance(c, KVCache) for c in cache)
    # mlx-lm's stock cache is not trimmable, which is why this class exists.
    assert not can_trim_prompt_cache(model.make_cache())
    _run(model, cache, PROMPT + VERIFY)
    assert trim_prompt_cache(cache, 3) == 3
    kv = next(c for c in cache if isinstance(c, KVCache))
    assert kv.offset == len(PROMPT) + len(VERIFY) - 3


def test_capturing_forward_is_bitwise_mlx_lm_forward(model):
    tokens = mx.array(PROMPT)[None]
    stock = model.make_cache()
    ours = make_rollback_cache(model)
    for chunk in (tokens, mx.array(VERIFY)[None], mx.array([[3]])):
        want = model(chunk, cache=stock)
        got = model(chunk, cache=ours)
        assert mx.array_equal(want, got).item()
    _assert_same_state(ours, stock)


def test_enable_gdn_capture_is_idempotent(model):
    enable_gdn_capture(model)
    assert enable_gdn_capture(model) == 0


def test_trim_of_a_two_row_batch_equals_direct_forward(model):
    prompts = mx.array([PROMPT, PROMPT[::-1]])
    block = mx.array([VERIFY, VERIFY[::-1]])
    cache = make_rollback_cache(model)
    mx.eval(model(prompts, cache=cache))
    mx.eval(model(block, cache=cache))
    trim_prompt_cache(cache, 3)
    direct = make_rollback_cache(model)
    mx.eval(model(prompts, cache=direct))
    mx.eval(model(block[:, :-3], cache=direct))
    _assert_same_state(cache, direct)


def test_trim_releases_the_capture(model):
    cache = _fresh(model, PROMPT)
    _run(model, cache, VERIFY)
    gdn = [c for c in cache if isinstance(c, RollbackArraysCache)]
    assert all(c.capture is not None and c.capture.replayable for c in gdn)
    trim_prompt_cache(cache, 1)
    assert all(c.capture is None for c in gdn)


def test_rollback_bench_runs_and_reports_every_accept_count(tmp_path):
    from mtplxd.engine.bench.rollback import main

    out = tmp_path / "rb.json"
    small = ["hidden_size=64", "intermediate_size=128", "num_hidden_layers=4", "num_attention_heads=4",
             "head_dim=16", "linear_key_head_dim=16", "linear_value_head_dim=16"]
    assert main(["--family", "qwen3_next", "--depth", "2", "--prompt", "8", "--repeats", "1",
                 "--json-out", str(out), *[a for kv in small for a in ("--set", kv)]]) == 0
    import json

    report = json.loads(out.read_text())
    assert [row["accepted"] for row in report["rows"]] == [0, 1, 2]
    assert all(row["verify_ms"] > 0 and row["r0_reforward_ms"] > 0 for row in report["rows"])


@pytest.mark.skipif(ROWS_ALONE, reason="this run is the bitwise one already")
def test_rollback_is_bitwise_under_the_reference_blas():
    """This module's comparisons, in a child whose MLX computes each matmul row alone."""
    run_on_reference_blas(__file__, "-k", "not reference_blas", expect_passed=24)
