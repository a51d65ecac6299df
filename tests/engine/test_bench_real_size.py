"""The real-size bench (bench.real_size) at tiny dims, and our AR beside mlx-lm's
generate_step (bench.ar_reference): they run end to end on this CPU and their JSON holds
the figures the docs' tables are made of, consistent with each other."""

from __future__ import annotations

import json
import os

import pytest

from mtplxd.engine.bench import ar_reference, real_size


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("real-size") / "real-size.json"
    assert real_size.main(["--sizes", "tiny,tiny-hybrid", "--dtypes", "bf16,4bit", "--context", "32",
                           "--depths", "1,2", "--decode-tokens", "4", "--cycles", "2", "--repeats", "2",
                           "--small-m-kernel", "--divergence-tokens", "12", "--json-out", str(out)]) == 0
    return json.loads(out.read_text())


def test_every_size_and_dtype_is_measured(report):
    assert [(c["size"], c["dtype"]) for c in report["configs"]] == [
        ("tiny", "bf16"), ("tiny", "4bit"), ("tiny-hybrid", "bf16"), ("tiny-hybrid", "4bit")]
    assert report["profile"] == list(real_size.PROFILE) and report["context"] == 32
    assert "real_size" in report["command"]


def test_decode_is_beside_mlx_lm_and_against_the_roofline(report):
    for config in report["configs"]:
        for temperature in ("0.0", "0.6"):
            decode = config["decode"][temperature]
            assert decode["ours_ms"] > 0 and decode["mlx_lm_ms"] > 0
            assert decode["speed_vs_mlx_lm"] == pytest.approx(decode["mlx_lm_ms"] / decode["ours_ms"])
        assert config["roofline_ms"] == pytest.approx(
            config["bytes_read_per_step"] / real_size.BANDWIDTH_BYTES_PER_S * 1000)
        assert config["of_roofline"] == pytest.approx(config["roofline_ms"] / config["decode"]["0.0"]["ours_ms"])


def test_the_decode_step_is_split_into_host_and_device_wait(report):
    for config in report["configs"]:
        split = config["decode_host_split"]
        assert split["host_ms"] > 0 and split["wait_ms"] >= 0
        assert split["wall_ms"] >= split["host_ms"]
        assert 0 < split["build_ms"] <= split["host_ms"]  # building the graph is part of the host's time
        pipelined = config["forward_pipelined_ms_by_tokens"]
        assert list(pipelined) == [str(t) for t in range(1, 7)] and all(ms > 0 for ms in pipelined.values())
        assert config["forward_pipelined_over_decode"]["6"] == pytest.approx(
            pipelined["6"] / config["decode"]["0.0"]["ours_ms"])
        assert config["decode_compiled_greedy_ms"] > 0  # dense and hybrid: the fused loops' caches
        assert split["primitives"] == sum(split["by_primitive"].values()) > 0
    # The quantized model's step multiplies through QuantizedMatmul, the bf16 one through Matmul.
    by_dtype = {c["dtype"]: c["decode_host_split"]["by_primitive"] for c in report["configs"] if c["size"] == "tiny"}
    assert "QuantizedMatmul" in by_dtype["4bit"] and "QuantizedMatmul" not in by_dtype["bf16"]


def test_bytes_read_count_the_embedding_only_when_it_is_the_lm_head(report):
    tiny_bf16, tiny_q4, hybrid_bf16, _ = report["configs"]
    # tiny is tied: its table is read whole as the lm_head; tiny-hybrid's only gives a row.
    assert tiny_bf16["bytes_read_per_step"] == tiny_bf16["weights_bytes"] + tiny_bf16["kv_bytes"]
    assert hybrid_bf16["bytes_read_per_step"] < hybrid_bf16["weights_bytes"] + hybrid_bf16["kv_bytes"]
    assert tiny_q4["weights_bytes"] < tiny_bf16["weights_bytes"] / 2  # 4-bit plus scales and biases
    assert hybrid_bf16["gdn_verify"] == "per-token" and tiny_bf16["gdn_verify"] is None
    assert hybrid_bf16["gdn_decode"] == "mlx-lm ops" and tiny_bf16["gdn_decode"] is None


