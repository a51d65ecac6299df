"""The numpy attention of long CPU prefill chunks (engine/model/cpu_attention.py).

It must compute MLX's attention (to float32 rounding), take only long causal prefill chunks,
and leave every greedy output of the engine as exact as MLX's path left it.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx_lm.models.qwen3 as mlx_lm_qwen3
import mlx_lm.models.qwen3_next as mlx_lm_qwen3_next
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.decoding import fused
from mtplxd.engine.interface import ModelLoadError
from mtplxd.engine.model import cpu_attention
from mtplxd.engine.model.cpu_attention import KEY_BLOCK, QUERY_BLOCK

LONG_PROMPT = 700  # two prefill chunks (512 + 188), both long enough for the numpy path


@pytest.fixture
def mode():
    """Set the process-wide mode for one test; the previous one comes back after it."""
    before = cpu_attention.current_mode()
    yield cpu_attention.set_mode
    cpu_attention.set_mode(before)


def _qkv(queries: int, keys: int, heads: int, kv_heads: int, dim: int, dtype: mx.Dtype):
    shapes = [(1, heads, queries, dim), (1, kv_heads, keys, dim), (1, kv_heads, keys, dim)]
    return [mx.random.normal(s, key=mx.random.key(i)).astype(dtype) for i, s in enumerate(shapes)]


# (queries, keys): whole and partial query blocks, key counts across KEY_BLOCK boundaries,
# chunks with no cached prefix (the first chunk) and after one (a later chunk).
SHAPES = [(64, 256), (QUERY_BLOCK + 72, 300), (512, 512), (512, KEY_BLOCK + 1),
          (200, 2 * KEY_BLOCK + 37), (512, 3 * KEY_BLOCK)]


@pytest.mark.parametrize(("queries", "keys"), SHAPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (8, 2, 16), (2, 2, 32)])
def test_float32_chunk_attention_equals_mlx_to_float32_rounding(queries, keys, heads, kv_heads, dim):
    q, k, v = _qkv(queries, keys, heads, kv_heads, dim, mx.float32)
    scale = 1 / math.sqrt(dim)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    got = cpu_attention.causal_attention(q, k, v, scale)
    assert got.dtype == mx.float32 and got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(("queries", "keys"), [(512, 512), (200, 2 * KEY_BLOCK + 37)])
def test_bfloat16_chunk_attention_is_the_float32_attention_rounded_once(queries, keys):
    """MLX's bf16 path rounds its scores and weights to bf16; this one computes in float32
    and rounds the output only, so it is compared with MLX's float32 attention of the same
    bf16 inputs (to one bf16 rounding) and with MLX's bf16 attention (to its roundings)."""
    q, k, v = _qkv(queries, keys, 4, 2, 64, mx.bfloat16)
    got = cpu_attention.causal_attention(q, k, v, 0.125)
    assert got.dtype == mx.bfloat16
    exact = mx.fast.scaled_dot_product_attention(*(a.astype(mx.float32) for a in (q, k, v)),
                                                 scale=0.125, mask="causal")
    mlx_bf16 = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    got32 = np.array(got.astype(mx.float32))
    np.testing.assert_allclose(got32, np.array(exact), rtol=2 ** -8, atol=1e-6)
    np.testing.assert_allclose(got32, np.array(mlx_bf16.astype(mx.float32)), rtol=0.05, atol=0.02)


def test_only_long_causal_prefill_chunks_over_a_float_cache_take_the_numpy_path(mode):
    mode("auto")
    long_q, long_k, _ = _qkv(512, 1024, 4, 2, 64, mx.bfloat16)
    plain = KVCache()
    assert cpu_attention.takes(long_q, long_k, plain, "causal", None)
    assert not cpu_attention.takes(long_q[:, :, :1], long_k, plain, None, None)  # a decode step
    assert not cpu_attention.takes(long_q[:, :, :4], long_k, plain, "causal", None)  # a verify
    assert not cpu_attention.takes(long_q, long_k[:, :, :200], plain, "causal", None)  # short
    array_mask = mx.ones((512, 1024), mx.bool_)
    assert not cpu_attention.takes(long_q, long_k, plain, array_mask, None)  # fused buffers
    assert not cpu_attention.takes(long_q, long_k, QuantizedKVCache(), "causal", None)
    assert not cpu_attention.takes(long_q, long_k, plain, "causal", mx.zeros((4,)))  # sinks
    mode("mlx")
    assert not cpu_attention.takes(long_q, long_k, plain, "causal", None)


