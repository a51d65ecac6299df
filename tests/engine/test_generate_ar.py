"""Plain autoregressive generation: sampling knobs, stops, streaming text, stats, score."""

import math

import mlx.core as mx
import pytest

from mtplxd.engine import (
    GenerationRequest, GenerationResult, ModelLoadError, SamplingParams, TokenDelta, load_model,
)


def run(model, prompt_ids, depth=0, should_stop=lambda: False, **sampling):
    items = list(model.generate(GenerationRequest(prompt_ids, SamplingParams(**sampling), depth=depth),
                                should_stop))
    result = items[-1]
    assert isinstance(result, GenerationResult)
    assert all(isinstance(i, TokenDelta) for i in items[:-1])
    return items[:-1], result


def prompt(model, text="hello world"):
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True)


def reference_greedy(model, prompt_ids, n):
    """Greedy continuation computed the slow way: a full forward over the whole sequence."""
    ids = list(prompt_ids)
    for _ in range(n):
        logits = model.model(mx.array(ids)[None])
        ids.append(int(mx.argmax(logits[0, -1]).item()))
    return ids[len(prompt_ids):]


def test_greedy_ar_matches_full_forward_recompute(tiny_qwen3):
    ids = prompt(tiny_qwen3)
    _, result = run(tiny_qwen3, ids, max_tokens=12, stop_token_ids=[])
    produced = result.token_ids
    assert produced == reference_greedy(tiny_qwen3, ids, len(produced))[:len(produced)]


def test_deltas_concatenate_to_result_and_max_tokens_gives_length(tiny_qwen3):
    deltas, result = run(tiny_qwen3, prompt(tiny_qwen3), max_tokens=17, temperature=1.0, seed=5)
    assert sum((d.token_ids for d in deltas), []) == result.token_ids
    assert "".join(d.text for d in deltas) == result.text
    if result.finish_reason == "length":
        assert len(result.token_ids) == 17
    assert result.text == tiny_qwen3.tokenizer.decode(result.token_ids)
    stats = result.stats
    assert stats.prompt_tokens == len(prompt(tiny_qwen3)) and stats.depth == 0
    assert stats.completion_tokens == 17 or result.finish_reason == "stop"
    assert stats.ttft_seconds > 0 and stats.decode_tokens_per_second > 0
    assert stats.to_dict()["finish_reason"] == result.finish_reason


def test_same_seed_same_output_and_other_seed_differs(tiny_qwen3):
    ids = prompt(tiny_qwen3)
    a = run(tiny_qwen3, ids, max_tokens=24, temperature=1.0, seed=11, stop_token_ids=[])[1]
    b = run(tiny_qwen3, ids, max_tokens=24, temperature=1.0, seed=11, stop_token_ids=[])[1]
    c = run(tiny_qwen3, ids, max_tokens=24, temperature=1.0, seed=12, stop_token_ids=[])[1]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_token_id_ends_with_stop_and_is_not_emitted(tiny_qwen3):
    ids = prompt(tiny_qwen3)
    free = run(tiny_qwen3, ids, max_tokens=10)[1].token_ids
    stop_id = free[3]
    first = free.index(stop_id)
    _, result = run(tiny_qwen3, ids, max_tokens=10, stop_token_ids=[stop_id])
    assert result.finish_reason == "stop"
    assert result.token_ids == free[:first]
    assert result.stats.completion_tokens == first + 1


def test_stop_string_is_cut_and_never_streamed(tiny_qwen3):
    ids = prompt(tiny_qwen3)
    free = run(tiny_qwen3, ids, max_tokens=30)[1]
    text = free.text
    stop = text[5:8]
    assert len(stop) == 3
    deltas, result = run(tiny_qwen3, ids, max_tokens=30, stop=[stop])
    assert result.finish_reason == "stop"
    assert result.text == text[:text.index(stop)]
    assert "".join(d.text for d in deltas) == result.text


def test_streaming_text_is_utf8_safe(tiny_qwen3):
    tok = tiny_qwen3.tokenizer
    target = "café 😀 日本語"
    token_ids = tok.encode(target)
    from mtplxd.engine.decoding.detokenize import TextStream

    stream = TextStream(tok, [])
    pieces = [stream.add(t) for t in token_ids] + [stream.finish()]
    assert "".join(pieces) == target
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_split_across_tokens_is_held_back():
    from mtplxd.engine.decoding.detokenize import TextStream

    class Detok:
        def __init__(self):
            self.text = ""

        def add_token(self, t):
            self.text += t

        def finalize(self):
            pass

    class Tok:
        @property
        def detokenizer(self):
            return Detok()

    stream = TextStream(Tok(), ["END"])
    out = [stream.add(p) for p in ["ab", "cE", "N", "D", "zz"]]
    assert out == ["ab", "c", "", "", ""] and stream.stopped and stream.text == "abc"
    stream = TextStream(Tok(), ["END"])
    out = [stream.add(p) for p in ["E", "NX"]] + [stream.finish()]
    assert "".join(out) == "ENX" and not stream.stopped