def test_forwards_and_cycles_are_multiples_of_a_decode_step(report):
    for config in report["configs"]:
        forward = config["forward_ms_by_tokens"]
        assert set(forward) == {"1", "2", "3", "4", "5", "6"}
        assert config["forward_over_one_token"]["1"] == 1.0
        compiled = config["forward_compiled_ms_by_tokens"]  # the verify as the fused loop runs it
        if config["family"] == "qwen3":
            assert set(compiled) == set(forward) and config["forward_compiled_over_one_token"]["1"] == 1.0
            assert config["forward_compiled_over_decode"]["6"] == pytest.approx(
                compiled["6"] / config["decode"]["0.0"]["ours_ms"])
        else:  # a hybrid's recurrent state: not over fixed buffers in this bench
            assert compiled == {} and config["forward_compiled_over_decode"] == {}
        for temperature in ("0.0", "0.6"):
            cycles = config["cycles"][temperature]
            decode = config["decode"][temperature]["ours_ms"]
            assert set(cycles["cycle_ms_by_depth"]) == {"1", "2"}
            for depth, ms in cycles["cycle_ms_by_depth"].items():
                assert cycles["cycle_over_decode_by_depth"][depth] == pytest.approx(ms / decode)
                tokens = 1 + sum(real_size.PROFILE[:int(depth)])
                assert cycles["projected_mtp_over_ar"][depth] == pytest.approx(tokens * decode / ms)
        assert config["cycles"]["0.0"]["loop"] == "fused"  # hybrid models too, as served
        if config["dtype"] == "4bit":  # off CUDA the kernel does not install: nothing extra timed
            assert config["small_m_kernel_layers"] == 0
            assert "forward_ms_by_tokens_small_m_kernel" not in config


def test_an_unknown_size_is_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        real_size.main(["--sizes", "qwen3-70b"])
    assert exit_info.value.code == 2
    assert "qwen3-70b" in capsys.readouterr().err


