"""bench.fused_products: the products of one layer that share an input, separate against
stacked, and whether the stacked one's columns are the parts' bit for bit."""

from __future__ import annotations

import json

import mlx.core as mx

from mtplxd.engine.bench import fused_products
from mtplxd.engine.model import small_m_qmm
from mtplxd.engine.model.kv_cache import fixed_shapes_wanted


def test_it_runs_here_on_mlx_and_the_stacked_product_equals_the_parts(tmp_path):
    out = tmp_path / "fused.json"
    assert fused_products.main([str(out), "--sizes", "tiny", "--rows", "1,3", "--bits", "4,8",
                                "--repeats", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["kernel_usable"] is fixed_shapes_wanted()
    rows = report["results"]
    assert [(r["group"], r["bits"], r["M"]) for r in rows] == [
        (group, bits, M) for group in ("mlp_in", "gdn_in") for bits in (4, 8) for M in (1, 3)]
    for row in rows:
        assert row["weight_bytes"] > 0 and row["parts"] and len(row["parts"]) == len(row["N_parts"])
        assert row["mlx"]["separate_us"] > 0 and row["mlx"]["fused_us"] > 0
        assert row["mlx"]["equal"] is True  # each column its own weight row's dot product
        if not fixed_shapes_wanted():
            assert "mma" not in row and "routed" not in row


def test_on_cuda_each_path_is_timed_and_a_product_that_depends_on_its_width_is_caught(
        monkeypatch, small_m_kernel_twin):
    """The kernel's paths through its plain-ops twin (as on CUDA): the mma layout and the mixed
    routing's choice per product; a twin whose output moved with the matrix's width (what
    would make a stacked engine change tokens) reads `equal` False."""
    calls = small_m_kernel_twin
    K, parts = 128, [("gate_proj", 192), ("up_proj", 192)]
    rows = fused_products.measure_group(K, parts, 4, [1, 2], repeats=1, on_cuda=True)
    assert all(row[path]["equal"] for row in rows for path in ("mlx", "mma", "routed"))
    assert {layout for _, layout in calls} >= {"mma"}
    twin = small_m_qmm.small_m_matmul

    def width_dependent(x, w, scales, biases, bits, layout=None):
        return twin(x, w, scales, biases, bits, layout=layout) + (w.shape[0] > 192)

    monkeypatch.setattr(small_m_qmm, "small_m_matmul", width_dependent)
    rows = fused_products.measure_group(K, parts, 4, [2], repeats=1, on_cuda=True)
    assert rows[0]["mma"]["equal"] is False and rows[0]["mlx"]["equal"] is True


def test_the_stacked_layer_holds_the_parts_quantized_values_group_for_group():
    from mtplxd.engine.model.stacked import stacked_projection

    parts = [fused_products.quantized_layer(N, 128, 8, seed=N) for N in (64, 8)]
    fused = stacked_projection(*parts)
    assert fused.weight.shape == (72, 128 * 8 // 32) and fused.scales.shape == (72, 2)
    x = mx.random.normal((3, 128), key=mx.random.key(0)).astype(mx.bfloat16)
    assert mx.array_equal(fused(x), mx.concatenate([p(x) for p in parts], axis=-1)).item()


def test_the_hybrid_groups_are_the_real_size_hybrids_matrices():
    """The groups are hand-written shapes: they are the ones real_size's hybrid-27b holds
    (built lazily here: nothing is allocated)."""
    from mlx_lm.models import qwen3_5

    from mtplxd.engine.bench.real_size import _HYBRID_27B

    text = dict(model_type="qwen3_5_text", rms_norm_eps=1e-6, attn_output_gate=True, **_HYBRID_27B)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text}))
    layers = model.language_model.model.layers
    gdn, attention = layers[0].linear_attn, layers[_HYBRID_27B["full_attention_interval"] - 1].self_attn
    held = {"gdn_in": gdn, "mlp_in": layers[0].mlp, "attention_in": attention}
    for group, K, parts in fused_products.GROUPS["hybrid-27b"]:
        for name, N in parts:
            assert tuple(getattr(held[group], name).weight.shape) == (N, K), (group, name)
