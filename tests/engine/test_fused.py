"""The fused decode loop (mtplxd/engine/decoding/fused.py) against the stepwise one, on the CPU backend.

The exactness gates themselves (greedy MTP == AR, the sampled distribution, the committed
caches) run for both loops in test_speculative_greedy.py, test_exact_sampling.py and
test_speculative_state.py; these tests cover what only the fused loop has.
"""

import mlx.core as mx
import pytest

import mtplxd.engine.decoding.fused as fused
from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.decoding.fused import StaticKVCache
from mtplxd.engine.decoding.sampling import device_position_keys, seed_words
from support.numerics import ROWS_ALONE, run_on_reference_blas, same


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return load_model(tiny_model_factory("qwen3"), decode_loop="fused")


def run(model, loop, depth, max_tokens=40, **sampling):
    model.trunk.decode_loop = loop
    try:
        request = GenerationRequest(model.tokenizer.encode("def add(a, b):\n    ret"),
                                    SamplingParams(max_tokens=max_tokens, **sampling), depth=depth)
        return model.complete(request)
    finally:
        model.trunk.decode_loop = "fused"


def test_the_fused_loop_really_runs_compiled_graphs(model):
    model.trunk.compiled_graphs.clear()
    result = run(model, "fused", 3)
    assert result.stats.cycles > 0 and result.stats.mean_accepted_length > 1.0
    # The cycle, and its two halves for the one timed cycle per sample window (split.py).
    assert [key[:2] for _, key in model.trunk.compiled_graphs] == [
        ("mtp", 3), ("mtp-draft", 3), ("mtp-verify", 3)]
    run(model, "fused", 0)  # AR keeps autoregressive.py's loop: nothing compiled
    assert len(model.trunk.compiled_graphs) == 3


def test_graphs_are_compiled_per_sampling_setting(model):
    """A graph bakes its sampling settings in: another temperature must not reuse it."""
    model.trunk.compiled_graphs.clear()
    run(model, "fused", 2, temperature=0.5, seed=1)
    run(model, "fused", 2, temperature=0.9, seed=1)
    run(model, "fused", 2, temperature=0.9, seed=2, max_tokens=7)  # seed and length: same graph
    assert len(model.trunk.compiled_graphs) == 2 * 3  # each: the cycle and its timed halves


def test_cache_growth_keeps_greedy_mtp_equal_to_ar(model, monkeypatch):
    """Buffers grow CAPACITY_STEP slots at a time (a retrace each); crossing several
    boundaries mid-request changes nothing in the output."""
    monkeypatch.setattr(fused, "CAPACITY_STEP", 16)
    reference = run(model, "stepwise", 0, max_tokens=90, ignore_eos=True)
    for depth in (1, 4):
        assert run(model, "fused", depth, max_tokens=90, ignore_eos=True).token_ids == reference.token_ids


def test_buffers_grow_a_step_ahead_but_never_past_what_the_request_was_priced_for(
        model, monkeypatch):
    """The memory guard prices a request at prompt + max_tokens: growing a whole step ahead
    near the end would hold slots nobody priced (fused.reach_for bounds it)."""
    monkeypatch.setattr(fused, "CAPACITY_STEP", 16)
    grown = []
    real_grow = fused._grow
    monkeypatch.setattr(fused, "_grow", lambda state, capacity: (grown.append(capacity),
                                                                 real_grow(state, capacity)))
    reference = run(model, "stepwise", 0, max_tokens=40, ignore_eos=True)
    prompt = len(model.tokenizer.encode("def add(a, b):\n    ret"))
    for depth in (1, 4):
        grown.clear()
        assert run(model, "fused", depth, max_tokens=40, ignore_eos=True).token_ids == reference.token_ids
        assert grown  # it crossed steps
        assert max(grown) <= fused.reach_for(prompt + 40, depth)
        # A step ahead is still taken while the request is far from its end.
        assert grown[0] - fused.capacity_for(prompt + 2 * (depth + 1) + 1) >= 16


def test_static_cache_attention_equals_the_plain_cache(model):
    """A masked forward over the fixed buffer gives the logits of mlx-lm's exact-length cache."""
    trunk = model.trunk
    tokens = model.tokenizer.encode("import os\nprint(os.getcwd())")
    cache = trunk.make_cache()
    _, expected = trunk.forward(mx.array(tokens)[None], cache, all_logits=True)
    plain = trunk.make_cache()
    trunk.forward(mx.array(tokens[:5])[None], plain, all_logits=False)
    buffers = fused.to_buffers(plain, 64)
    static = [StaticKVCache(buffers[i], buffers[i + 1], mx.array(5, mx.int32))
              for i in range(0, len(buffers), 2)]
    logits = trunk.lm_head(trunk.text.model(mx.array(tokens[5:])[None], static))
    assert same(logits[0], expected[0, 5:])


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("offset", [0, 9, 16 - 4])
def test_static_cache_writes_rows_at_the_offset_by_scatter_and_by_the_fallback(monkeypatch, rows, offset):
    """The scatter write (put_along_axis, served) and the slice_update fallback leave the same
    buffer: the rows at offset.., every other slot untouched; in a compiled graph too (the
    fused loops trace it), up to the buffer's last slot."""
    buffers = mx.random.normal((1, 2, 16, 8), key=mx.random.key(1)).astype(mx.bfloat16)
    new = mx.random.normal((1, 2, rows, 8), key=mx.random.key(2)).astype(mx.bfloat16)

    def write(keys, values, at):
        return StaticKVCache(keys, values, at).update_and_fetch(new, -new)

    written = {}
    for works in (True, False):
        monkeypatch.setattr(fused, "_SCATTER_WORKS", works)
        eager = write(buffers, buffers, mx.array(offset, mx.int32))
        compiled = mx.compile(write)(buffers, buffers, mx.array(offset, mx.int32))
        assert all(mx.array_equal(a, b) for a, b in zip(eager, compiled))
        written[works] = eager
    assert all(mx.array_equal(a, b) for a, b in zip(written[True], written[False]))
    keys, values = written[True]
    assert mx.array_equal(keys[:, :, offset:offset + rows], new)
    assert mx.array_equal(values[:, :, offset:offset + rows], -new)
    untouched = [s for s in range(16) if not offset <= s < offset + rows]
    assert mx.array_equal(keys[:, :, untouched], buffers[:, :, untouched])


