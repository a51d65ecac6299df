"""stacked.py: an MLP's gate and up projections as one product (MTPLX_STACKED_MLP=1). The
stacked model computes what the separate one does, bit for bit for quantized products, holds
the same bytes, and keeps greedy MTP equal to AR."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.model import stacked
from mtplxd.engine.model.loader import parameter_bytes


def _stacked_count(model: nn.Module) -> int:
    return sum(isinstance(m, stacked.StackedMLP) for _, m in model.named_modules())


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_quantized_model_stacked_computes_the_same_tokens_and_logits(tiny_model_factory, monkeypatch, family):
    path = tiny_model_factory(family, torch_dtype="bfloat16")

    def loaded():
        return load_model(path, quantize="4bit", dequantize_weights="off", compute="checkpoint")

    separate = loaded()
    assert _stacked_count(separate.model) == 0 and separate.info.kernels["mlp_gate_up"] == "two products"
    monkeypatch.setenv(stacked.ENV, "1")
    joined = loaded()
    layers = len(joined.trunk.text.layers)
    assert _stacked_count(joined.model) == layers + 1  # every layer's MLP and the MTP head's
    assert joined.info.kernels["mlp_gate_up"] == "one stacked product (MTPLX_STACKED_MLP=1)"
    assert parameter_bytes(joined.model) == parameter_bytes(separate.model)
    ids = joined.tokenizer.encode("def add(a, b):")
    logits = [m.trunk.forward(mx.array([ids]), m.trunk.make_cache(), all_logits=True)[1] for m in (separate, joined)]
    assert mx.array_equal(*logits).item()

    def run(model, depth):
        request = GenerationRequest(ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), depth=depth)
        return model.complete(request).token_ids

    assert run(joined, 0) == run(joined, 3) == run(separate, 0)


def test_only_like_projections_are_stacked():
    """Parts of different bit widths (or a biased part) keep their two products."""
    from mlx_lm.models import qwen3

    mlp = qwen3.MLP(128, 192)
    mlp.gate_proj = nn.QuantizedLinear.from_linear(mlp.gate_proj, 64, 4)
    mlp.up_proj = nn.QuantizedLinear.from_linear(mlp.up_proj, 64, 8)
    holder = nn.Module()
    holder.mlp = mlp
    assert stacked.stack_mlps(holder) == 0 and holder.mlp is mlp
    mlp.up_proj = nn.QuantizedLinear.from_linear(qwen3.MLP(128, 192).up_proj, 64, 4)
    x = mx.random.normal((2, 128), key=mx.random.key(1)).astype(mx.bfloat16)
    before = mlp(x)
    assert stacked.stack_mlps(holder) == 1 and isinstance(holder.mlp, stacked.StackedMLP)
    assert mx.array_equal(holder.mlp(x), before).item()
