"""Our AR beside mlx-lm's generate_step (bench.ar_parity), through the GPU script's own CPU
path at tiny dims: one JSON with every dtype and mode, and per token our step launches no
more kernels than mlx-lm's, in bf16, 8-bit and 4-bit, greedy and sampled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtplxd.engine.bench import ar_parity

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "benchmarks-data" / "h200-ar-parity.sh"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("ar-parity")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, PYTHONPATH=str(ROOT), SIZE="tiny",
               CONTEXT="32", TOKENS="4", REPEATS="2")
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert "ar_parity: exit 0" in done.stdout, done.stdout + done.stderr
    return json.loads((out / "h200-ar-parity.json").read_text())


def test_the_script_writes_one_complete_json_with_every_dtype_and_mode(report):
    assert report["complete"] is True and report["size"] == "tiny" and report["context"] == 32
    assert [c["dtype"] for c in report["configs"]] == ["4bit", "bf16", "8bit"]
    for config in report["configs"]:
        assert config["runs_per_arm"] == 2 and set(config["modes"]) == {"0.0", "0.6"}
        for mode in config["modes"].values():
            decode = mode["decode"]
            assert len(decode["ms_per_token_all"]["ours"]) == len(decode["ms_per_token_all"]["mlx_lm"]) == 2
            ms = decode["ms_per_token_median"]
            assert ms["ours"] > 0 and ms["mlx_lm"] > 0
            assert decode["speed_vs_mlx_lm"] == pytest.approx(ms["mlx_lm"] / ms["ours"])
            cpu = decode["ms_per_token_cpu_median"]
            assert cpu["ours"] > 0 and cpu["mlx_lm"] > 0
            assert decode["speed_vs_mlx_lm_cpu"] == pytest.approx(cpu["mlx_lm"] / cpu["ours"])
            for arm in ("ours", "mlx_lm"):
                assert mode["work"][arm]["host_build_us"] > 0


def test_our_step_launches_no_more_kernels_than_generate_step_in_any_mode(report):
    for config in report["configs"]:
        for temperature, mode in config["modes"].items():
            ours, theirs = mode["work"]["ours"], mode["work"]["mlx_lm"]
            assert ours["kernels_per_token"] <= theirs["kernels_per_token"], (config["dtype"], temperature)
            assert mode["sampler_kernels"]["ours"] <= mode["sampler_kernels"]["mlx_lm"]
            # The forwards are the same model: the same matmuls, quantized or not.
            for matmul in ("Matmul", "QuantizedMatmul"):
                assert ours["kernels"].get(matmul) == theirs["kernels"].get(matmul)
    greedy_4bit = report["configs"][0]["modes"]["0.0"]
    assert greedy_4bit["work"]["ours"]["kernels"]["QuantizedMatmul"] > 0
    assert greedy_4bit["sampler_kernels"] == {"ours": 1, "mlx_lm": 3}  # argmax; log-softmax + argmax


def test_a_spent_budget_starts_no_new_run_and_says_the_report_is_incomplete(tmp_path, capsys):
    out = tmp_path / "cut.json"
    assert ar_parity.main(["--size", "tiny", "--dtypes", "bf16,4bit", "--context", "16", "--tokens", "2",
                           "--repeats", "3", "--temperatures", "0", "--budget-s", "1e-9",
                           "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] is False and report["configs"] == []
    assert "skipped, the budget is spent" in capsys.readouterr().out


def test_kernels_in_counts_work_and_leaves_views_out():
    import mlx.core as mx

    base = mx.ones((2, 8))
    mx.eval(base)
    added = base + 1
    assert ar_parity.kernels_in([added.reshape(16)[None]]) == {"Add": 1}
    assert ar_parity.kernels_in([mx.argmax(added[0], axis=-1)]) == {"Add": 1, "Gather": 1, "ArgReduce": 1}


def test_the_hybrid_sizes_are_measured_too(tmp_path):
    """The hybrid 27B's single decode figures swing between processes on the H200, so point 5
    needs the interleaved arms there: the tiny hybrid runs them here, the same forward in
    both (the Gated DeltaNet layers' matmuls and convolutions counted alike)."""
    out = tmp_path / "hybrid.json"
    assert ar_parity.main(["--size", "tiny-hybrid", "--dtypes", "4bit", "--context", "16", "--tokens", "2",
                           "--repeats", "1", "--temperatures", "0", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] is True
    work = report["configs"][0]["modes"]["0.0"]["work"]
    for kind in ("QuantizedMatmul", "Convolution"):
        assert work["ours"]["kernels"][kind] == work["mlx_lm"]["kernels"][kind] > 0
