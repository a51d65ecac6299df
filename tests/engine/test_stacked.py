"""stacked.py: projections that read one input as one product (MTPLX_STACKED_PROJECTIONS=1):
an MLP's gate and up, a GDN layer's four inputs, attention's q, k and v. The stacked model
computes what the separate one does, bit for bit for quantized products, holds the same
bytes, and keeps greedy MTP equal to AR; every forward that calls the parts by name gets one
product a group, and the parts hold no arrays once the group's calls are done."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtplxd.engine import load_model
from mtplxd.engine.model import stacked
from mtplxd.engine.model.loader import parameter_bytes
from support.numerics import assert_computes_as


def _stacked_count(model: nn.Module) -> int:
    return sum(stacked.STACKED in m for _, m in model.named_modules())


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_quantized_model_stacked_computes_the_same_tokens_and_logits(tiny_model_factory, monkeypatch, family):
    path = tiny_model_factory(family, torch_dtype="bfloat16")

    def loaded():
        return load_model(path, quantize="4bit", dequantize_weights="off", compute="checkpoint")

    separate = loaded()
    assert _stacked_count(separate.model) == 0
    assert separate.info.kernels["shared_input_projections"] == "one product each"
    monkeypatch.setenv(stacked.ENV, "1")
    joined = loaded()
    layers = joined.trunk.text.layers
    groups = 2 * (len(layers) + 1)  # each layer's MLP and its attention or GDN inputs; the head's two
    assert _stacked_count(joined.model) == groups
    assert joined.info.kernels["shared_input_projections"] == (
        f"stacked: one product a group ({groups} groups, MTPLX_STACKED_PROJECTIONS=1)")
    assert parameter_bytes(joined.model) == parameter_bytes(separate.model)
    assert_computes_as(joined, separate, joined.tokenizer.encode("def add(a, b):"))


def test_only_like_projections_are_stacked():
    """Parts of different bit widths (or a biased part) keep their two products."""
    from mlx_lm.models import qwen3

    mlp = qwen3.MLP(128, 192)
    mlp.gate_proj = nn.QuantizedLinear.from_linear(mlp.gate_proj, 64, 4)
    mlp.up_proj = nn.QuantizedLinear.from_linear(mlp.up_proj, 64, 8)
    holder = nn.Module()
    holder.mlp = mlp
    assert stacked.stack(holder) == 0 and stacked.STACKED not in mlp
    mlp.up_proj = nn.QuantizedLinear.from_linear(qwen3.MLP(128, 192).up_proj, 64, 4)
    x = mx.random.normal((2, 128), key=mx.random.key(1)).astype(mx.bfloat16)
    before = mlp(x)
    assert stacked.stack(holder) == 1 and holder.mlp is mlp and isinstance(mlp.gate_proj, stacked.PartOf)
    assert mx.array_equal(holder.mlp(x), before).item()


def test_the_parts_share_one_product_per_input_and_keep_nothing_after():
    """q, k and v called on one array: one stacked product; a part called alone, or on
    another array, still gets its own columns; once every part has its columns, the group
    holds no arrays (a long prompt's activations are not kept alive)."""
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=128, num_hidden_layers=1, intermediate_size=192,
                           num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=64, num_key_value_heads=2,
                           max_position_embeddings=256, rope_theta=10000.0, head_dim=32, tie_word_embeddings=True)
    attention = qwen3.Attention(args)
    for name in ("q_proj", "k_proj", "v_proj"):
        attention[name] = nn.QuantizedLinear.from_linear(attention[name], 64, 4)
    x, y = (mx.random.normal((1, 3, 128), key=mx.random.key(k)).astype(mx.bfloat16) for k in (1, 2))
    separate = {name: (attention[name](x), attention[name](y)) for name in ("q_proj", "k_proj", "v_proj")}
    assert stacked.stack(attention) == 1
    products = []

    class Counted(nn.QuantizedLinear):
        def __call__(self, a):
            products.append(a)
            return super().__call__(a)

    attention[stacked.STACKED].__class__ = Counted
    shared = attention.q_proj._shared()
    assert all(mx.array_equal(attention[name](x), separate[name][0]).item() for name in ("q_proj", "k_proj", "v_proj"))
    assert len(products) == 1 and shared._memo.input is None
    assert mx.array_equal(attention.k_proj(y), separate["k_proj"][1]).item()  # alone, on another input
    assert mx.array_equal(attention.k_proj(y), separate["k_proj"][1]).item()  # its columns taken: again
    assert mx.array_equal(attention.v_proj(x), separate["v_proj"][0]).item()
    assert len(products) == 4
    for name in ("q_proj", "k_proj"):
        assert mx.array_equal(attention[name](x), separate[name][0]).item()
    assert len(products) == 4 and shared._memo.input is None


def test_mlx_lms_own_gdn_forward_finds_the_stacked_parts_by_name(tiny_model_factory, monkeypatch):
    """Masked cohort rows and long CPU prompts run mlx-lm's GDN forward, which calls
    in_proj_qkv/z/b/a: each is the stacked layer's rows (no bytes of its own), and the forward
    computes what the separate layers did."""
    from mlx_lm.models.cache import ArraysCache

    path = tiny_model_factory("qwen3_5", torch_dtype="bfloat16")
    separate = load_model(path, quantize="4bit", dequantize_weights="off", compute="checkpoint")
    monkeypatch.setenv(stacked.ENV, "1")
    joined = load_model(path, quantize="4bit", dequantize_weights="off", compute="checkpoint")
    gdn = [layer.linear_attn for layer in joined.trunk.text.layers if getattr(layer, "is_linear", False)]
    assert gdn and all(isinstance(m.in_proj_qkv, stacked.PartOf) and not m.in_proj_qkv.parameters() for m in gdn)
    x = mx.random.normal((1, 5, joined.trunk.text.args.hidden_size), key=mx.random.key(2)).astype(mx.bfloat16)
    plain = [layer.linear_attn for layer in separate.trunk.text.layers if getattr(layer, "is_linear", False)][0]
    mask = mx.array([[True, True, True, True, False]])  # a padded cohort row
    assert mx.array_equal(gdn[0](x, mask, ArraysCache(size=2)), plain(x, mask, ArraysCache(size=2))).item()