def test_ar_reference_runs_ours_before_and_mlx_lm_side_by_side(tiny_model_factory, tmp_path, capsys):
    out = tmp_path / "ar.json"
    assert ar_reference.main(["--model", str(tiny_model_factory("qwen3")), "--tokens", "6",
                              "--repeats", "1", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    for temperature in ("0.0", "0.6"):
        entry = report["temperatures"][temperature]
        assert set(entry["ms_per_token_median"]) == {"ours", "ours_before", "mlx_lm"}
        assert all(len(runs) == 4 for runs in entry["ms_per_token_all"].values())
        assert entry["speed_vs_mlx_lm"] == pytest.approx(
            entry["ms_per_token_median"]["mlx_lm"] / entry["ms_per_token_median"]["ours"])
    assert "ours vs mlx-lm" in capsys.readouterr().out


def test_taking_the_kernel_out_drops_the_cycle_graphs_traced_through_it():
    """mx.compile replays a traced graph: a cycle graph traced through MLX's layers must not be
    replayed once the kernel is in, nor one traced through the kernel after it is taken out."""
    import mlx.nn as nn

    from mtplxd.engine.bench import real_size
    from mtplxd.engine.model import small_m_qmm
    from mtplxd.engine.model.trunk import Trunk

    model, spec = real_size.build_model("tiny", "4bit")
    trunk = Trunk(model, spec)
    layer = next(m for _, m in model.named_modules() if type(m) is nn.QuantizedLinear)
    trunk.compiled_graphs[("cycle", 3)] = object()
    with real_size.kernel_installed(model, trunk, force=True) as switched:
        assert switched == 0 and trunk.compiled_graphs == {}  # off CUDA it switches nothing
        layer.__class__ = small_m_qmm.SmallMQuantizedLinear  # as an install on CUDA would
        trunk.compiled_graphs[("cycle", 3)] = object()
    assert type(layer) is nn.QuantizedLinear and trunk.compiled_graphs == {}


def test_f32_holds_the_model_in_float32_and_prices_its_kv_at_four_bytes():
    """The exactness control: every weight float32 (none quantized), and a step reads twice
    the bf16 model's bytes, KV included."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mtplxd.engine.model.trunk import Trunk

    sizes = {}
    for dtype in ("f32", "bf16"):
        model, spec = real_size.build_model("tiny-hybrid", dtype)
        if dtype == "f32":
            assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}
        sizes[dtype] = real_size.bytes_read_per_step(model, Trunk(model, spec), 64)
    assert sizes["f32"]["kv_bytes"] == 2 * sizes["bf16"]["kv_bytes"] > 0
    assert sizes["f32"]["bytes_read_per_step"] == 2 * sizes["bf16"]["bytes_read_per_step"]


def test_decode_by_vector_values_times_each_threshold_and_puts_the_shipped_one_back():
    """The decode-routing sweep moves small_m_qmm.LARGE_MATRIX_VALUES for its timings only,
    and drops the graphs traced under each routing (a traced step keeps what it saw)."""
    from mtplxd.engine.model import small_m_qmm
    from mtplxd.engine.model.trunk import Trunk

    shipped = small_m_qmm.LARGE_MATRIX_VALUES
    model, spec = real_size.build_model("tiny", "4bit")
    trunk = Trunk(model, spec)
    trunk.compiled_graphs[("decode",)] = object()
    prompt = list(range(1, 20))
    timed = real_size._decode_by_vector_values(trunk, prompt, 3, (2**24, 0))
    assert list(timed) == [str(2**24), "0"] and all(ms > 0 for ms in timed.values())
    assert small_m_qmm.LARGE_MATRIX_VALUES == shipped and trunk.compiled_graphs == {}


def test_greedy_mtp_follows_greedy_ar_through_the_engines_loops_on_this_cpu(report):
    """Issue 22 point 4's measure, run where exactness is bitwise: no divergence in 12 tokens,
    on the dense model and the hybrid (both in the fused loop), the kernel as served (off here)."""
    for config in report["configs"]:
        divergence = config["greedy_divergence"]
        assert divergence["tokens"] == 12 and divergence["depth"] == 3
        assert divergence["identical"] and divergence["first_divergence"] is None
        assert divergence["divergences"] == [] and divergence["tokens_checked"] == 12
        assert divergence["small_m_kernel"] is False


def _mtp_altered_at(monkeypatch, prompt_length: int, positions: set[int]) -> None:
    """Make the engine's MTP loops emit a wrong token at each of `positions` (counted from the
    first generated token of a `prompt_length` prompt, whatever prompt a resynchronised run
    starts from); AR's loop stays as it is."""
    real_loop = real_size.engine_loop

    def altered(trunk, head, prompt, depth, temperature, first=None):
        loop, first, fused = real_loop(trunk, head, prompt, depth, temperature, first)
        if depth == 0:
            return loop, first, fused

        def shifted():
            produced = len(prompt) - prompt_length + 1  # the first token's position is len - prompt_length
            for tokens in loop:
                yield [(t + 1) % 512 if produced + i in positions else t for i, t in enumerate(tokens)]
                produced += len(tokens)
        return shifted(), first, fused

    monkeypatch.setattr(real_size, "engine_loop", altered)


def test_every_divergence_is_located_and_its_logit_gaps_measured(monkeypatch):
    """Where the MTP run differs (made to here at tokens 5 and 8), MTP is resynchronised on
    AR's tokens and the next divergence found; each names its position and the AR step's
    logits there (AR's token is the argmax, so both gaps are at least 0)."""
    from mtplxd.engine.model.trunk import Trunk

    model, spec = real_size.build_model("tiny", "bf16")
    trunk = Trunk(model, spec)
    prompt = list(range(1, 30))
    _mtp_altered_at(monkeypatch, len(prompt), {5, 8})
    report = real_size.greedy_divergence(trunk, model.mtp, prompt, 2, 12)
    assert report["first_divergence"] == 5 and not report["identical"]
    assert [d["token"] for d in report["divergences"]] == [5, 8] and report["tokens_checked"] == 12
    assert report["ar_top2_gap_at_divergence"] >= 0 and report["mtp_token_logit_gap"] >= 0
    assert report["largest_mtp_token_logit_gap"] == max(d["mtp_token_logit_gap"] for d in report["divergences"])
    # At the limit it stops looking and says how far it looked.
    limited = real_size.greedy_divergence(trunk, model.mtp, prompt, 2, 12, max_divergences=1)
    assert [d["token"] for d in limited["divergences"]] == [5] and limited["tokens_checked"] == 6


def test_a_divergence_at_the_last_token_and_at_the_first_generated_one(monkeypatch):
    """The edges of the span: a wrong token at the last position is found; one at position 1
    (the first token MTP generates) too, and the resynchronised run goes on from there."""
    from mtplxd.engine.model.trunk import Trunk

    model, spec = real_size.build_model("tiny", "bf16")
    trunk = Trunk(model, spec)
    prompt = list(range(1, 30))
    _mtp_altered_at(monkeypatch, len(prompt), {1, 11})
    report = real_size.greedy_divergence(trunk, model.mtp, prompt, 3, 12)
    assert [d["token"] for d in report["divergences"]] == [1, 11]


@pytest.mark.parametrize("given, in_force", [("never", "maxsize"), ("1024", 1024)])
def test_kernel_decode_from_holds_for_the_whole_run_and_the_shipped_threshold_comes_back(
        monkeypatch, tmp_path, given, in_force):
    """`--kernel-decode-from never` keeps decode steps off the kernel for every figure of the
    run (the hybrid's decode ran slower through it); the report says so."""
    import sys

    from mtplxd.engine.model import small_m_qmm

    shipped, seen = small_m_qmm.LARGE_MATRIX_VALUES, []
    def measure_all(args, sizes, dtypes, depths, temperatures, report):
        seen.append(small_m_qmm.LARGE_MATRIX_VALUES)
        real_size.write_report(args.json_out, report)

    monkeypatch.setattr(real_size, "_measure_all", measure_all)
    out = tmp_path / "r.json"
    assert real_size.main(["--sizes", "tiny", "--dtypes", "4bit", "--kernel-decode-from", given,
                           "--json-out", str(out)]) == 0
    assert seen == [sys.maxsize if in_force == "maxsize" else in_force]
    assert small_m_qmm.LARGE_MATRIX_VALUES == shipped
    assert json.loads(out.read_text())["kernel_decode_from"] == given


@pytest.mark.parametrize("given, decode", [(None, None), ("never", False), ("0", True)])
def test_kernel_decode_from_decides_the_kernels_decode_steps_for_every_model(monkeypatch, given, decode):
    """A weight count puts decode steps on the kernel even where small_m_qmm.decode_wanted
    would leave them on MLX (an 8-bit model); `never` keeps them off; no flag follows the rule."""
    asked = []

    def measure_config(size, dtype, **kwargs):
        asked.append(kwargs["kernel_decode"])
        raise SystemExit(0)  # what was asked is all this test needs

    monkeypatch.setattr(real_size, "measure_config", measure_config)
    flags = [] if given is None else ["--kernel-decode-from", given]
    with pytest.raises(SystemExit):
        real_size.main(["--sizes", "tiny", "--dtypes", "8bit", "--small-m-kernel", *flags])
    assert asked == [decode]


@pytest.mark.parametrize("family,quantize", [("qwen3", "none"), ("qwen3", "4bit"), ("qwen3_5", "none")])
def test_the_compiled_ar_arm_decodes_our_ar_loops_greedy_tokens(tiny_model_factory, family, quantize):
    """The bench's compiled AR step (fixed buffers, one traced graph; a hybrid's Gated
    DeltaNet states as inputs and outputs) must be the same computation as the served AR
    loop: its greedy tokens equal the loop's, on this CPU."""
    from mtplxd.engine.bench.compiled_ar import compiled_greedy_decode
    from mtplxd.engine.interface import GenerationRequest, SamplingParams
    from mtplxd.engine.loaded_model import load_model

    model = load_model(tiny_model_factory(family), quantize=quantize)
    ids = model.tokenizer.encode("def add(a, b):\n    return a")
    served = model.complete(GenerationRequest(
        ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), depth=0)).token_ids
    tokens, ms = compiled_greedy_decode(model.trunk, ids, 40)
    assert tokens == served
    assert ms > 0


