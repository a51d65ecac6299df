"""Quantizing an unquantized checkpoint as it loads (`load_model(quantize=...)`).

The checkpoint's config can ask for it on CUDA (`mtplx_cuda_quantization`), where quantized
matmuls serve a multi-token verify at the cost of one decode step. This machine has no CUDA:
the one fake is the backend query that load_model asks.
"""

from __future__ import annotations

import json
import shutil

import mlx.nn as nn
import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.interface import ModelLoadError
from mtplxd.engine.model.loader import CUDA_QUANTIZATION_KEY
from mtplxd.models.builtin import EMBEDDED_MODEL_DIR

PROMPT = [5, 17, 3, 99, 42, 8, 23, 61]


def asking_for_8bit_on_cuda(tiny_model_factory, tmp_path):
    folder = tmp_path / "asks"
    shutil.copytree(tiny_model_factory("qwen3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config[CUDA_QUANTIZATION_KEY] = {"bits": 8, "group_size": 64}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def quantized_layers(model) -> dict[str, int]:
    """How many quantized linears / embeddings the trunk and the MTP head hold."""
    counts = {"trunk": 0, "head": 0, "embedding": 0}
    for name, module in model.named_modules():
        if isinstance(module, nn.QuantizedEmbedding):
            counts["embedding"] += 1
        elif isinstance(module, nn.QuantizedLinear):
            counts["head" if name.startswith("mtp") else "trunk"] += 1
    return counts


def greedy(model, depth):
    request = GenerationRequest(prompt_ids=PROMPT, depth=depth,
                                sampling=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    return model.complete(request).token_ids


def test_auto_quantizes_what_the_checkpoint_asks_for_on_cuda_only(tiny_model_factory, tmp_path, monkeypatch):
    folder = asking_for_8bit_on_cuda(tiny_model_factory, tmp_path)
    on_cpu = load_model(folder)
    assert on_cpu.info.quantization is None
    assert quantized_layers(on_cpu.model) == {"trunk": 0, "head": 0, "embedding": 0}

    monkeypatch.setattr("mtplxd.engine.loaded_model.fixed_shapes_wanted", lambda: True)  # "CUDA"
    on_cuda = load_model(folder)
    assert on_cuda.info.quantization == "8bit, at load"
    layers = quantized_layers(on_cuda.model)
    assert layers["trunk"] > 0 and layers["head"] > 0 and layers["embedding"] == 1
    assert on_cuda.model.model.layers[0].mlp.down_proj.bits == 8
    # The served model is the quantized one; MTP stays exact against it.
    assert greedy(on_cuda, 3) == greedy(on_cuda, 0)
    # `none` keeps the weights as they are, whatever the checkpoint asks.
    assert load_model(folder, quantize="none").info.quantization is None


def test_explicit_bits_quantize_any_unquantized_checkpoint(tiny_model_factory):
    model = load_model(tiny_model_factory("qwen3"), quantize="4bit")
    assert model.info.quantization == "4bit, at load"
    assert model.model.model.layers[0].self_attn.q_proj.bits == 4
    assert greedy(model, 2) == greedy(model, 0)


def test_an_already_quantized_checkpoint_is_left_as_it_is(tiny_model_factory):
    model = load_model(tiny_model_factory("qwen3", quantize_bits=4), quantize="8bit",
                       dequantize_weights="off")
    assert model.info.quantization == "4bit"
    assert model.model.model.layers[0].mlp.up_proj.bits == 4


def test_bad_choices_are_refused(tiny_model_factory, tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="quantize must be one of"):
        load_model(tiny_model_factory("qwen3"), quantize="3bit")
    folder = asking_for_8bit_on_cuda(tiny_model_factory, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config[CUDA_QUANTIZATION_KEY] = {"bits": 3}
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr("mtplxd.engine.loaded_model.fixed_shapes_wanted", lambda: True)
    with pytest.raises(ModelLoadError, match="3-bit is not supported"):
        load_model(folder)


def test_the_embedded_model_asks_for_8bit_on_cuda():
    config = json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text())
    assert config[CUDA_QUANTIZATION_KEY] == {"bits": 8, "group_size": 64}
