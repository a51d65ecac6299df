"""KV-cache quantization (kv_bits 8 and 4): greedy MTP still equals greedy AR at the same
kv_bits, for dense and hybrid families, the cache holds fewer bytes, and the guard prices it."""

from __future__ import annotations

import json

import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.interface import ModelLoadError
from mtplxd.guard import plan_for_config


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
