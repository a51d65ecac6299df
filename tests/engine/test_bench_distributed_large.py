"""The H200 script of issue #26's large single-rank baseline, shrunk to run here: it builds
its random-weight model on the machine that runs it, in bfloat16, then runs the single-rank
distributed bench on it, AR and MTP, into one JSON under $OUT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "docs/benchmarks-data/h200-distributed-large.sh"


def test_the_large_baseline_script_builds_its_model_and_reports_ar_and_mtp(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "TMPDIR": str(tmp_path),
           "LAYERS": "2", "HIDDEN": "128", "TOKENS": "4", "REPEATS": "1"}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=SCRIPT.parents[2], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exit 0" in done.stdout
    [report_path] = out.glob("*.json")
    assert report_path.name == "h200-distributed-single-rank-random-l2-h128.json"
    report = json.loads(report_path.read_text())
    # Built here, at the asked size, in bfloat16: 2 layers of hidden 128, MLP 384, 2 heads of
    # 64 (query 128 wide, key/value 64), plus the embeddings, lm_head and the MTP head.
    assert (report["layers"], report["hidden"]) == (2, 128)
    assert report["checkpoint"]["dtypes"] == ["BF16"]
    per_layer = 128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 384 + 2 * 128 + 2 * 64
    ends = 2 * 400 * 128 + 128 * 256  # embedding and lm_head (400 tokens), the MTP head's fc
    params = report["checkpoint"]["parameters"]
    assert 3 * per_layer + ends < params < 3 * per_layer + ends + 32 * 128  # + norms
    assert report["checkpoint"]["bytes"] >= 2 * report["checkpoint"]["parameters"]
    assert report["build_seconds"] is not None
    single = report["configurations"]["1_ranks"]
    assert single["ar_decode_tok_s"] > 0 and single["mtp_decode_tok_s"] > 0
    assert single["mtp_mean_accepted_length"] >= 1
    # The written model is removed at the end: on the GPU machine it is 16 GB of local disk.
    assert not list(tmp_path.glob("mtplx-bench-distributed-*/model"))
