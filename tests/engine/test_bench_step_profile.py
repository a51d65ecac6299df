"""bench.step_profile: the unprofiled steps run on this CPU at tiny dims, and the summary of
ncu's CSV (the profiled run needs a GPU and Nsight Compute: the device runs it) adds up the
duration rows in their units and divides by the steps."""

from __future__ import annotations

import json

import pytest

from mtplxd.engine.bench import real_size, step_profile

# ncu --csv layout (the "details" page): its log lines, then a header and one row per metric.
NCU_CSV = """==PROF== Connected to process 4003 (/usr/bin/python3.12)
==PROF== Profiling "graph 12": 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4003","python3.12","127.0.0.1","graph 12","1","7","","","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","1,250.50"
"1","4003","python3.12","127.0.0.1","graph 13","1","7","","","0","9.0","Command line profiler metrics","gpu__time_duration.sum","msecond","2.5"
"2","4003","python3.12","127.0.0.1","qmv_kernel","1","7","(256, 1, 1)","(1280, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","40000"
"3","4003","python3.12","127.0.0.1","graph 12","1","7","","","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","1,249.50"
"3","4003","python3.12","127.0.0.1","graph 12","1","7","","","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","123"
"""


def test_summary_adds_the_durations_in_their_units_per_step():
    summary = step_profile.summarize_ncu_csv(NCU_CSV, steps=2)
    assert summary["workloads"] == 4 and summary["workloads_per_step"] == 2
    assert summary["device_ms_total"] == pytest.approx(1.2505 + 2.5 + 0.04 + 1.2495)
    assert summary["device_ms_per_step"] == pytest.approx(5.04 / 2)
    top = summary["top_workloads"]
    assert [w["name"] for w in top] == ["graph 12", "graph 13", "qmv_kernel"]
    assert top[0]["count"] == 2 and top[0]["ms_per_step"] == pytest.approx(1.25)
    assert top[0]["median_ms"] == pytest.approx(1.25) and top[0]["max_ms"] == pytest.approx(1.2505)
    assert top[2]["median_ms"] == top[2]["max_ms"] == pytest.approx(0.04)


def test_summary_refuses_output_without_durations():
    with pytest.raises(ValueError, match="gpu__time_duration"):
        step_profile.summarize_ncu_csv("==PROF== no kernels were profiled\n", steps=1)
    with pytest.raises(ValueError, match="unit"):
        step_profile.summarize_ncu_csv(NCU_CSV.replace('"msecond"', '"cycle"'), steps=1)


def test_summarize_reads_a_file_and_writes_json(tmp_path, capsys):
    csv_path, out = tmp_path / "ncu.csv", tmp_path / "summary.json"
    csv_path.write_text(NCU_CSV)
    assert step_profile.main(["--summarize", str(csv_path), "--steps", "2", "--json-out", str(out)]) == 0
    assert json.loads(out.read_text())["device_ms_per_step"] == pytest.approx(2.52)
    assert "2.52 device ms per step" in capsys.readouterr().out


@pytest.mark.parametrize("size, depth, compiled_ar, loop", [
    ("tiny", 0, "0", "ar"), ("tiny", 2, "0", "fused"), ("tiny-hybrid", 2, "0", "fused"),
    # The AR loop as served: on CUDA a hybrid's is the compiled one (MTPLX_FUSED_AR forces it here).
    ("tiny-hybrid", 0, "1", "ar compiled")])
def test_unprofiled_steps_run_the_engines_loops(tmp_path, monkeypatch, size, depth, compiled_ar, loop):
    monkeypatch.setenv("MTPLX_FUSED_AR", compiled_ar)
    out = tmp_path / "steps.json"
    assert step_profile.main(["--size", size, "--dtype", "bf16", "--depth", str(depth), "--steps", "3",
                              "--context", "16", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["loop"] == loop and report["steps"] == 3 and not report["profiled"]
    assert report["row_invariant"] is False  # no kernel here: nothing routed
    assert report["wall_ms_per_step"] > 0 and report["cpu_ms_per_step"] > 0
    # A random head accepts almost nothing: 1 token a cycle, up to depth+1.
    assert 1 <= report["tokens_per_step"] <= depth + 1


@pytest.mark.parametrize("size, depth", [("tiny", 2), ("tiny-hybrid", 0)])
def test_stacked_steps_run_with_every_group_stacked(tmp_path, size, depth):
    """`--stacked`: the steps of a model whose projections that read one input are one
    product each (an MLP's, a GDN layer's and attention's, the head's too), as
    MTPLX_STACKED_PROJECTIONS=1 loads it."""
    out = tmp_path / "steps.json"
    assert step_profile.main(["--size", size, "--dtype", "bf16", "--depth", str(depth), "--steps", "2",
                              "--context", "16", "--stacked", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    args = real_size.SIZES[size][1]
    assert report["stacked_groups"] == 2 * (args["num_hidden_layers"] + 1)  # each layer's two, the head's two
    assert report["wall_ms_per_step"] > 0 and 1 <= report["tokens_per_step"] <= depth + 1


@pytest.mark.parametrize("depth", [0, 2])
def test_qk_norm_rope_steps_run_the_one_kernel_forward(qk_norm_rope_twin, tmp_path, depth):
    """`--qk-norm-rope`: every attention layer (the head's too) swapped as
    MTPLX_QK_NORM_ROPE=1 loads it, the steps through its forward (here the kernel's twin)."""
    out = tmp_path / "steps.json"
    assert step_profile.main(["--size", "tiny", "--dtype", "bf16", "--depth", str(depth), "--steps", "2",
                              "--context", "16", "--qk-norm-rope", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["norm_rope_layers"] == real_size.SIZES["tiny"][1]["num_hidden_layers"] + 1
    assert (1, 1 if depth == 0 else depth + 1) in qk_norm_rope_twin
    assert report["wall_ms_per_step"] > 0


def test_the_decode_threshold_moves_for_the_run_and_back(small_m_kernel_twin, tmp_path):
    """`--decode-vector-values 0`: every 1-row product of the AR steps takes the vector layout
    (the tiny model's matrices are far under the shipped threshold, where they stay on MLX),
    and the shipped threshold is back afterwards."""
    from mtplxd.engine.model import small_m_qmm

    shipped, calls = small_m_qmm.LARGE_MATRIX_VALUES, small_m_kernel_twin
    out = tmp_path / "steps.json"
    for values, vector in ((None, False), (0, True)):
        calls.clear()
        argv = ["--size", "tiny", "--dtype", "4bit", "--depth", "0", "--steps", "2", "--context", "16",
                "--small-m-kernel", "--json-out", str(out)]
        assert step_profile.main(argv + ([] if values is None else ["--decode-vector-values", str(values)])) == 0
        report = json.loads(out.read_text())
        assert report["large_matrix_values"] == (shipped if values is None else values)
        assert ("vector" in {layout for rows, layout in calls if rows == 1}) == vector
    assert small_m_qmm.LARGE_MATRIX_VALUES == shipped
