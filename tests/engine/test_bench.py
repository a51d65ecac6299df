"""The bench runs AR and MTP interleaved and writes its JSON report."""

import json
import re

from mtplxd.engine.bench.decode import main
from mtplxd.engine.bench.harness import paired_speedups


def test_bench_writes_report_with_speeds_ratio_and_acceptance(tiny_model_factory, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLX_MAX_OPS_PER_BUFFER", "200")
    out = tmp_path / "bench.json"
    status = main(["--model", str(tiny_model_factory("qwen3")), "--repeats", "1", "--max-tokens", "12",
                   "--depth", "2", "--json-out", str(out)])
    assert status == 0
    report = json.loads(out.read_text())
    assert set(report["temperatures"]) == {"0.0", "0.6"}
    greedy = report["temperatures"]["0.0"]
    assert greedy["greedy_identical"] is True
    assert greedy["ar"]["runs"] == greedy["mtp"]["runs"] == 4
    assert greedy["ar"]["decode_tokens_per_second_median"] > 0
    assert greedy["speedup"] > 0
    assert greedy["speedup_pairs_min"] <= greedy["speedup_pairs_median"]
    assert greedy["speedup_all_tokens"] > 0
    assert len(greedy["mtp"]["acceptance_by_depth"]) == 2
    assert greedy["ar"]["mean_accepted_length_all"] == [1.0] * 4
    per_run = greedy["mtp"]["mean_accepted_length_all"]
    assert len(per_run) == 4 and all(1 <= x <= 3 for x in per_run)  # depth 2: 1 to 3 per cycle
    assert report["depth"] == 2 and report["model"]["family"] == "qwen3"
    # The MLX settings a run had are in its report (CUDA graph limits change the figures).
    assert report["mlx_environment"]["MLX_MAX_OPS_PER_BUFFER"] == "200"
    printed = capsys.readouterr().out
    assert "depth 2" in printed and "saved" in printed and "back-to-back pairs median" in printed


def test_paired_speedups_weigh_every_token_and_every_pair():
    # Two prompts: MTP 3x on the first, 1.5x on the second.
    ratios = paired_speedups([100.0, 200.0], [300.0, 300.0])
    # All tokens: equal-length runs take 1/100 + 1/200 against 1/300 + 1/300 time units.
    assert abs(ratios["speedup_all_tokens"] - (1 / 100 + 1 / 200) / (2 / 300)) < 1e-12
    assert ratios["speedup_pairs_median"] == 2.25 and ratios["speedup_pairs_min"] == 1.5
    assert paired_speedups([], [])["speedup_pairs_median"] == 0.0
    # A run that decoded nothing (rate 0) drops its pair instead of dividing by zero.
    assert paired_speedups([100.0, 0.0], [300.0, 300.0])["speedup_all_tokens"] == 3.0


def test_bench_refuses_an_ar_only_model(tiny_model_factory):
    assert main(["--model", str(tiny_model_factory("llama")), "--repeats", "1"]) == 2


def test_bench_runs_the_chosen_decode_loop(tiny_model_factory, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--model", str(tiny_model_factory("qwen3")), "--repeats", "1", "--max-tokens", "8",
                 "--depth", "2", "--temperatures", "0", "--decode-loop", "fused",
                 "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["decode_loop"] == "fused"
    assert report["temperatures"]["0.0"]["greedy_identical"] is True


def test_bench_pieces_times_every_piece(tiny_model_factory, tmp_path):
    from mtplxd.engine.bench.pieces import main as pieces_main

    out = tmp_path / "pieces.json"
    assert pieces_main(["--model", str(tiny_model_factory("qwen3")), "--context", "20",
                        "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    latency = report["latency_ms"]
    assert len(latency) == 12 and all(ms > 0 for ms in latency.values())  # verify of 1..5 tokens
    assert "lm_head + T=0.6 draft draw (no top-p, noise drawn), compiled" in latency
    assert report["quantization"] is None


def test_bench_pieces_and_bench_time_a_model_quantized_at_load(tiny_model_factory, tmp_path):
    from mtplxd.engine.bench.decode import main as bench_main
    from mtplxd.engine.bench.pieces import main as pieces_main

    model = str(tiny_model_factory("qwen3"))
    out = tmp_path / "pieces.json"
    assert pieces_main(["--model", model, "--context", "20", "--quantize", "8bit",
                        "--json-out", str(out)]) == 0
    assert json.loads(out.read_text())["quantization"] == "8bit, at load"
    out = tmp_path / "bench.json"
    assert bench_main(["--model", model, "--repeats", "1", "--max-tokens", "6", "--depth", "2",
                       "--temperatures", "0", "--quantize", "8bit", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"]["quantization"] == "8bit, at load"
    assert report["temperatures"]["0.0"]["greedy_identical"] is True


def test_mtplxctl_bench_measures_the_configured_decode_loop_and_weights(tiny_model_factory, tmp_path):
    from mtplxd.engine.loaded_model import DEQUANTIZED_LABEL
    from mtplxd.paths import Paths
    from support.daemon import run_ctl

    Paths.from_env().config_file.parent.mkdir(parents=True, exist_ok=True)
    Paths.from_env().config_file.write_text('decode_loop = "fused"\nquantize = "8bit"\ndequantize = "on"\n')
    common = ["bench", "--model", str(tiny_model_factory("qwen3")), "--repeats", "1",
              "--max-tokens", "6", "--depth", "2", "--temperatures", "0"]
    for run, (extra, loop, weights) in enumerate((
            ([], "fused", "8bit, at load" + DEQUANTIZED_LABEL),
            (["--dequantize", "off"], "fused", "8bit, at load"),
            (["--decode-loop", "stepwise", "--quantize", "none"], "stepwise", None))):
        out = tmp_path / f"{run}.json"
        result = run_ctl(*common, *extra, "--json-out", str(out), timeout=300)
        assert result.returncode == 0, result.stderr
        report = json.loads(out.read_text())
        assert report["decode_loop"] == loop and report["model"]["quantization"] == weights


def test_mtplxctl_bench_table_fits_80_columns_without_cutting_a_value(tiny_model_factory, tmp_path):
    """At 80 columns headers wrap between words and a long acceptance list wraps between
    depths: no header or value ends in an ellipsis, no line is wider than the terminal."""
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "mtplxctl", "bench", "--model", str(tiny_model_factory("qwen3")),
         "--repeats", "1", "--max-tokens", "6", "--depth", "6", "--json-out", str(tmp_path / "b.json")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "…" not in result.stdout and max(map(len, lines)) <= 80, result.stdout
    table = [line for line in lines if line[:1] in "┏┃┡│└"]
    assert all(line[-1] in "┓┃┩│┘" for line in table), result.stdout
    assert "MTP tok/s" in result.stdout and "acceptance" in result.stdout
    report = json.loads((tmp_path / "b.json").read_text())
    shown = " ".join(line.split("│")[5].strip() for line in table if line.startswith("│"))
    for entry in report["temperatures"].values():  # every depth's acceptance, whole
        assert " ".join(f"{a:.0%}" for a in entry["mtp"]["acceptance_by_depth"]) in shown, result.stdout


def test_bench_ops_times_ops_by_section(tmp_path):
    from mtplxd.engine.bench.ops import main as ops_main

    out = tmp_path / "ops.json"
    assert ops_main([str(out), "norm"]) == 0
    timed = json.loads(out.read_text())["us_per_op"]
    assert set(timed) == {"elementwise add [1,384]", "rms_norm M=1", "rope M=1", "rms_norm M=4", "rope M=4"}
    assert all(us > 0 for us in timed.values())
    assert ops_main([]) == 2


def test_bench_host_splits_each_step_into_host_and_wait_and_counts_primitives(tiny_model_factory, tmp_path, capsys):
    from mtplxd.engine.bench.host import main as host_main

    out = tmp_path / "host.json"
    assert host_main(["--model", str(tiny_model_factory("qwen3")), "--depth", "2", "--tokens", "24",
                      "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["depth"] == 2 and set(report["settings"]) == {"T=0", "T=0.6"}
    for setting in report["settings"].values():
        for row in setting.values():
            assert row["host_ms"] > 0 and row["wait_ms"] >= 0
            assert row["wall_ms"] >= row["host_ms"] * 0.99
            assert row["primitives"] == sum(row["by_primitive"].values()) > 0
        assert 0 < setting["ar"]["build_ms"] <= setting["ar"]["host_ms"]  # AR's Python half of it
        assert 1 <= setting["mtp"]["tokens_per_cycle"] <= 3  # depth 2: one to three per cycle
        # a cycle holds a K+1-row verify and the head's steps: more than one AR step
        assert setting["mtp"]["primitives"] > setting["ar"]["primitives"]
    # sampling adds the noise draw, the softmaxes and the residual to a cycle
    assert report["settings"]["T=0.6"]["mtp"]["primitives"] > report["settings"]["T=0"]["mtp"]["primitives"]
    assert "primitives" in capsys.readouterr().out


def test_bench_host_refuses_an_ar_only_model(tiny_model_factory):
    from mtplxd.engine.bench.host import main as host_main

    assert host_main(["--model", str(tiny_model_factory("llama"))]) == 2


def test_mtplxctl_bench_streams_runs_every_concurrency_arm_side_by_side(tiny_model_factory, tmp_path):
    from support.daemon import run_ctl

    out = tmp_path / "streams.json"
    result = run_ctl("bench", "--model", str(tiny_model_factory("qwen3")), "--streams", "1,3",
                     "--repeats", "1", "--max-tokens", "6", "--depth", "2", "--json-out", str(out),
                     timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["depth"] == 2 and report["numerics"] == "throughput" and report["complete"]
    one, three = report["streams"]["1"], report["streams"]["3"]
    assert set(one) == {"serial_mtp", "interleaved_mtp", "ar_batch", "mtp_cohorts_per_row",
                        "mtp_cohorts_phased", "mtp_cohorts_solo_prefill", "mtp_cohorts",
                        "direct_mtp", "direct_ar"}
    assert set(three) == {"serial_mtp", "interleaved_mtp", "ar_batch", "mtp_cohorts_per_row",
                          "mtp_cohorts_phased", "mtp_cohorts_solo_prefill", "mtp_cohorts"}
    # The three requests arrive together: the cohort arms prefill them in one shared forward
    # (the bench prompts fit one chunk each), the solo-prefill arm and serial MTP never.
    assert three["mtp_cohorts"]["shared_prefill_forwards"] == [1]
    assert three["mtp_cohorts_solo_prefill"]["shared_prefill_forwards"] == [0]
    assert three["serial_mtp"]["shared_prefill_forwards"] == [0]
    assert all(arm["aggregate_tokens_per_second"] > 0 for arm in three.values())
    # Where the wall time went: rows running together overlap; serial rows never do.
    for arm in three.values():
        assert arm["ramp_seconds"] > 0 and arm["tail_seconds"] >= 0
    assert three["mtp_cohorts"]["all_decoding_seconds"] > 0
    # The cohorts' ceiling: the rows' cycles summed over the longest row's, between 1 and 3;
    # serial MTP's rows are the same greedy rows, so it names the same ceiling.
    bound = three["mtp_cohorts"]["cycle_bound_over_serial"]
    assert 1 < bound <= 3 and one["serial_mtp"]["cycle_bound_over_serial"] == 1.0
    assert three["serial_mtp"]["cycle_bound_over_serial"] == bound
    assert three["serial_mtp"]["all_decoding_seconds"] < 0
    # Three rows at once: the cohort arms ran 3 wide, the others outside cohorts.
    assert three["mtp_cohorts"]["cohort_width_cycles"].get("3", 0) > 0
    assert three["mtp_cohorts_per_row"]["cohort_width_cycles"].get("3", 0) > 0
    assert three["mtp_cohorts_phased"]["cohort_width_cycles"].get("3", 0) > 0
    assert three["ar_batch"]["cohort_width_cycles"].get("3", 0) > 0
    assert three["serial_mtp"]["cohort_width_cycles"] == {}
    assert report["ratios"]["3"]["mtp_cohorts_over_serial_mtp_aggregate"] > 0
    # Decoding alone: serial rows decode one at a time, so their decode rate is above their
    # wall-clock aggregate (the prefills are out); it is a rate, never above the tokens' count.
    serial = three["serial_mtp"]
    assert serial["aggregate_decode_tokens_per_second"] > serial["aggregate_tokens_per_second"]
    assert report["ratios"]["3"]["mtp_cohorts_over_serial_mtp_aggregate_decode"] > 0
    # Time per cycle: the decode time over the cycles on its critical path, every row's cycles
    # one after another for serial rows, the longest row's for cohort rows. So the tokens a
    # critical-path cycle adds (decode rate times cycle time) are one to three for serial rows
    # (depth 2), and for three cohort rows up to three times that and more than serial's.
    per_cycle = {name: three[name]["aggregate_decode_tokens_per_second"]
                 * three[name]["decode_ms_per_cycle"] / 1e3 for name in ("serial_mtp", "mtp_cohorts")}
    assert 1 <= per_cycle["serial_mtp"] <= 3 and per_cycle["serial_mtp"] < per_cycle["mtp_cohorts"] <= 9
    assert len(three["mtp_cohorts"]["aggregate_decode_by_repeat"]) == 1
    assert report["ratios"]["3"]["mtp_cohorts_cycle_over_serial_mtp_cycle"] > 0
    assert report["ratios"]["3"]["mtp_cohorts_over_mtp_cohorts_per_row_aggregate"] > 0
    assert report["ratios"]["3"]["mtp_cohorts_over_mtp_cohorts_phased_aggregate"] > 0
    assert report["ratios"]["3"]["mtp_cohorts_over_mtp_cohorts_solo_prefill_aggregate"] > 0
    late = report["late_short_request_beside_two_long"]
    assert set(late) == {"cohorts_off", "cohorts_always"}
    assert all(probe["ttft_seconds"] > 0 and probe["budget_seconds"] > 0 for probe in late.values())
    # A long request arriving while another decodes alone: the first moves into its cohort
    # (twice), or with the move off stays in its solo loop (twice).
    late_long = report["late_long_request"]
    assert [run["moved"] for run in late_long["moves"]] == [1, 1]
    assert all(run["first_row_cohort_widths"] for run in late_long["moves"])
    assert [run["moved"] for run in late_long["stays"]] == [0, 0]
    assert all(run["first_row_cohort_widths"] == {} for run in late_long["stays"])
    assert all(run["wall_seconds"] > 0 and min(run["decode_tokens_per_second_by_row"]) > 0
               for runs in late_long.values() for run in runs)
    bad = run_ctl("bench", "--model", str(tiny_model_factory("qwen3")), "--streams", "0,x")
    assert bad.returncode != 0 and "--streams takes stream counts" in bad.stderr


def test_the_cycle_bound_is_the_rows_cycles_over_the_longest_row():
    from mtplxd.engine.bench.concurrency import cycle_bound

    assert cycle_bound([26, 26, 26]) == 3.0  # equal rows: a cohort can triple serial
    assert cycle_bound([21, 29, 31]) == 81 / 31  # the longest row decides the cohort's time
    assert cycle_bound([5]) == 1.0 and cycle_bound([]) == 1.0


def test_bench_cohort_times_widths_and_measures_the_logit_difference(tmp_path):
    from mtplxd.engine.bench.cohort import main as cohort_main

    out = tmp_path / "cohort.json"
    assert cohort_main(["--dims", "tiny", "--dtype", "float32", "--context", "16", "--depth", "2",
                        "--widths", "1,3", "--repeats", "1", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["cycle_cost"]) == {"W=1,L=1", "W=3,L=1", "W=1,L=3", "W=3,L=3"}
    assert all(cost["batched_ms"] > 0 for cost in report["cycle_cost"].values())
    assert report["max_abs_logit_difference_batched_vs_per_row"]["1"] == 0.0
    assert report["max_abs_logit_difference_batched_vs_per_row"]["3"] < 1e-3


def test_bench_cohort_with_a_model_times_batched_drafting_against_per_row(tiny_model_factory, tmp_path):
    from mtplxd.engine.bench.cohort import main as cohort_main

    out = tmp_path / "cohort.json"
    assert cohort_main(["--model", str(tiny_model_factory("qwen3")), "--dtype", "float32",
                        "--context", "16", "--depth", "2", "--widths", "1,3", "--repeats", "1",
                        "--divergence-tokens", "6", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["draft_cost"]) == {"W=1", "W=3"}
    assert all(cost["batched_ms"] > 0 and cost["per_row_ms"] > 0
               for cost in report["draft_cost"].values())
    assert report["first_divergence_vs_solo_ar"]["3"] == [None, None, None]


def test_bench_prefill_reports_rate_first_token_and_peak_memory_per_length(tiny_model_factory, tmp_path, capsys):
    from mtplxd.engine.bench.prefill import main as prefill_main

    out = tmp_path / "prefill.json"
    # 600 tokens: two prefill chunks (512 + 88), the second attending to the first.
    status = prefill_main(["--model", str(tiny_model_factory("qwen3")), "--tokens", "40,600",
                           "--repeats", "1", "--json-out", str(out)])
    assert status == 0
    report = json.loads(out.read_text())
    rows = report["prefill"]
    assert [r["tokens"] for r in rows] == [40, 600]
    assert report["chunk"] == 512 and [r["chunks"] for r in rows] == [1, 2]
    for row in rows:
        assert row["tokens_per_second"] > 0 and len(row["runs"]) == 1
        assert 0 < row["ttft_seconds"] == row["ttft_runs"][0]
        assert 0 < row["cpu_seconds"] == row["cpu_runs"][0]
        assert row["peak_memory_bytes"] > 0
    assert report["command"].startswith("python -m mtplxd.engine.bench.prefill")
    assert "first token after" in capsys.readouterr().out


def test_bench_prefill_chunk_option_sets_the_requests_prefill_chunk(tiny_model_factory, tmp_path):
    from mtplxd.engine.bench.prefill import main as prefill_main

    out = tmp_path / "prefill.json"
    assert prefill_main(["--model", str(tiny_model_factory("qwen3")), "--tokens", "600",
                         "--repeats", "1", "--chunk", "128", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["chunk"] == 128 and report["prefill"][0]["chunks"] == 5  # 4 x 128 + 88


def test_bench_prefill_compares_attention_paths_at_each_length_and_restores_the_mode(
        tiny_model_factory, tmp_path):
    from mtplxd.engine.bench.prefill import main as prefill_main
    from mtplxd.engine.model import cpu_attention

    out = tmp_path / "prefill.json"
    before = cpu_attention.current_mode()
    assert prefill_main(["--model", str(tiny_model_factory("qwen3")), "--tokens", "40,600",
                         "--repeats", "1", "--cpu-attention", "mlx,numpy",
                         "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())["prefill"]
    assert [(r["tokens"], r["cpu_attention"]) for r in rows] == [
        (40, "mlx"), (40, "numpy"), (600, "mlx"), (600, "numpy")]
    assert all(r["load_average_before"] >= 0 and r["load_average_after"] >= 0 for r in rows)
    assert cpu_attention.current_mode() == before


def test_bench_ops_prefill_section_times_each_step_of_a_chunks_attention():
    from mtplxd.engine.bench.ops import SECTIONS, _prefill_attention

    timed: dict[str, float] = {}
    _prefill_attention(lambda name, us: timed.__setitem__(name, us), rows=8, keys=24)
    steps = [name.removeprefix("prefill ").removesuffix(" q=8 kv=24 f32") for name in timed]
    assert steps == ["sdpa causal", "scores q@k^T", "mask where", "softmax", "exp alone",
                     "power(e, x) alone", "add alone", "weights@v"]
    assert all(us > 0 for us in timed.values())
    assert "prefill" in SECTIONS


def test_bench_ops_qdtype_section_times_each_bit_width_dtype_and_row_count():
    from mtplxd.engine.bench.ops import SECTIONS, _quantized_by_dtype

    timed: dict[str, float] = {}
    _quantized_by_dtype(lambda name, us: timed.__setitem__(name, us), shapes=((128, 64),), rows=(1, 4))
    assert sorted(timed) == sorted(
        [f"qmatmul q{bits} 64->128 M={m} mlx.core.{dt}" for bits in (4, 8) for m in (1, 4)
         for dt in ("bfloat16", "float32")]
        + [f"matmul 64->128 M={m} dense mlx.core.{dt}" for m in (1, 4) for dt in ("bfloat16", "float32")])
    assert all(us > 0 for us in timed.values()) and "qdtype" in SECTIONS


def test_split_cost_bench_compares_the_timed_cycles_on_and_off(tiny_model_factory, tmp_path):
    from mtplxd.engine import generation
    from mtplxd.engine.bench.split_cost import main as split_cost

    out = tmp_path / "split.json"
    assert split_cost(["--model", str(tiny_model_factory("qwen3")), "--repeats", "1", "--max-tokens",
                       "12", "--depth", "2", "--temperatures", "0", "--json-out", str(out)]) == 0
    entry = json.loads(out.read_text())["temperatures"]["0.0"]
    assert len(entry["split_on_tok_s_all"]) == len(entry["split_off_tok_s_all"]) == 4
    assert entry["same_tokens"] is True and entry["ratio_all_tokens"] > 0
    # The "on" side timed a cycle in every request (its first); "off" timed none.
    assert entry["split"]["timed_cycles"] >= 4 and entry["split"]["draft_ms"] > 0
    assert generation.TIME_SAMPLED_CYCLES is True  # the bench leaves the engine as served


def test_busy_seconds_is_the_union_of_the_spans():
    from mtplxd.engine.bench.concurrency import busy_seconds

    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0.0, 1.0), (2.0, 3.0)]) == 2.0  # one after the other: both count
    assert busy_seconds([(0.0, 2.0), (1.0, 3.0), (1.5, 2.5)]) == 3.0  # overlapping: once
    assert busy_seconds([(1.0, 4.0), (0.0, 2.0)]) == 4.0  # any order
    assert busy_seconds([(0.0, 5.0), (1.0, 2.0)]) == 5.0  # one inside another


def test_the_profile_driver_runs_each_product_it_names(capsys):
    from mtplxd.engine.bench.small_m_ncu import main as ncu_main

    assert ncu_main(["--size", "tiny", "--matrix", "proj", "--rows", "1,3", "--calls", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Off CUDA only MLX's product runs; on CUDA the kernel's layouts follow it.
    assert lines == ["tiny proj q4 M=1 mlx: 1 calls", "tiny proj q4 M=3 mlx: 1 calls"]


def test_the_profile_drivers_variants_are_cuda_only(capsys):
    from mtplxd.engine.bench.small_m_ncu import main as ncu_main

    assert ncu_main(["--size", "tiny", "--matrix", "proj", "--rows", "1", "--calls", "1",
                     "--vector-rows", "2,4", "--persistent-blocks", "3", "--unroll", "2",
                     "--read-ceiling"]) == 0
    # The vector layout's variants and the readers are kernels: off CUDA only
    # MLX's product runs, and the options are taken without error.
    assert capsys.readouterr().out.splitlines() == ["tiny proj q4 M=1 mlx: 1 calls"]


def test_the_profile_driver_times_calls_evaluated_together(capsys):
    from mtplxd.engine.bench.small_m_ncu import main as ncu_main

    assert ncu_main(["--size", "tiny", "--matrix", "proj", "--rows", "2", "--calls", "3",
                     "--together", "4"]) == 0
    line, = capsys.readouterr().out.splitlines()
    match = re.fullmatch(r"tiny proj q4 M=2 mlx: 3 calls of 4 together, per call: "
                         r"host build ([\d.]+) us, wall ([\d.]+) us \(medians\)", line)
    assert match, line
    build, wall = float(match[1]), float(match[2])
    assert 0 < build <= wall  # the evaluation's wall time includes building the calls


def test_the_micro_benchs_hybrid_shapes_are_the_real_size_hybrids_matrices():
    """bench.small_m times the hybrid 27B's matrices by hand-written shapes: they are the ones
    real_size's hybrid-27b holds (built lazily here: nothing is allocated)."""
    from mlx_lm.models import qwen3_5

    from mtplxd.engine.bench.real_size import _HYBRID_27B
    from mtplxd.engine.bench.small_m import SHAPES

    text = dict(model_type="qwen3_5_text", rms_norm_eps=1e-6, attn_output_gate=True, **_HYBRID_27B)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text}))
    layers = model.language_model.model.layers
    gdn, attention = layers[0].linear_attn, layers[_HYBRID_27B["full_attention_interval"] - 1].self_attn
    held = {"in_proj_qkv": gdn.in_proj_qkv, "in_proj_z": gdn.in_proj_z, "in_proj_b": gdn.in_proj_b,
            "out_proj": gdn.out_proj, "q_proj": attention.q_proj, "k_proj": attention.k_proj,
            "gate_proj": layers[0].mlp.gate_proj, "down_proj": layers[0].mlp.down_proj,
            "lm_head": model.language_model.lm_head}
    assert {name: tuple(held[name].weight.shape) for name, _, _ in SHAPES["hybrid-27b"]} == {
        name: (n, k) for name, n, k in SHAPES["hybrid-27b"]}
    assert tuple(gdn.in_proj_a.weight.shape) == tuple(gdn.in_proj_b.weight.shape)
