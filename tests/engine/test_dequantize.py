"""On the Linux CPU a quantized model whose weights fit is served with them dense float32
(loader.dequantize): OpenBLAS streams float32 faster than MLX's CPU quantized matmul unpacks,
and several rows cost little more than one, so MTP is its default again. The dense weights are
the packed ones' own values (scale * q + bias), the memory guard and the model's info price
them, and "auto" keeps a model packed where they would not fit."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mtplxd.engine import GenerationRequest, ModelLoadError, SamplingParams, load_model
from mtplxd.engine.loaded_model import DEQUANTIZED_LABEL, DEQUANTIZED_PATH
from mtplxd.engine.model.loader import (
    DEFAULT_DEPTH, DEQUANTIZE_MEMORY_SHARE, QUANTIZED_CPU_DEPTH_REASON, dense_float32_bytes,
    dequantize_wanted, parameter_bytes,
)
from mtplxd.tuning import tuning_key

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux CPU's rule")
GIB = 2**30


def test_the_rule():
    assert dequantize_wanted("auto", GIB, 2 * GIB)  # exactly the share fits
    assert not dequantize_wanted("auto", GIB + 1, 2 * GIB)
    assert DEQUANTIZE_MEMORY_SHARE == 0.5
    assert dequantize_wanted("on", GIB, GIB)  # asked for: above the share, within the limit
    assert not dequantize_wanted("on", GIB + 1, GIB)  # never past the memory limit
    assert not dequantize_wanted("off", 1, GIB)
    assert not dequantize_wanted("on", None, GIB)  # a layer without a dense twin
    # Quantized as it loads was asked for: "auto" keeps it packed, "on" still dequantizes.
    assert not dequantize_wanted("auto", 1, GIB, quantized_at_load=True)
    assert dequantize_wanted("on", 1, GIB, quantized_at_load=True)


@pytest.fixture(scope="module")
def checkpoint(tiny_model_factory):
    """A 4-bit checkpoint as mlx-community ships them: bfloat16 scales, biases and norms."""
    return tiny_model_factory("qwen3", quantize_bits=4, torch_dtype="bfloat16")


@pytest.fixture(scope="module")
def packed(checkpoint):
    return load_model(checkpoint, dequantize_weights="off")


@pytest.fixture(scope="module")
def dense(checkpoint):
    return load_model(checkpoint)  # "auto": a tiny model fits


def greedy(model, depth: int, tokens: int = 40) -> list[int]:
    prompt = model.tokenizer.encode("def fibonacci(n):\n    ")
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    return model.complete(GenerationRequest(prompt_ids=prompt, depth=depth, sampling=sampling)).token_ids


def test_auto_serves_dense_float32_weights_and_says_so(dense, packed):
    quantized = [m for _, m in dense.model.named_modules() if "scales" in m]
    assert not quantized, "a quantized layer is left"
    assert {v.dtype for _, v in tree_flatten(dense.model.parameters())} == {mx.float32}
    assert dense.head is not None and not any("scales" in m for _, m in dense.head.named_modules())
    assert dense.info.quantization == "4bit" + DEQUANTIZED_LABEL
    assert dense.info.kernels["quantized_matmul"] == DEQUANTIZED_PATH
    # MTP is the default again; a packed model's depth 0 and its reason are gone.
    assert (dense.info.depth, dense.info.depth_reason) == (DEFAULT_DEPTH, None)
    assert (packed.info.depth, packed.info.depth_reason) == (0, QUANTIZED_CPU_DEPTH_REASON)
    # A tuned depth and a session bank's snapshots belong to one of the two, not both.
    assert tuning_key(dense.info.to_dict()) != tuning_key(packed.info.to_dict())


def test_resident_bytes_are_predicted_and_priced(dense, packed):
    assert dense_float32_bytes(packed.model) == parameter_bytes(dense.model)
    grown = parameter_bytes(dense.model) - parameter_bytes(packed.model)
    assert grown > 0 and dense.info.weights_bytes == packed.info.weights_bytes + grown


def test_the_dense_weights_are_the_packed_values(dense, packed):
    """Each dense weight is scale * q + bias of its packed layer, in float32, exactly."""
    layers = dict(packed.model.named_modules())
    checked = 0
    for name, module in dense.model.named_modules():
        source = layers.get(name)
        if source is None or "scales" not in source:
            continue
        want = mx.dequantize(source["weight"], source["scales"], source["biases"],
                             group_size=source.group_size, bits=source.bits)
        assert module["weight"].dtype == mx.float32
        assert mx.array_equal(module["weight"], want).item(), name
        checked += 1
    assert checked >= 7  # every projection of a layer, the embedding and the head's


def test_same_function_as_the_packed_model(dense, packed):
    """Both compute scale * q + bias times x in float32; only the summation order differs."""
    tokens = mx.array([dense.tokenizer.encode("def add(a, b):\n    return a + b\n")])
    _, want = packed.trunk.forward(tokens, packed.trunk.make_cache(), all_logits=True)
    _, got = dense.trunk.forward(tokens, dense.trunk.make_cache(), all_logits=True)
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()


def test_greedy_mtp_equals_ar(dense):
    reference = greedy(dense, 0)
    for depth in (1, 3):
        assert greedy(dense, depth) == reference, f"depth {depth} diverged"


def test_auto_keeps_packed_what_would_not_fit(checkpoint, packed):
    need = dense_float32_bytes(packed.model)
    small = load_model(checkpoint, memory_limit_bytes=int(need / DEQUANTIZE_MEMORY_SHARE) - 1)
    assert small.info.quantization == "4bit" and small.info.depth == 0
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in small.model.named_modules())
    enough = load_model(checkpoint, memory_limit_bytes=int(need / DEQUANTIZE_MEMORY_SHARE) + 1)
    assert enough.info.quantization.endswith(DEQUANTIZED_LABEL)
    forced = load_model(checkpoint, dequantize_weights="on", memory_limit_bytes=need)
    assert forced.info.quantization.endswith(DEQUANTIZED_LABEL)


def test_on_never_dequantizes_past_the_memory_limit_and_says_why(checkpoint, packed, caplog):
    need = dense_float32_bytes(packed.model)
    with caplog.at_level("WARNING", logger="mtplxd.engine.loaded_model"):
        kept = load_model(checkpoint, dequantize_weights="on", memory_limit_bytes=need - 1)
    assert kept.info.quantization == "4bit" and kept.info.depth_reason == QUANTIZED_CPU_DEPTH_REASON
    assert "dequantize = on: the weights stay packed: its dense weights" in caplog.text


def test_a_bad_choice_is_refused(checkpoint):
    with pytest.raises(ModelLoadError, match="dequantize_weights must be one of auto, on, off"):
        load_model(checkpoint, dequantize_weights="yes")


def test_an_unquantized_or_half_precision_model_is_left_alone(tiny_model_factory, checkpoint):
    plain = load_model(tiny_model_factory("qwen3"), dequantize_weights="on")
    assert plain.info.quantization is None
    kept = load_model(checkpoint, compute="checkpoint", dequantize_weights="on")  # bfloat16: no BLAS to gain
    assert kept.info.quantization == "4bit" and kept.info.dtype == "bfloat16"


def test_a_hybrid_model_dequantizes_and_stays_exact(tiny_model_factory):
    model = load_model(tiny_model_factory("qwen3_5", quantize_bits=4))
    assert model.info.quantization.endswith(DEQUANTIZED_LABEL) and model.info.depth > 0
    assert not any("scales" in m for _, m in model.model.named_modules())
    assert greedy(model, 3, tokens=24) == greedy(model, 0, tokens=24)


def test_quantized_experts_have_no_dense_twin_so_the_model_stays_packed(tiny_model_factory):
    """A mixture of experts' quantized expert layers (mlx-lm's QuantizedSwitchLinear) are not
    dequantized here: the whole model keeps its packed weights, and AR as its default."""
    model = load_model(tiny_model_factory("qwen3_5_moe", quantize_bits=4), dequantize_weights="on")
    assert not model.info.quantization.endswith(DEQUANTIZED_LABEL)
    assert model.info.depth == 0 and model.info.depth_reason == QUANTIZED_CPU_DEPTH_REASON


def test_a_model_quantized_as_it_loads_stays_packed_unless_asked(tiny_model_factory):
    path = tiny_model_factory("qwen3")
    asked = load_model(path, quantize="8bit")
    assert asked.info.quantization == "8bit, at load" and asked.info.depth == 0
    # Its resident bytes are the packed weights', not the unquantized file's.
    plain = load_model(path)
    shrunk = parameter_bytes(plain.model) - parameter_bytes(asked.model)
    assert shrunk > 0 and asked.info.weights_bytes == plain.info.weights_bytes - shrunk
    both = load_model(path, quantize="8bit", dequantize_weights="on")
    assert both.info.quantization == "8bit, at load" + DEQUANTIZED_LABEL and both.info.depth == DEFAULT_DEPTH