def test_a_forwards_static_caches_build_one_write_index():
    """The layers of a forward share one offset array, so their scatter index is built once
    (two launches a layer fewer on CUDA), and again only when a cache's offset is another
    array (the head's, a cycle moving it); each layer's rows still land at the offset."""
    buffers = [mx.zeros((1, 2, 16, 8), mx.bfloat16) for _ in range(6)]
    caches = fused.static_caches(buffers, mx.array(3, mx.int32))
    rows = [mx.full((1, 2, 2, 8), layer + 1, mx.bfloat16) for layer in range(3)]
    for cache, new in zip(caches, rows):
        cache.update_and_fetch(new, -new)
    assert caches[0].shared["index"] is caches[2].shared["index"]
    for cache, new in zip(caches, rows):
        assert mx.array_equal(cache.keys[:, :, 3:5], new)
        assert mx.array_equal(cache.values[:, :, 3:5], -new)
        assert not mx.any(cache.keys[:, :, 5:]).item() and not mx.any(cache.keys[:, :, :3]).item()
    first = caches[0].shared["index"]
    caches[1].offset = mx.array(9, mx.int32)
    caches[1].update_and_fetch(rows[1], rows[1])
    assert caches[1].shared["index"] is not first
    assert mx.array_equal(caches[1].keys[:, :, 9:11], rows[1])


def test_device_keys_differ_by_seed_position_and_purpose():
    keys = [device_position_keys(seed_words(seed), mx.array([pos]), purpose)[0].tolist()
            for seed in (0, 1, 2**40) for pos in (0, 1, 77) for purpose in (1, 2, 3)]
    assert len({tuple(k) for k in keys}) == len(keys)
    again = device_position_keys(seed_words(1), mx.array([77]), 2)[0].tolist()
    assert again == device_position_keys(seed_words(1), mx.array([77]), 2)[0].tolist()


def test_an_unknown_decode_loop_is_refused(tiny_model_factory):
    from mtplxd.engine import ModelLoadError

    with pytest.raises(ModelLoadError, match="decode_loop"):
        load_model(tiny_model_factory("qwen3"), decode_loop="warp")


def test_model_info_names_the_loop_mtp_requests_run(tiny_model_factory):
    assert load_model(tiny_model_factory("qwen3"), decode_loop="fused").info.decode_loop == "fused"
    assert load_model(tiny_model_factory("qwen3"), decode_loop="stepwise").info.decode_loop == "stepwise"
    hybrid = load_model(tiny_model_factory("qwen3_5"), decode_loop="fused")
    assert hybrid.info.decode_loop == "fused"  # its GDN state rolls back on the device too
    hybrid = load_model(tiny_model_factory("qwen3_5"), decode_loop="stepwise")
    assert hybrid.info.decode_loop == "stepwise"


def test_auto_picks_the_fused_loop_on_cuda_and_cpu_and_stepwise_on_metal(tiny_model_factory, monkeypatch):
    assert load_model(tiny_model_factory("qwen3")).info.decode_loop == "fused"  # this backend
    monkeypatch.setattr("mtplxd.engine.model.trunk.mx.default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr("mtplxd.engine.model.trunk.fixed_shapes_wanted", lambda: False)
    assert load_model(tiny_model_factory("qwen3")).info.decode_loop == "stepwise"  # "Metal"
    monkeypatch.setattr("mtplxd.engine.model.trunk.fixed_shapes_wanted", lambda: True)
    assert load_model(tiny_model_factory("qwen3")).info.decode_loop == "fused"  # "CUDA"


def test_fused_decoding_holds_one_copy_of_the_cache(tiny_model_factory):
    """Each cycle takes its input buffers over (no other reference is kept), so MLX writes
    the cache in place: decode memory is the stepwise loop's, not one more cache copy."""
    path = tiny_model_factory("qwen3", num_key_value_heads=4, head_dim=64, num_attention_heads=4)
    prompt = [(7 * i) % 200 + 3 for i in range(3000)]
    peaks = {}
    for loop in ("stepwise", "fused"):
        model = load_model(path, decode_loop=loop)
        request = GenerationRequest(prompt, SamplingParams(max_tokens=40, ignore_eos=True), depth=2)
        stream = model.generate(request)
        for _ in range(4):  # past the prefill and the first cycles' head pass over the prompt
            next(stream)
        mx.clear_cache()
        mx.reset_peak_memory()
        start = mx.get_active_memory()
        for _ in stream:
            pass
        peaks[loop] = mx.get_peak_memory() - start
    config = model.trunk.text.args
    one_copy = config.num_hidden_layers * 2 * 4 * 64 * 4 * 3072  # K+V, fp32, 3072 slots
    assert peaks["fused"] < peaks["stepwise"] + one_copy // 2, (peaks, one_copy)


@pytest.mark.skipif(ROWS_ALONE, reason="this run is the bitwise one already")
def test_static_cache_attention_is_bitwise_under_the_reference_blas():
    """The comparison above, in a child whose MLX computes each matmul row alone."""
    run_on_reference_blas(f"{__file__}::test_static_cache_attention_equals_the_plain_cache",
                          expect_passed=1)
