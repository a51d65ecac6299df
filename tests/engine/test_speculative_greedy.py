"""Exactness gate (a): greedy MTP output equals greedy AR output token for token (CPU)."""

import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model

PROMPTS = {
    "chat": None,  # filled from the chat template
    "mid_word": "def add(a, b):\n    ret",
    "mid_word_unicode": "le café est tr",
    "one_token": "x",
    "code": "import json\nwith open(path) as f:\n    data = json.lo",
}


def prompt_ids(model, name):
    tok = model.tokenizer
    if name == "chat":
        return tok.apply_chat_template([{"role": "user", "content": "write a function"}],
                                       add_generation_prompt=True)
    return tok.encode(PROMPTS[name])


def greedy(model, ids, depth, max_tokens, **sampling):
    request = GenerationRequest(ids, SamplingParams(max_tokens=max_tokens, **sampling), depth=depth)
    return model.complete(request)


@pytest.fixture(scope="module", params=["stepwise", "fused"])
def models(tiny_model_factory, request):
    """Dense qwen3 variants: predictable (many accepts), plain random trunk, 4-bit, 8-bit;
    once per decode loop (AR and MTP both run the loop under test)."""
    def load(path):
        return load_model(path, decode_loop=request.param)

    return {
        "qwen3": load(tiny_model_factory("qwen3")),
        "qwen3_plain": load(tiny_model_factory("qwen3", embed_scale=1.0, seed=1)),
        "qwen3_q4": load(tiny_model_factory("qwen3", quantize_bits=4)),
        "qwen3_q8": load(tiny_model_factory("qwen3", quantize_bits=8, seed=2)),
    }


CASES = [("qwen3", p) for p in PROMPTS] + [("qwen3_plain", p) for p in ("chat", "mid_word")] + [
    (q, p) for q in ("qwen3_q4", "qwen3_q8") for p in ("mid_word_unicode", "code")]


@pytest.mark.parametrize(("variant", "prompt"), CASES)
def test_greedy_mtp_equals_ar_for_dense_qwen3_depths_1_to_5(models, variant, prompt):
    model = models[variant]
    ids = prompt_ids(model, prompt)
    reference = greedy(model, ids, 0, 32)
    for depth in (1, 2, 3, 4, 5):
        result = greedy(model, ids, depth, 32)
        assert result.token_ids == reference.token_ids, f"depth {depth} diverged"
        assert result.text == reference.text and result.finish_reason == reference.finish_reason
        assert result.stats.depth == depth


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_greedy_mtp_equals_ar_at_short_lengths(models, max_tokens):
    model = models["qwen3"]
    ids = prompt_ids(model, "mid_word")
    reference = greedy(model, ids, 0, max_tokens)
    for depth in (1, 3, 4):
        result = greedy(model, ids, depth, max_tokens)
        assert result.token_ids == reference.token_ids
        assert len(result.token_ids) <= max_tokens


def test_greedy_mtp_exercises_full_accepts_and_rejections(models):
    model = models["qwen3"]
    result = greedy(model, prompt_ids(model, "chat"), 3, 64, stop_token_ids=[])
    stats = result.stats
    assert stats.accepted_by_depth[0] > 0, "the tiny head never got a draft accepted"
    assert stats.accepted_by_depth[2] > 0, "no cycle accepted every draft (bonus path untested)"
    assert stats.accepted < stats.drafted, "no draft was rejected (rollback path untested)"
    assert stats.drafted_by_depth == [stats.cycles] * 3
    assert stats.mean_accepted_length > 1.0


def test_greedy_mtp_with_penalties_equals_ar_with_penalties(models):
    model = models["qwen3"]
    ids = prompt_ids(model, "code")
    for penalties in (dict(frequency_penalty=0.7), dict(presence_penalty=1.5, repetition_penalty=1.2)):
        reference = greedy(model, ids, 0, 40, **penalties)
        for depth in (1, 2, 4):
            assert greedy(model, ids, depth, 40, **penalties).token_ids == reference.token_ids


def test_greedy_mtp_equals_ar_across_prefill_chunks(models, monkeypatch):
    import mtplxd.engine.decoding.speculative as speculative
    import mtplxd.engine.model.trunk as trunk

    model = models["qwen3"]
    ids = prompt_ids(model, "chat") + prompt_ids(model, "code")
    whole = greedy(model, ids, 0, 30)
    monkeypatch.setattr(trunk, "PREFILL_CHUNK", 6)
    monkeypatch.setattr(speculative, "PREFILL_CHUNK", 6)
    assert greedy(model, ids, 0, 30).token_ids == whole.token_ids
    for depth in (1, 3):
        assert greedy(model, ids, depth, 30).token_ids == whole.token_ids


def test_stop_strings_and_ids_end_mtp_and_ar_identically(models):
    model = models["qwen3"]
    ids = prompt_ids(model, "chat")
    free = greedy(model, ids, 0, 40, stop_token_ids=[])
    stop_string = free.text[10:13]
    stop_id = free.token_ids[6]
    for sampling in (dict(stop=[stop_string]), dict(stop_token_ids=[stop_id])):
        reference = greedy(model, ids, 0, 40, **sampling)
        assert reference.finish_reason == "stop"
        for depth in (1, 2, 3):
            result = greedy(model, ids, depth, 40, **sampling)
            assert (result.token_ids, result.text, result.finish_reason) == (
                reference.token_ids, reference.text, reference.finish_reason)


def test_request_depth_zero_runs_ar_and_none_runs_model_default(models):
    model = models["qwen3"]
    ids = prompt_ids(model, "chat")
    assert greedy(model, ids, 0, 5).stats.depth == 0
    assert greedy(model, ids, None, 5).stats.depth == model.info.depth == 3
    with pytest.raises(ValueError):
        greedy(model, ids, 99, 5)


def test_a_quantized_draft_head_keeps_greedy_output_identical(tiny_model_factory):
    model = load_model(tiny_model_factory("qwen3"))
    ids = prompt_ids(model, "code")
    reference = greedy(model, ids, 0, 32)
    assert model.trunk.quantize_draft_head(bits=4, group_size=32)
    for depth in (1, 3):
        result = greedy(model, ids, depth, 32)
        assert result.token_ids == reference.token_ids
        assert result.stats.accepted > 0
    quantized = load_model(tiny_model_factory("qwen3", quantize_bits=4), dequantize_weights="off")
    assert quantized.trunk.quantize_draft_head() is False  # lm_head already quantized: shared
