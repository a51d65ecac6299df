"""The distributed bench with a tensor-parallel group: a real 2-rank group on 127.0.0.1, its
report's timing shape (whole split forwards, no compute/communication split)."""

from __future__ import annotations

import json

from mtplxd.engine.bench import distributed


def test_the_bench_runs_a_tensor_group_and_reports_its_exchanges(tmp_path):
    out = tmp_path / "report.json"
    # hidden 512: 8 heads of 64, 2 key/value heads, which 2 ranks can split
    distributed.main(["--parallel", "tensor", "--ranks", "2", "--layers", "2", "--hidden", "512",
                      "--max-tokens", "4", "--repeats", "1", "--json-out", str(out)])
    report = json.loads(out.read_text())
    assert report["parallel"] == "tensor"
    group = report["configurations"]["2_ranks"]
    assert group["ar_decode_tok_s"] > 0 and group["mtp_decode_tok_s"] > 0
    assert group["all_sums_per_exchange"] == 4  # two per layer
    assert "split" not in group and "communication_ms_per_exchange" not in group
    # One announced forward per decode step (AR) or cycle (MTP), after the prompt's.
    assert group["exchanges"] >= 4
    assert group["depth_0_exchange_ms_per_cycle"] > 0
    assert group["depth_3_exchange_ms_per_cycle"] > 0