def test_cancellation_between_cycles(tiny_qwen3):
    calls = {"n": 0}

    def should_stop():
        calls["n"] += 1
        return calls["n"] > 4

    _, result = run(tiny_qwen3, prompt(tiny_qwen3), should_stop=should_stop, max_tokens=100,
                    stop_token_ids=[])
    assert result.finish_reason == "cancelled"
    assert 1 <= len(result.token_ids) < 100


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.7, top_p=0.5), dict(temperature=0.7, top_k=3), dict(temperature=0.7, min_p=0.3),
    dict(repetition_penalty=1.3), dict(presence_penalty=1.0, frequency_penalty=0.5),
])
def test_sampling_knobs_run_and_are_seeded(tiny_qwen3, kwargs):
    ids = prompt(tiny_qwen3)
    a = run(tiny_qwen3, ids, max_tokens=12, seed=1, **kwargs)[1]
    b = run(tiny_qwen3, ids, max_tokens=12, seed=1, **kwargs)[1]
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


def test_penalties_change_greedy_output(tiny_qwen3):
    ids = prompt(tiny_qwen3)
    plain = run(tiny_qwen3, ids, max_tokens=30, stop_token_ids=[])[1].token_ids
    penalised = run(tiny_qwen3, ids, max_tokens=30, stop_token_ids=[], frequency_penalty=2.0)[1].token_ids
    assert plain != penalised
    assert len(set(penalised)) >= len(set(plain))


def test_score_matches_log_softmax_of_full_forward(tiny_qwen3):
    ids = prompt(tiny_qwen3, "score me please")
    scores = tiny_qwen3.score(ids)
    assert scores[0] is None and len(scores) == len(ids)
    logits = tiny_qwen3.model(mx.array(ids)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for i in range(1, len(ids)):
        assert math.isclose(scores[i], logprobs[i - 1, ids[i]].item(), abs_tol=1e-4)


def test_score_across_prefill_chunks(tiny_qwen3, monkeypatch):
    import mtplxd.engine.generation as generation

    ids = prompt(tiny_qwen3, "a somewhat longer prompt to split into chunks")
    whole = tiny_qwen3.score(ids)
    monkeypatch.setattr(generation, "PREFILL_CHUNK", 5)
    chunked = tiny_qwen3.score(ids)
    assert chunked[0] is None
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(whole[1:], chunked[1:]))


def test_llama_serves_ar_with_reason(tiny_model_factory):
    model = load_model(tiny_model_factory("llama"))
    assert model.info.mode == "ar" and model.info.depth == 0 and "llama" in model.info.ar_reason
    _, result = run(model, prompt(model), depth=3, max_tokens=8)
    assert result.stats.depth == 0 and len(result.token_ids) > 0


def test_missing_mtp_tensors_degrade_to_ar(tiny_model_factory):
    model = load_model(tiny_model_factory("qwen3", with_mtp=False))
    assert model.info.mode == "ar" and "no mtp.* tensors" in model.info.ar_reason
    _, result = run(model, prompt(model), depth=2, max_tokens=5)
    assert result.stats.depth == 0


def test_refusals_raise_model_load_error(tiny_model_factory, tmp_path):
    with pytest.raises(ModelLoadError, match="3-bit"):
        load_model(tiny_model_factory("qwen3", quantize_bits=3))
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)


def test_model_info_describes_the_checkpoint(tiny_qwen3):
    info = tiny_qwen3.info.to_dict()
    assert info["mode"] == "mtp" and info["depth"] == 3 and info["family"] == "qwen3"
    assert info["vocab_size"] == len(tiny_qwen3.tokenizer.get_vocab())
    assert info["quantization"] is None and info["context_length"] == 4096


def test_cancellation_during_a_chunked_prefill(tiny_qwen3):
    calls = {"n": 0}

    def should_stop():
        calls["n"] += 1
        return calls["n"] > 2  # the check before prefill, then one between chunks

    ids = prompt(tiny_qwen3, "a prompt long enough for several chunks")
    request = GenerationRequest(ids, SamplingParams(max_tokens=10), depth=0, prefill_chunk=4)
    result = tiny_qwen3.complete(request, should_stop)
    assert result.finish_reason == "cancelled" and result.token_ids == []
    assert result.stats.completion_tokens == 0
    assert calls["n"] == 3
