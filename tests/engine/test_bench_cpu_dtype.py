"""bench.cpu_dtype: a quantized checkpoint as the Linux CPU serves it (float32) beside the same
checkpoint in its own dtype, both arms decoding the same prompts, AR and MTP."""

from __future__ import annotations

import json
import sys

import pytest

from mtplxd.engine.bench import cpu_dtype


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU upcast is Linux's")
def test_both_arms_decode_every_prompt_and_the_report_says_their_dtypes(tiny_model_factory, tmp_path, capsys):
    path = tiny_model_factory("qwen3", quantize_bits=4, torch_dtype="bfloat16")
    out = tmp_path / "cpu-dtype.json"
    assert cpu_dtype.main(["--model", str(path), "--max-tokens", "6", "--repeats", "1",
                           "--depth", "2", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    served, kept = report["arms"]["auto"], report["arms"]["checkpoint"]
    assert (served["dtype"], kept["dtype"]) == ("float32", "bfloat16")
    assert served["weights_bytes"] > kept["weights_bytes"]  # scales, biases and norms doubled
    for label in ("ar", "mtp"):
        for arm in (served, kept):
            assert arm[label]["tokens_per_s"] > 0
            assert [len(ids) for ids in arm[label]["runs_tokens"]] == [6] * len(cpu_dtype.PROMPTS)
        assert report[f"{label}_float32_over_checkpoint"] > 0
    assert "tok/s as served (float32)" in capsys.readouterr().out
