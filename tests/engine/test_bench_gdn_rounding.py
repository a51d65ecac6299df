"""bench.gdn_rounding: a hybrid's two GDN forms in bf16 or 4-bit against its float32 self."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mtplxd.engine.bench import gdn_rounding
from mtplxd.engine.bench.real_size import build_model
from mtplxd.engine.model import gdn_chunked


@pytest.mark.parametrize("dtype", ["bf16", "4bit"])
def test_each_form_against_float32(dtype):
    rows = gdn_rounding.compare("tiny-hybrid", dtype, [1, 40])
    assert [row["tokens"] for row in rows] == [1, 40]
    for row in rows:
        # In float32 the two forms agree to float32 rounding: the float32 model is the truth.
        assert row["float32_forms_max_difference"] < 1e-3
        for form in gdn_rounding.FORMS:
            assert 0 < row[form]["max_abs_error"] < 10 and row[form]["rms_error"] <= row[form]["max_abs_error"]
        # One token: both forms are one step of the same recurrence.
        if row["tokens"] == 1:
            assert row["forms_max_difference"] < 1e-6
    assert gdn_chunked._forced is None  # the forms' forcing is undone


def test_to_float32_dequantizes_and_keeps_the_outputs():
    model, _ = build_model("tiny-hybrid", "4bit")
    ids = mx.array([[3, 1, 4, 1, 5]])
    before = model(ids).astype(mx.float32)
    gdn_rounding.to_float32(model)
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(model.parameters()))
    after = model(ids)
    # The same weights (dequantized exactly), computed in float32 instead of bf16.
    assert mx.max(mx.abs(after - before)).item() < 0.5


def test_the_command_saves_a_report(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert gdn_rounding.main(["--size", "tiny-hybrid", "--tokens", "8", "--layer-tokens", "",
                              "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bench"] == "gdn_rounding" and report["size"] == "tiny-hybrid"
    assert [row["tokens"] for row in report["lengths"]] == [8] and "device" in report
    assert report["one_layer_27b_shapes"] == []
    assert json.loads(capsys.readouterr().out) == report


@pytest.mark.parametrize("tokens", [1, 5])
def test_one_layer_at_the_27bs_shapes_both_forms_round_alike(tokens):
    """One GDN layer against a float64 recurrence: both forms within bf16 rounding of y
    (far below |y|), and in float32 inputs far tighter; one token, one identical step."""
    row = gdn_rounding.one_layer(tokens)
    for form in gdn_rounding.FORMS:
        assert row[form]["y_max_abs_error"] < 0.02 * row["y_max_abs"] + 1e-3
        assert row[form]["state_max_relative_error"] < 0.01
    if tokens == 1:
        assert row["chunked"] == row["per_token"]
    tight = gdn_rounding.one_layer(tokens, dtype=mx.float32)
    assert all(tight[form]["y_max_abs_error"] < 1e-5 for form in gdn_rounding.FORMS)


@pytest.mark.parametrize("bad", [["--tokens", "x"], ["--tokens", "0"], ["--tokens", ""],
                                 ["--layer-tokens", "0"], ["--size", "qwen3-4b"]])
def test_bad_arguments_exit_with_usage(bad):
    with pytest.raises(SystemExit) as stopped:
        gdn_rounding.main(bad)
    assert stopped.value.code == 2
