"""Bucketed KV caches: fixed attention shapes, same tokens."""

import mlx.core as mx
import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.model.kv_cache import BucketedKVCache


def test_bucketed_mask_hides_unused_slots_and_matches_growth():
    cache = BucketedKVCache()
    mask = cache.make_mask(3)
    assert mask.shape == (3, 256)
    keys = mx.ones((1, 2, 3, 4))
    full_keys, _ = cache.update_and_fetch(keys, keys)
    assert full_keys.shape[2] == 256
    assert mask[0, :2].tolist() == [True, False] and mask[2, :4].tolist() == [True, True, True, False]
    cache.trim(1)
    assert cache.make_mask(1) is None  # a single token keeps exact-length keys, no mask
    one, _ = cache.update_and_fetch(mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4)))
    assert one.shape[2] == 3
    assert cache.make_mask(2).shape == (2, 256)
    cache.offset = 255
    assert cache.make_mask(4).shape == (4, 511)  # KVCache keeps 255 slots, adds one step
    big, _ = cache.update_and_fetch(mx.ones((1, 2, 4, 4)), mx.ones((1, 2, 4, 4)))
    assert big.shape[2] == 511


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_bucketed_caches_keep_greedy_mtp_equal_to_ar(tiny_model_factory, family):
    model = load_model(tiny_model_factory(family))
    ids = model.tokenizer.encode("def add(a, b):\n    ret")
    plain = model.complete(GenerationRequest(ids, SamplingParams(max_tokens=40), depth=0))
    model.trunk.fixed_shapes = True
    assert any(isinstance(c, BucketedKVCache) for c in model.trunk.make_cache())
    for depth in (0, 1, 3):
        result = model.complete(GenerationRequest(ids, SamplingParams(max_tokens=40), depth=depth))
        assert result.token_ids == plain.token_ids


def test_bucketed_logits_match_plain_logits(tiny_qwen3):
    trunk = tiny_qwen3.trunk
    ids = mx.array(tiny_qwen3.tokenizer.encode("a short prompt for logits"))[None]
    _, plain = trunk.forward(ids, trunk.make_cache(), all_logits=True)
    cache = [BucketedKVCache() for _ in trunk.make_cache()]
    _, bucketed = trunk.forward(ids, cache, all_logits=True)
    assert mx.allclose(plain, bucketed, atol=1e-5)
    _, step = trunk.forward(mx.array([[5]]), cache, all_logits=True)
    full = mx.concatenate([ids, mx.array([[5]])], axis=1)
    _, reference = trunk.forward(full, trunk.make_cache(), all_logits=True)
    assert mx.allclose(step[0, -1], reference[0, -1], atol=1e-5)