def test_the_compiled_forward_computes_the_trunks_logits_and_rewrites_the_same_slots(tiny_model_factory):
    """The verify as the fused loop runs it (bench.verify.compiled_forward): the logits of T
    tokens after the prompt equal the op-by-op forward's, a second call at the same n gives
    them again (it wrote the slots the first wrote), and the cache it copied is untouched."""
    import mlx.core as mx

    from mtplxd.engine.bench.verify import compiled_forward, measure_compiled_forward_costs
    from mtplxd.engine.loaded_model import load_model

    model = load_model(tiny_model_factory("qwen3"), quantize="none")
    trunk, vocab = model.trunk, model.info.vocab_size
    ids = model.tokenizer.encode("def add(a, b):")
    cache = trunk.make_cache()
    trunk.prefill(ids, cache)
    block = mx.array([[5, 9, 13, 2]])
    step, buffers, n = compiled_forward(trunk, cache, 4)
    first, *buffers = step(block, n, *buffers)
    again, *buffers = step(block, n, *buffers)
    _, want = trunk.forward(block, cache, all_logits=True)
    assert mx.allclose(first, want, atol=1e-4).item() and mx.array_equal(first, again).item()
    for entry in cache:
        entry.trim(4)
    ms = measure_compiled_forward_costs(trunk, cache, vocab, (1, 4), steps=3)
    assert set(ms) == {"1", "4"} and all(v > 0 for v in ms.values())
    assert {entry.offset for entry in cache} == {len(ids)}
    hybrid = load_model(tiny_model_factory("qwen3_5"), quantize="none")
    assert measure_compiled_forward_costs(hybrid.trunk, hybrid.trunk.make_cache(), hybrid.info.vocab_size,
                                          (1,), steps=1) == {}


def test_pipelined_forwards_leave_the_cache_where_they_found_it(tiny_model_factory):
    """Back-to-back forwards trim the cache lazily after each: the context they run at stays
    the prompt's, and the next prefill-free call sees the same cache."""
    from mtplxd.engine.bench.verify import measure_pipelined_forward_costs
    from mtplxd.engine.loaded_model import load_model

    model = load_model(tiny_model_factory("qwen3"), quantize="none")
    cache = model.trunk.make_cache()
    ids = model.tokenizer.encode("def add(a, b):")
    model.trunk.prefill(ids, cache)
    ms = measure_pipelined_forward_costs(model.trunk, cache, model.info.vocab_size, (1, 4), steps=5)
    assert set(ms) == {"1", "4"} and all(v > 0 for v in ms.values())
    assert {entry.offset for entry in cache} == {len(ids)}


