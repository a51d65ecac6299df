"""The session bench runs end to end on a tiny model and reports consistent figures."""

from __future__ import annotations

import json

from mtplxd.engine.bench import session as session_bench


def test_bench_on_tiny_model(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = session_bench.main(["--model", str(tiny_checkpoint("qwen3")), "--tokens", "700",
                               "--repeats", "1", "--answer-tokens", "8", "--json-out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["identical_output"] is True
    assert report["prompt_tokens"] >= 700
    assert report["cached_tokens_warm"] >= report["prompt_tokens"] - 1
    assert report["cached_tokens_ssd"] == report["cached_tokens_warm"]
    assert report["cold_ttft_s"] > 0 and report["warm_ttft_s"] > 0
    assert "warm (RAM)" in capsys.readouterr().out