def test_an_unknown_mode_is_refused_in_one_sentence(tiny_model_factory, mode):
    with pytest.raises(ValueError, match="cpu_attention must be one of auto, numpy, mlx"):
        cpu_attention.set_mode("fast")
    with pytest.raises(ModelLoadError, match="cpu_attention must be one of"):
        load_model(tiny_model_factory("qwen3"), cpu_attention="fast")


def test_loading_routes_the_family_layers_through_one_dispatch(tiny_qwen3):
    """qwen3's and qwen3_next's (and so qwen3_5's) layers call fused.py's attention (which
    ends in cpu_attention's dispatch) or the dispatch itself."""
    for module in (mlx_lm_qwen3, mlx_lm_qwen3_next):
        assert module.scaled_dot_product_attention in (cpu_attention.attention, fused.static_cache_attention)
    assert tiny_qwen3.info.kernels["prefill_attention"] == cpu_attention.path_name()


def _long_prompt(model) -> list[int]:
    return np.random.default_rng(21).integers(5, model.info.vocab_size - 5, LONG_PROMPT).tolist()


def _greedy(model, ids: list[int], depth: int, max_tokens: int = 24):
    request = GenerationRequest(ids, SamplingParams(max_tokens=max_tokens), depth=depth)
    return model.complete(request)


def test_a_long_prefill_continues_the_same_through_numpy_and_mlx_attention(tiny_qwen3, mode):
    ids = _long_prompt(tiny_qwen3)
    mode("mlx")
    mlx_cache = tiny_qwen3.trunk.make_cache()
    mlx_hiddens, mlx_logits = tiny_qwen3.trunk.prefill(ids, mlx_cache)
    mlx_tokens = _greedy(tiny_qwen3, ids, 0).token_ids
    mode("numpy")
    numpy_cache = tiny_qwen3.trunk.make_cache()
    numpy_hiddens, numpy_logits = tiny_qwen3.trunk.prefill(ids, numpy_cache)
    assert _greedy(tiny_qwen3, ids, 0).token_ids == mlx_tokens
    # The paths round apart (bf16 activations), so the numbers are close, not equal.
    assert not mx.array_equal(numpy_logits, mlx_logits)
    np.testing.assert_allclose(np.array(numpy_logits.astype(mx.float32)),
                               np.array(mlx_logits.astype(mx.float32)), atol=0.1)


@pytest.mark.parametrize("decode_loop", ["stepwise", "fused"])
def test_greedy_mtp_equals_ar_after_a_long_numpy_prefill(tiny_model_factory, mode, decode_loop):
    mode("numpy")
    model = load_model(tiny_model_factory("qwen3"), decode_loop=decode_loop)
    ids = _long_prompt(model)
    reference = _greedy(model, ids, 0, 32)
    for depth in (1, 3):
        assert _greedy(model, ids, depth, 32).token_ids == reference.token_ids, f"depth {depth}"


def test_a_hybrid_models_long_prefill_takes_the_numpy_path_and_mtp_still_equals_ar(
        tiny_model_factory, mode):
    """qwen3_5's full-attention layers (qwen3_next's Attention) go through the same dispatch."""
    model = load_model(tiny_model_factory("qwen3_5"))
    ids = _long_prompt(model)
    logits = {}
    for path in ("mlx", "numpy"):
        mode(path)
        logits[path] = model.trunk.prefill(ids, model.trunk.make_cache())[1]
    assert not mx.array_equal(logits["numpy"], logits["mlx"])  # the numpy path ran
    np.testing.assert_allclose(np.array(logits["numpy"].astype(mx.float32)),
                               np.array(logits["mlx"].astype(mx.float32)), atol=0.1)
    reference = _greedy(model, ids, 0, 24)
    assert _greedy(model, ids, 3, 24).token_ids == reference.token_ids
