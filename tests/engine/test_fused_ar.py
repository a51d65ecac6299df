"""The compiled AR loop (decoding/fused_ar.py) on the CPU backend: its tokens are the op-by-op
loop's (greedy, seeded sampling, penalties; hybrid and dense), its buffers grow, the caches
and history it hands back hold exactly what was committed, and a served request takes it
where fused_ar_wanted says so, the session bank included."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.decoding import fused_ar
from mtplxd.engine.decoding.autoregressive import ar_cycles
from mtplxd.engine.decoding.fused import CAPACITY_STEP
from mtplxd.engine.decoding.fused_ar import fused_ar_cycles, fused_ar_wanted
from mtplxd.engine.decoding.sampling import TokenHistory, pick_first
from mtplxd.engine.model.rollback import RollbackArraysCache
from mtplxd.engine.session.bank import BankSettings
from support.cycles import assert_cache_holds

PROMPT = "def add(a, b):\n    return"
PARAMS = {
    "greedy": SamplingParams(max_tokens=64, temperature=0.0),
    "top-p": SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, seed=3),
    "penalties": SamplingParams(max_tokens=64, temperature=0.7, repetition_penalty=1.3,
                                frequency_penalty=0.2, presence_penalty=0.1, seed=5),
}


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "qwen3"])
def model(request, tiny_model_factory):
    return load_model(tiny_model_factory(request.param))


@pytest.fixture(autouse=True)
def _unforced():
    yield
    fused_ar.force(None)


def decode(model, loop, prompt, params, tokens, seed=7):
    """(tokens: the first and `tokens` more, the cache and history after the loop closes)."""
    cache = model.trunk.make_cache()
    _, logits = model.trunk.prefill(prompt, cache)
    history = TokenHistory(logits.shape[-1], prompt)
    first = pick_first(logits, params, history, seed, len(prompt))
    cycles = loop(model.trunk, cache, params, history, seed, first, len(prompt))
    out = [first] + [token for _ in range(tokens) for token in next(cycles)]
    cycles.close()
    return out, cache, history


@pytest.mark.parametrize("setting", list(PARAMS))
def test_its_tokens_are_the_op_by_op_loops(model, setting):
    prompt = model.tokenizer.encode(PROMPT)
    want, _, _ = decode(model, ar_cycles, prompt, PARAMS[setting], 40)
    got, _, _ = decode(model, fused_ar_cycles, prompt, PARAMS[setting], 40)
    assert got == want


def test_the_buffers_grow_past_their_first_capacity(model):
    """A prompt just under one buffer step: decoding crosses it (a grown buffer, a retrace)."""
    prompt = (model.tokenizer.encode(PROMPT * 40))[:CAPACITY_STEP - 8]
    params = SamplingParams(max_tokens=CAPACITY_STEP, temperature=0.0)
    want, _, _ = decode(model, ar_cycles, prompt, params, 30)
    got, _, _ = decode(model, fused_ar_cycles, prompt, params, 30)
    assert got == want


def test_the_handed_back_cache_and_history_hold_the_committed_tokens(model):
    """Attention KV and GDN state over every committed token but the last read (not fed),
    as a fresh forward over them leaves them; the penalty counts of every token read."""
    prompt = model.tokenizer.encode(PROMPT)
    params = PARAMS["penalties"]
    committed, cache, history = decode(model, fused_ar_cycles, prompt, params, 9)
    assert_cache_holds(model, cache, (prompt + committed)[:len(prompt) + len(committed) - 1])
    expected = TokenHistory(history.counts.shape[0], prompt)
    expected.append(committed)
    assert mx.array_equal(history.counts, expected.counts) and mx.array_equal(history.seen, expected.seen)


def test_the_op_by_op_loop_goes_on_from_the_handed_back_state(model):
    """Decode 12 tokens, close, feed the last read token to the op-by-op loop over the
    handed-back cache: the tokens are those of one uninterrupted run."""
    prompt = model.tokenizer.encode(PROMPT)
    params = PARAMS["greedy"]
    whole, _, _ = decode(model, ar_cycles, prompt, params, 30)
    first_part, cache, history = decode(model, fused_ar_cycles, prompt, params, 12)
    position = len(prompt) + len(first_part) - 1
    rest = ar_cycles(model.trunk, cache, params, history, 7, first_part[-1], position)
    assert first_part + [next(rest)[0] for _ in range(30 - 12)] == whole


def test_where_it_is_wanted(model, monkeypatch):
    cache = model.trunk.make_cache()
    hybrid = any(isinstance(e, RollbackArraysCache) for e in cache)
    assert not fused_ar_wanted(model.trunk, cache)  # the CPU backend keeps the op-by-op loop
    monkeypatch.setenv("MTPLX_FUSED_AR", "1")
    assert fused_ar_wanted(model.trunk, cache)  # any model the loop takes, asked for
    monkeypatch.setenv("MTPLX_FUSED_AR", "0")
    assert not fused_ar_wanted(model.trunk, cache)
    monkeypatch.delenv("MTPLX_FUSED_AR")
    # On CUDA (fixed shapes): hybrids (and dense models whose decode steps take the small-M
    # kernel: the next test), and only where the fused loops run.
    monkeypatch.setattr("mtplxd.engine.model.kv_cache.fixed_shapes_wanted", lambda: True)
    assert fused_ar_wanted(model.trunk, cache) == hybrid
    assert fused_ar_wanted(model.trunk, cache, 100_000) == hybrid  # a hybrid's at any prompt
    model.trunk.decode_loop, loop = "stepwise", model.trunk.decode_loop
    try:
        assert not fused_ar_wanted(model.trunk, cache)
    finally:
        model.trunk.decode_loop = loop


def test_a_dense_model_whose_decode_steps_take_the_kernel_decodes_in_it_on_cuda(tiny_model_factory, monkeypatch):
    """On CUDA a dense model takes the compiled loop where the small-M kernel serves its decode
    steps (4-bit), for prompts of up to DENSE_PROMPT_TOKENS; not where its decode steps stay on
    MLX's matvec (8-bit: the kernel on verify rows only). The kernel itself is CUDA only: here
    `usable` is faked, the routing is real."""
    from mtplxd.engine.model import small_m_qmm

    monkeypatch.setattr(small_m_qmm, "_usable", True)
    monkeypatch.setattr(small_m_qmm, "_mma_usable", None)  # install probes it; put back after
    monkeypatch.setattr("mtplxd.engine.model.kv_cache.fixed_shapes_wanted", lambda: True)
    wanted = {}
    for bits in ("4bit", "8bit"):
        model = load_model(tiny_model_factory("qwen3"), quantize=bits)
        assert not fused_ar_wanted(model.trunk, model.trunk.make_cache())  # MLX's matmuls
        assert small_m_qmm.install(model.model, force=True) > 0
        cache = model.trunk.make_cache()
        wanted[bits] = fused_ar_wanted(model.trunk, cache, fused_ar.DENSE_PROMPT_TOKENS)
        assert wanted[bits] == small_m_qmm.decode_routed(model.model)
        assert not fused_ar_wanted(model.trunk, cache, fused_ar.DENSE_PROMPT_TOKENS + 1)  # a long prompt
        assert fused_ar.path_name(model.trunk) == (
            f"compiled for prompts up to {fused_ar.DENSE_PROMPT_TOKENS:,} tokens, op by op beyond"
            if wanted[bits] else "op by op")
    assert wanted == {"4bit": True, "8bit": False}
    # Routed row-invariantly (a 27B/32B-class 8-bit model's default, MTPLX_ROW_INVARIANT=1),
    # the 8-bit model's decode steps take the kernel's mma layout where the GPU has it: a step
    # of custom kernels, so it decodes compiled, whatever the prompt's length (op by op such a
    # step binds the host); without the layout its products stay MLX's, and so does its loop.
    small_m_qmm.uninstall(model.model)
    assert small_m_qmm.install(model.model, force=True, row_invariant=True) > 0
    assert not small_m_qmm.decode_routed(model.model)
    cache = model.trunk.make_cache()
    monkeypatch.setattr(small_m_qmm, "_mma_usable", False)  # here the probe found no mma layout
    assert not fused_ar_wanted(model.trunk, cache, fused_ar.DENSE_PROMPT_TOKENS)
    monkeypatch.setattr(small_m_qmm, "_mma_usable", True)
    assert fused_ar_wanted(model.trunk, cache, fused_ar.DENSE_PROMPT_TOKENS)
    assert fused_ar_wanted(model.trunk, cache, fused_ar.DENSE_PROMPT_TOKENS + 1)  # a long prompt too
    assert fused_ar.path_name(model.trunk) == "compiled"


def complete(model, max_tokens=40, **sampling):
    request = GenerationRequest(model.tokenizer.encode(PROMPT),
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling), depth=0)
    return model.complete(request)


def test_a_served_ar_request_takes_it_when_wanted(model):
    want = complete(model, temperature=0.8, seed=11)
    one = complete(model, max_tokens=1)
    fused_ar.force(True)
    model.trunk.compiled_graphs.clear()
    assert complete(model, temperature=0.8, seed=11).token_ids == want.token_ids
    assert ("ar",) == [key[:1] for _, key in model.trunk.compiled_graphs][0]
    assert complete(model, max_tokens=1).token_ids == one.token_ids


def test_a_second_turn_restores_what_it_stored(model):
    """Turn 1 decodes in the compiled loop and the bank stores its caches; turn 2 extends
    the transcript, restores them and decodes as a cold run over the same prompt would."""
    fused_ar.force(True)
    model.enable_session_bank(BankSettings())
    try:
        prompt = model.tokenizer.encode(PROMPT)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        turn1 = model.complete(GenerationRequest(prompt, params, depth=0))
        follow = prompt + turn1.token_ids + model.tokenizer.encode("\nprint(add(1, 2))")
        warm = model.complete(GenerationRequest(follow, params, depth=0))
        assert warm.stats.cached_tokens > len(prompt)
    finally:
        model.bank = None
    cold = model.complete(GenerationRequest(follow, params, depth=0))
    assert warm.token_ids == cold.token_ids


def test_it_holds_one_copy_of_the_cache(tiny_model_factory):
    """Each step takes its input buffers over (the loop keeps no other reference), so MLX
    writes the new row in place: decode memory is the op-by-op loop's, not one more copy of
    the cache a token."""
    path = tiny_model_factory("qwen3", num_key_value_heads=4, head_dim=64, num_attention_heads=4)
    model = load_model(path)
    prompt = [(7 * i) % 200 + 3 for i in range(3000)]
    peaks = {}
    for name, loop in (("op by op", ar_cycles), ("compiled", fused_ar_cycles)):
        cache = model.trunk.make_cache()
        _, logits = model.trunk.prefill(prompt, cache)
        history = TokenHistory(logits.shape[-1], prompt)
        cycles = loop(model.trunk, cache, PARAMS["greedy"], history, 0, 5, len(prompt))
        for _ in range(3):  # past the buffers' first copy and the trace
            next(cycles)
        mx.clear_cache()
        mx.reset_peak_memory()
        start = mx.get_active_memory()
        for _ in range(30):
            next(cycles)
        peaks[name] = mx.get_peak_memory() - start
        cycles.close()
        del cache, cycles
    config = model.trunk.text.args
    one_copy = config.num_hidden_layers * 2 * 4 * 64 * 4 * 3072  # K+V, fp32, 3072 slots
    assert peaks["compiled"] < peaks["op by op"] + one_copy // 2, (peaks, one_copy)