def test_prefill_figures_time_a_hybrids_gdn_layers_both_ways_and_leave_the_choice_as_it_was():
    """`--prefill-tokens`: a dense model's one figure; a hybrid's also with its GDN layers
    chunked and on the per-token loop (past the 32-token capture limit, where the paths part),
    the backend's own choice back in force afterwards."""
    from mtplxd.engine.model import gdn_chunked
    from mtplxd.engine.model.kv_cache import fixed_shapes_wanted
    from mtplxd.engine.model.trunk import Trunk

    for size, hybrid in (("tiny", False), ("tiny-hybrid", True)):
        model, spec = real_size.build_model(size, "bf16")
        figures = real_size.prefill_figures(Trunk(model, spec), 256, 40, hybrid)
        assert figures["tokens"] == 40 and figures["ms"] > 0 and figures["tokens_per_s"] > 0
        if hybrid:
            assert set(figures["gdn_paths_ms"]) == {"chunked", "per_token"}
            assert all(ms > 0 for ms in figures["gdn_paths_ms"].values())
            # The served figure is the backend's own path, not a third run.
            assert figures["ms"] == figures["gdn_paths_ms"]["chunked" if gdn_chunked.active() else "per_token"]
        else:
            assert "gdn_paths_ms" not in figures
    assert gdn_chunked.active() is fixed_shapes_wanted()  # the backend's choice again


def test_gdn_chunked_runs_a_hybrids_verifies_chunked_on_any_backend_for_that_run(tmp_path):
    """`--gdn-chunked` gives a CPU CUDA's GDN form (a hybrid's divergences reproduce here),
    and only for the run."""
    from mtplxd.engine.model import gdn_chunked

    out = tmp_path / "r.json"
    assert real_size.main(["--sizes", "tiny-hybrid", "--dtypes", "bf16", "--context", "16", "--decode-only",
                           "--decode-tokens", "2", "--repeats", "1", "--gdn-chunked",
                           "--json-out", str(out)]) == 0
    assert json.loads(out.read_text())["configs"][0]["gdn_verify"] == "chunked"
    assert gdn_chunked._forced is None and gdn_chunked.path_name() == "per-token"


