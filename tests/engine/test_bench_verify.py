"""The verify-cost probe runs end to end on a tiny in-memory model."""

import json

from mtplxd.engine.bench.verify import main


def test_bench_verify_reports_costs_and_greedy_agreement(tmp_path):
    out = tmp_path / "verify.json"
    assert main(["--dims", "tiny", "--dtype", "float32", "--context", "32", "--max-depth", "3",
                 "--repeats", "2", "--greedy-tokens", "16", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["forward_ms_by_tokens"]) == {"1", "2", "3", "4"}
    assert set(report["cycle_ms_by_depth"]) == {"1", "2", "3"}
    assert set(report["cycle_ms_by_depth_q4_draft_head"]) == {"1", "2", "3"}
    assert all(v > 0 for v in report["verify_over_decode_by_depth"].values())
    # On the CPU backend a K+1 verify equals K+1 decode steps bitwise: greedy MTP == AR.
    for kv in ("plain_kv", "bucketed_kv"):
        greedy = report["greedy"][kv]
        assert greedy["identical"] is True and greedy["first_divergence"] is None
        assert greedy["decode_tokens_per_second_ar"] > 0 and greedy["mtp_ms_per_cycle"] > 0
