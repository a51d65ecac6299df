"""KV-cache quantization (kv_bits 8 and 4): greedy MTP still equals greedy AR at the same
kv_bits, for dense and hybrid families, the cache holds fewer bytes, and the guard prices it.

A quantized cache rounds every key and value to one of 2^bits levels, so a one-ulp difference
between a verify's K+1-row forward and a decode step's 1-row forward (OpenBLAS picks kernels
by shape) can land one level apart: the logits then move by ~1e-2 instead of ~1e-6, and a
near-tie can flip (docs/engine.md). Where rows are computed alone (MLX's reference BLAS,
support/numerics.py) the cache is the same bit for bit however it was filled; the tests that
need that run in a child on that BLAS."""

from __future__ import annotations

import json

import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.interface import ModelLoadError
from mtplxd.engine.bench.harness import PROMPTS, prompt_ids_for
from mtplxd.guard import plan_for_config
from mtplxd.models.builtin import EMBEDDED_MODEL_DIR
from support.numerics import ROWS_ALONE, run_on_reference_blas

bitwise_only = pytest.mark.skipif(not ROWS_ALONE, reason="bitwise only where matmul rows are computed "
                                                         "alone: runs in the reference-BLAS child")


@pytest.fixture(scope="module")
def checkpoints(tiny_model_factory):
    # head_dim 32: MLX quantizes in groups of 32 or more along the head dimension.
    return {"qwen3": tiny_model_factory("qwen3", head_dim=32),
            "qwen3_5": tiny_model_factory("qwen3_5", head_dim=32)}


def run(model, depth: int, max_tokens: int = 48):
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "write a function"}],
                                              add_generation_prompt=True)
    return model.complete(GenerationRequest(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                            depth=depth))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_mtp_equals_ar_at_the_same_kv_bits(checkpoints, family, bits):
    model = load_model(checkpoints[family], kv_bits=bits)
    assert model.info.kv_bits == bits
    assert any(type(c).__name__ == "QuantizedKVCache" for c in model.trunk.make_cache())
    ar = run(model, 0)
    for depth in (1, 3):
        mtp = run(model, depth)
        assert mtp.token_ids == ar.token_ids
        assert mtp.stats.drafted > 0


def test_a_quantized_cache_holds_fewer_bytes(checkpoints):
    import mlx.core as mx

    sizes = {}
    for bits in (0, 8, 4):
        model = load_model(checkpoints["qwen3"], kv_bits=bits)
        cache = model.trunk.make_cache()
        model.trunk.prefill(list(range(1, 257)), cache)
        mx.eval([c.state for c in cache])
        sizes[bits] = sum(c.nbytes for c in cache)
    # float32 on this CPU (4 bytes an element); quantized: bits/8 bytes an element plus a
    # float32 scale and bias per group of 32: 1.25 bytes at 8 bits, 0.75 at 4.
    assert sizes[8] / sizes[0] == pytest.approx(1.25 / 4, rel=0.01)
    assert sizes[4] / sizes[0] == pytest.approx(0.75 / 4, rel=0.01)


def test_the_guard_prices_the_quantized_cache(checkpoints):
    config = json.loads((checkpoints["qwen3"] / "config.json").read_text())
    full = plan_for_config(config, 0, "float32").kv_bytes_per_token
    assert plan_for_config(config, 0, "float32", kv_bits=8).kv_bytes_per_token == pytest.approx(full * 1.25 / 4, rel=0.01)
    assert plan_for_config(config, 0, "float32", kv_bits=4).kv_bytes_per_token == pytest.approx(full * 0.75 / 4, rel=0.01)


def test_auto_takes_the_checkpoints_setting_and_bad_heads_are_refused(tiny_model_factory, tmp_path):
    import shutil

    path = shutil.copytree(tiny_model_factory("qwen3", head_dim=32), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mtplx_kv_bits": 8}))
    assert load_model(path, kv_bits="auto").info.kv_bits == 8
    assert load_model(path, kv_bits=0).info.kv_bits == 0
    with pytest.raises(ModelLoadError, match="divisible by 32"):
        load_model(tiny_model_factory("qwen3"), kv_bits=8)  # head_dim 16
    with pytest.raises(ModelLoadError, match="kv_bits"):
        load_model(path, kv_bits=3)


def _fill(model, prompt: list[int], tokens: list[int], rows: int):
    """Prefill `prompt`, then feed `tokens` `rows` a forward: one row is an AR step; more rows
    carry one row too many that is trimmed off again (a verify whose last draft was rejected).
    Return the cache and the logits of the last kept row."""
    import mlx.core as mx

    cache = model.trunk.make_cache()
    model.trunk.prefill(prompt, cache)
    logits = None
    for start in range(0, len(tokens), rows):
        chunk = tokens[start:start + rows]
        rejected = [chunk[-1]] if rows > 1 else []
        _, logits = model.trunk.forward(mx.array(chunk + rejected)[None], cache, all_logits=True)
        for layer in cache:
            layer.trim(len(rejected))
        logits = logits[0, len(chunk) - 1]
    mx.eval(logits, [layer.state for layer in cache])
    return cache, logits


@bitwise_only
@pytest.mark.parametrize("bits", [8, 4])
def test_verify_sized_forwards_fill_the_quantized_cache_bit_for_bit_like_decode_steps(checkpoints, bits):
    """The cache a speculative cycle leaves (K+1 rows a forward, the rejected row trimmed, so
    offsets land off the cache's 256-token step) equals, bit for bit, the one AR's one-token
    steps leave, and so do the logits read from it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model = load_model(checkpoints["qwen3"], kv_bits=bits)
    prompt, tokens = list(range(3, 40)), [7, 19, 250, 31, 64, 5, 99, 128, 11, 42, 300, 17, 8]
    one_cache, one_logits = _fill(model, prompt, tokens, 1)
    four_cache, four_logits = _fill(model, prompt, tokens, 4)
    assert bool(mx.array_equal(one_logits, four_logits).item())
    for one, four in zip(one_cache, four_cache):
        offset = one.offset
        assert offset == four.offset == len(prompt) + len(tokens)
        # Rows past the offset are the trimmed draft's leftovers, which attention never reads.
        for (_, a), (_, b) in zip(tree_flatten(one.state), tree_flatten(four.state)):
            if isinstance(a, mx.array):  # the state's arrays (its bookkeeping ints aside)
                assert bool(mx.array_equal(a[..., :offset, :], b[..., :offset, :]).item())


@bitwise_only
def test_embedded_model_greedy_mtp_equals_ar_at_8_bits_where_openblas_split_on_a_near_tie():
    """The bench prompt whose greedy MTP left AR at kv_bits 8 on OpenBLAS with the embedded
    model's earlier weights (answer token 43: a 0.006-logit near-tie, flipped by quantized
    rounding of a 4-row verify; docs/engine.md): on the reference BLAS they agree."""
    model = load_model(EMBEDDED_MODEL_DIR, kv_bits=8)
    ids = prompt_ids_for(model.tokenizer, PROMPTS[2])
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    ar = model.complete(GenerationRequest(ids, params, depth=0))
    mtp = model.complete(GenerationRequest(ids, params, depth=3))
    assert mtp.token_ids == ar.token_ids
    assert mtp.stats.accepted > 0


@pytest.mark.skipif(ROWS_ALONE, reason="this run is the bitwise one already")
def test_kv_bits_is_bitwise_under_the_reference_blas():
    """This module's tests, the bitwise ones included, in a child on the reference BLAS."""
    run_on_reference_blas(__file__, "-k", "not reference_blas", expect_passed=10)