def test_row_invariant_divergence_puts_every_row_count_on_the_tensor_cores(small_m_kernel_twin, tmp_path):
    """`--row-invariant`: the divergence run's kernel (here its plain-ops twin, the GPU being
    what this machine lacks) takes AR's 1-row steps and MTP's verify blocks alike, greedy MTP
    follows AR, and the report says how it was routed."""
    calls = small_m_kernel_twin
    out = tmp_path / "r.json"
    assert real_size.main(["--sizes", "tiny-hybrid", "--dtypes", "4bit", "--context", "16", "--depths", "",
                           "--cycle-temperatures", "0", "--decode-tokens", "4", "--repeats", "1",
                           "--divergence-tokens", "8", "--row-invariant", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    divergence = report["configs"][0]["greedy_divergence"]
    assert report["row_invariant"] and divergence["row_invariant"] and divergence["small_m_kernel"]
    assert divergence["identical"] and divergence["tokens_checked"] == 8
    assert {layout for _, layout in calls} == {"mma"}
    assert {1, 4} <= {rows for rows, _ in calls}


def test_the_compiled_twin_is_not_timed_where_our_ar_loop_is_compiled_already(tiny_model_factory):
    """A hybrid on CUDA decodes in the compiled AR loop (fused_ar), so `decode` is already the
    compiled step's figure: the bench's own compiled twin is skipped there (it cost GPU runs
    their seconds), and timed where our AR runs op by op."""
    from mtplxd.engine import load_model
    from mtplxd.engine.decoding import fused_ar

    trunk = load_model(tiny_model_factory("qwen3_5")).trunk
    prompt = list(range(3, 19))
    assert real_size.compiled_decode_ms(trunk, prompt, 4) > 0
    fused_ar.force(True)
    try:
        assert real_size.compiled_decode_ms(trunk, prompt, 4) is None
    finally:
        fused_ar.force(None)


def _tiny_hybrid_kernel_run(tmp_path, *extra: str) -> dict:
    """real_size on the tiny hybrid at 4-bit with the kernel's loops and `extra`: its entry."""
    out = tmp_path / "r.json"
    assert real_size.main(["--sizes", "tiny-hybrid", "--dtypes", "4bit", "--context", "16", "--depths", "3",
                           "--cycle-temperatures", "0", "--decode-tokens", "4", "--repeats", "1",
                           "--cycles", "2", "--small-m-kernel", "--small-m-loops", *extra,
                           "--json-out", str(out)]) == 0
    return json.loads(out.read_text())["configs"][0]


def test_row_invariant_beside_times_both_routings_in_one_process(small_m_kernel_twin, tmp_path):
    """`--row-invariant-beside`: the kernel's forwards, decode and cycles as served, then again
    row-invariant (1-row steps on the tensor cores too), both in the one report."""
    calls = small_m_kernel_twin
    entry = _tiny_hybrid_kernel_run(tmp_path, "--row-invariant-beside")
    for suffix in ("", "_row_invariant"):
        loops = entry["small_m_kernel" + suffix]
        assert entry["small_m_kernel_layers" + suffix] > 0
        assert loops["decode_ms"]["0.0"] > 0 and loops["cycles"]["0.0"]["cycle_ms_by_depth"]["3"] > 0
        assert set(entry["forward_ms_by_tokens_small_m_kernel" + suffix]) == {str(n) for n in range(1, 7)}
    # Each routing's cycles are over the fastest decode timed before them, its own included.
    ar_ms = min([entry["decode"]["0.0"]["ours_ms"]]
                + [entry["small_m_kernel" + suffix]["decode_ms"]["0.0"] for suffix in ("", "_row_invariant")])
    cycles = entry["small_m_kernel_row_invariant"]["cycles"]["0.0"]
    assert cycles["cycle_over_decode_by_depth"]["3"] == pytest.approx(cycles["cycle_ms_by_depth"]["3"] / ar_ms)
    layouts_of_one_row = {layout for rows, layout in calls if rows == 1}
    assert layouts_of_one_row == {"mma"}  # served: a hybrid's decode steps stay on MLX
    assert {layout for rows, layout in calls if rows > 1} > {"mma"}  # served: vector/word too


def test_attention_forms_time_decode_and_cycles_again_in_each_form_and_put_the_variable_back(
        small_m_kernel_twin, tmp_path, monkeypatch):
    """`--attention-forms`: two rounds of each form (the second in reverse order) in this
    process, each with its own traces; MTPLX_BUFFER_ATTENTION as it was after. (This CPU has
    no buffer kernel: every form names MLX's attention here.)"""
    from mtplxd.engine.decoding import buffer_attention

    monkeypatch.setenv(buffer_attention.KERNEL_ENV, "one-pass")
    entry = _tiny_hybrid_kernel_run(tmp_path, "--attention-forms", "two-pass,0")
    forms = entry["small_m_kernel"]["by_attention_form"]
    assert list(forms) == ["two-pass", "0"]
    for figures in forms.values():
        assert len(figures["decode_ms"]) == len(figures["compiled_ar_ms"]) == len(figures["cycle_ms"]) == 2
        assert all(ms > 0 for ms in figures["decode_ms"] + figures["cycle_ms"])
        # the compiled AR loop beside ours, or None where ours is that loop already
        assert all(ms is None or ms > 0 for ms in figures["compiled_ar_ms"])
        assert figures["path"] == buffer_attention.path_name()
    assert os.environ[buffer_attention.KERNEL_ENV] == "one-pass"


def test_decode_only_with_attention_forms_times_the_forms_and_nothing_else(small_m_kernel_twin, tmp_path):
    """`--decode-only --attention-forms`: the decode figures, with the kernel's, then the forms
    in one process (PART=attention-split: a lease's minutes go to the forms, not to forwards
    and stock cycles)."""
    entry = _tiny_hybrid_kernel_run(tmp_path, "--decode-only", "--attention-forms", "auto,one-pass")
    assert "forward_ms_by_tokens" not in entry and "cycles" not in entry
    forms = entry["small_m_kernel"]["by_attention_form"]
    assert list(forms) == ["auto", "one-pass"]
    assert all(len(figures["cycle_ms"]) == 2 and min(figures["cycle_ms"]) > 0 for figures in forms.values())


def test_decode_only_with_attention_forms_and_no_kernel_reports_them_at_the_top(tmp_path):
    """(With `auto+pool` too: the default form with the loops' scalars left in MLX's pool, the
    layout put back after.)"""
    out = tmp_path / "r.json"
    assert real_size.main(["--sizes", "tiny", "--dtypes", "bf16", "--context", "16", "--decode-tokens", "4",
                           "--cycles", "2", "--decode-only", "--attention-forms", "0,auto+pool",
                           "--json-out", str(out)]) == 0
    entry = json.loads(out.read_text())["configs"][0]
    assert entry["by_attention_form"]["0"]["decode_ms"][0] > 0 and "small_m_kernel" not in entry
    assert min(entry["by_attention_form"]["auto+pool"]["cycle_ms"]) > 0
    from mtplxd.engine.decoding import buffer_attention
    assert buffer_attention.SCALAR_VECTOR_ELEMENTS == 4


def test_an_unknown_attention_form_is_refused(capsys):
    with pytest.raises(SystemExit):
        real_size.main(["--sizes", "tiny", "--attention-forms", "one-pass,fast"])
    assert ("--attention-forms: choose from 0, auto, one-pass, split, two-pass, mma (each may go on with "
            "+pool, +in_place, +bias_once, +hoist, +mma_decode, +persistent)") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        real_size.main(["--sizes", "tiny", "--attention-forms", "auto+in_place+unrolled"])


def test_attention_forms_turn_the_small_m_kernels_forms_on_by_name_and_back_after(
        small_m_kernel_twin, tmp_path, monkeypatch):
    """`auto+in_place+hoist+mma_decode+persistent`: whole steps with the kernel's forms named on (the
    others off), traced afresh; the shipped settings back after."""
    from mtplxd.engine.model import small_m_qmm

    flags = ("VECTOR_IN_PLACE", "VECTOR_BIAS_ONCE", "MMA_HOIST", "DECODE_MMA_VALUES", "VECTOR_PERSISTENT_BLOCKS")
    shipped = {flag: getattr(small_m_qmm, flag) for flag in flags}
    seen = set()
    twin = small_m_qmm.small_m_matmul

    def recording_twin(*args, **kwargs):
        seen.add(tuple(getattr(small_m_qmm, flag) for flag in flags))
        return twin(*args, **kwargs)

    monkeypatch.setattr(small_m_qmm, "small_m_matmul", recording_twin)
    entry = _tiny_hybrid_kernel_run(tmp_path, "--decode-only", "--attention-forms",
                                    "auto,auto+in_place+hoist+mma_decode+persistent")
    forms = entry["small_m_kernel"]["by_attention_form"]
    assert all(min(forms[form]["cycle_ms"]) > 0 for form in ("auto", "auto+in_place+hoist+mma_decode+persistent"))
    assert {(False, False, False, None, None), (True, False, True, 64 * 2**20, 264)} <= seen
    assert {flag: getattr(small_m_qmm, flag) for flag in flags} == shipped


def test_stacked_times_the_kernel_again_with_shared_input_projections_as_one_product(
        small_m_kernel_twin, tmp_path):
    """`--stacked`: last, every MLP's gate and up (the trunk's and the head's), every GDN
    layer's four inputs and every attention layer's q, k and v stacked, and the kernel's
    forwards, decode and cycles timed again, beside the separate products' in one report."""
    calls = small_m_kernel_twin
    entry = _tiny_hybrid_kernel_run(tmp_path, "--stacked")
    args = real_size.SIZES["tiny-hybrid"][1]
    layers, gdn_layers = args["num_hidden_layers"], args["num_hidden_layers"] // args["full_attention_interval"]
    gdn_layers = layers - gdn_layers  # every full_attention_interval-th layer is attention
    attention_layers = layers - gdn_layers + 1  # the head's one layer too
    assert entry["stacked_groups"] == layers + 1 + gdn_layers + attention_layers
    for suffix in ("", "_stacked"):
        loops = entry["small_m_kernel" + suffix]
        assert loops["decode_ms"]["0.0"] > 0 and loops["cycles"]["0.0"]["cycle_ms_by_depth"]["3"] > 0
    # An MLP's two layers are one kernel layer now, a GDN layer's four and attention's three too.
    assert entry["small_m_kernel_layers_stacked"] == (entry["small_m_kernel_layers"] - (layers + 1) - 3 * gdn_layers
                                                      - 2 * attention_layers)
    assert calls


def test_kv_write_beside_times_the_kernel_again_with_slice_update_writes_and_puts_the_scatter_back(
        small_m_kernel_twin, monkeypatch, tmp_path):
    """`--kv-write-beside`: the kernel's forwards, decode and cycles again with the fused loops'
    caches written by slice_update (the fallback write), beside the served scatter's figures;
    the scatter serves again afterwards."""
    from mtplxd.engine.decoding import fused

    fallback, writes = fused._write_at, []

    def recording(*args):
        writes.append(fused._SCATTER_WORKS)
        return fallback(*args)

    monkeypatch.setattr(fused, "_write_at", recording)
    entry = _tiny_hybrid_kernel_run(tmp_path, "--kv-write-beside")
    for suffix in ("", "_slice_update"):
        loops = entry["small_m_kernel" + suffix]
        assert loops["decode_ms"]["0.0"] > 0 and loops["cycles"]["0.0"]["cycle_ms_by_depth"]["3"] > 0
    assert writes and not any(writes)  # slice_update only while the scatter was switched off
    assert fused._scatter_works()


def test_mma_configs_time_the_kernel_again_at_each_shape_and_put_the_shipped_one_back(
        small_m_kernel_twin, monkeypatch, tmp_path):
    """`--mma-configs 4x2,8x4s2`: the kernel's figures again with the mma layout at 4 warps and
    2 groups a load, then pipelined through 2 stages (what each product saw, here through the
    twin), then the shipped shape back."""
    from mtplxd.engine.model import small_m_qmm

    shipped = small_m_qmm.MMA_WARPS, dict(small_m_qmm.MMA_GROUPS_PER_LOAD), small_m_qmm.MMA_STAGES
    twin, seen = small_m_qmm.small_m_matmul, set()

    def recording(*args, **kwargs):
        seen.add((small_m_qmm.MMA_WARPS, small_m_qmm.MMA_GROUPS_PER_LOAD[4], small_m_qmm.MMA_STAGES))
        return twin(*args, **kwargs)

    monkeypatch.setattr(small_m_qmm, "small_m_matmul", recording)
    out = tmp_path / "r.json"
    assert real_size.main(["--sizes", "tiny-hybrid", "--dtypes", "4bit", "--context", "16", "--depths", "3",
                           "--cycle-temperatures", "0", "--decode-tokens", "4", "--repeats", "1",
                           "--cycles", "2", "--small-m-kernel", "--small-m-loops", "--row-invariant",
                           "--mma-configs", "4x2,8x4s2", "--json-out", str(out)]) == 0
    entry = json.loads(out.read_text())["configs"][0]
    for name in ("4x2", "8x4s2"):
        again = entry["small_m_kernel_by_mma_config"][name]
        assert again["small_m_kernel"]["cycles"]["0.0"]["cycle_ms_by_depth"]["3"] > 0
    assert seen == {(shipped[0], shipped[1][4], shipped[2]), (4, 2, 0), (8, 4, 2)}
    assert (small_m_qmm.MMA_WARPS, small_m_qmm.MMA_GROUPS_PER_LOAD, small_m_qmm.MMA_STAGES) == shipped


def test_a_size_is_the_same_random_model_in_every_build():
    """build_model seeds MLX's generator, so runs in different processes (a divergence count
    here, a timing there) measure one model; another seed is another model."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    def weights(seed):
        return tree_flatten(real_size.build_model("tiny-hybrid", "4bit", seed=seed)[0].parameters())

    first, again, other = weights(0), weights(0), weights(1)
    assert [k for k, _ in first] == [k for k, _ in again]
    assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(first, again))
    assert not all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(first, other))


def test_qk_norm_rope_runs_every_figure_with_the_one_kernel_forward(qk_norm_rope_twin, tmp_path):
    """`--qk-norm-rope`: every attention layer swapped (the head's too), its decode, cycles
    and greedy divergence through the one-kernel forward (here its plain-ops twin), and greedy
    MTP still follows AR."""
    out = tmp_path / "real.json"
    assert real_size.main(["--sizes", "tiny", "--dtypes", "bf16", "--context", "16", "--depths", "2",
                           "--decode-tokens", "3", "--cycles", "2", "--repeats", "1",
                           "--divergence-tokens", "8", "--qk-norm-rope", "--json-out", str(out)]) == 0
    config = json.loads(out.read_text())["configs"][0]
    assert config["qk_norm_rope_layers"] == real_size.SIZES["tiny"][1]["num_hidden_layers"] + 1
    assert config["greedy_divergence"]["first_divergence"] is None
    assert (1, 1) in qk_norm_rope_twin and (1, 3) in qk_norm_rope_twin  # decode steps and depth-2 verifies


def test_the_kernels_forwards_stand_over_the_faster_decode_once_it_is_timed(small_m_kernel_twin, tmp_path):
    """With `--small-m-loops` the kernel's forwards are set over the faster greedy decode step
    (its own or stock's: what AR runs, as the cycles' figures are), not over stock's alone."""
    out = tmp_path / "dense.json"
    assert real_size.main(["--sizes", "tiny", "--dtypes", "4bit", "--context", "16", "--depths", "1",
                           "--cycle-temperatures", "0", "--decode-tokens", "4", "--repeats", "1",
                           "--cycles", "2", "--small-m-kernel", "--small-m-loops", "--json-out", str(out)]) == 0
    entry = json.loads(out.read_text())["configs"][0]
    faster = min(entry["decode"]["0.0"]["ours_ms"], entry["small_m_kernel"]["decode_ms"]["0.0"])
    for form in ("forward_pipelined", "forward_compiled"):
        ms = entry[f"{form}_ms_by_tokens_small_m_kernel"]
        assert set(ms) == {str(n) for n in range(1, 7)}
        assert entry[f"{form}_over_decode_small_m_kernel"] == pytest.approx({k: v / faster for k, v in ms.items()})
