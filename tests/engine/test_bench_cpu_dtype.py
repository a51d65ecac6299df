"""bench.cpu_dtype: a quantized checkpoint in the three forms the Linux CPU can serve it (dense
float32, packed with float32 scales, packed in its own dtype), every arm decoding the same
prompts, AR and MTP."""

from __future__ import annotations

import json
import sys

import pytest

from mtplxd.engine.bench import cpu_dtype
from mtplxd.engine.loaded_model import DEQUANTIZED_LABEL

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU upcast is Linux's")


def test_every_arm_decodes_every_prompt_and_the_report_says_its_form(tiny_model_factory, tmp_path, capsys):
    path = tiny_model_factory("qwen3", quantize_bits=4, torch_dtype="bfloat16")
    out = tmp_path / "cpu-dtype.json"
    assert cpu_dtype.main(["--model", str(path), "--max-tokens", "6", "--repeats", "1",
                           "--depth", "2", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    dense, packed, kept = (report["arms"][name] for name in ("dense", "packed", "checkpoint"))
    assert (dense["dtype"], packed["dtype"], kept["dtype"]) == ("float32", "float32", "bfloat16")
    assert dense["quantization"] == "4bit" + DEQUANTIZED_LABEL and packed["quantization"] == "4bit"
    # Dense float32 weights, then packed ones with float32 scales, biases and norms.
    assert dense["weights_bytes"] > packed["weights_bytes"] > kept["weights_bytes"]
    for label in ("ar", "mtp"):
        for arm in (dense, packed, kept):
            assert arm[label]["tokens_per_s"] > 0
            assert [len(ids) for ids in arm[label]["runs_tokens"]] == [6] * len(cpu_dtype.PROMPTS)
        assert set(report["ratios"][label]) == {"dense_over_checkpoint", "packed_over_checkpoint"}
        assert all(value > 0 for value in report["ratios"][label].values())
    assert "ar tok/s: dense" in capsys.readouterr().out


def test_two_arms_and_a_bad_choice(tiny_model_factory, tmp_path):
    path = tiny_model_factory("qwen3", quantize_bits=4, torch_dtype="bfloat16")
    out = tmp_path / "two.json"
    assert cpu_dtype.main(["--model", str(path), "--max-tokens", "4", "--repeats", "1",
                           "--arms", "dense,packed", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["arms"]) == {"dense", "packed"} and report["depth"] > 0
    assert set(report["ratios"]["mtp"]) == {"dense_over_packed"}
    with pytest.raises(SystemExit):
        cpu_dtype.main(["--model", str(path), "--arms", "dense,dense"])
