"""OpenAI chat completions and completions through the real `openai` client against a real
daemon (hypercorn on loopback) serving a tiny random-weight model."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL_ID = "tiny-qwen3"  # the fixture checkpoint folder name (tests/api/conftest.py)
USER = [{"role": "user", "content": "write a function that adds two numbers"}]
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


@pytest.fixture(scope="module")
def client(api):
    with openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused-on-loopback", max_retries=0) as c:
        yield c


def streamed_text(client, **kwargs):
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models_lists_the_served_model_with_its_context(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_ID]
    assert models[0].model_extra["context_length"] == 4096


def test_health_says_model_state_mode_and_depth(api):
    body = httpx.get(api.base_url + "/health").json()
    assert body["state"] == "loaded" and body["model"] == MODEL_ID
    assert body["mode"] == "mtp" and body["depth"] == 3 and body["degradations"] == []
    plan = body["memory"]["plan"]  # the memory guard's plan, from the model's geometry
    assert plan["kv_bytes_per_token"] > 0 and plan["weights_bytes"] > 0
    assert body["memory"]["max_context_tokens"] >= body["context_length"]
    # Which implementation each fast path runs: on this CPU, MLX's own ops everywhere.
    assert body["kernels"]["quantized_matmul"].startswith("mlx")
    assert body["kernels"]["cache_attention"].startswith("mlx")


def test_chat_non_streamed_carries_usage_stats_and_truthful_finish(client):
    reply = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("length", "stop")
    stats = reply.model_extra["mtplx_stats"]
    assert stats["completion_tokens"] == reply.usage.completion_tokens
    assert stats["prompt_tokens"] == reply.usage.prompt_tokens
    assert stats["depth"] == 3 and len(stats["drafted_by_depth"]) == 3
    assert stats["max_tokens"] == 12
    if choice.finish_reason == "length":
        assert reply.usage.completion_tokens == 12


def test_streamed_text_concatenates_to_exactly_the_non_streamed_text(client):
    kwargs = dict(model=MODEL_ID, messages=USER, max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    text, chunks = streamed_text(client, stream_options={"include_usage": True}, **kwargs)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.model_extra["mtplx_stats"]["completion_tokens"] == whole.usage.completion_tokens


def test_sampled_streams_are_reproducible_with_a_seed(client):
    kwargs = dict(model=MODEL_ID, messages=USER, max_tokens=30, temperature=0.9, top_p=0.95,
                  seed=7, presence_penalty=0.1, extra_body={"top_k": 50, "min_p": 0.01})
    first, _ = streamed_text(client, **kwargs)
    whole = client.chat.completions.create(**kwargs)
    assert first == whole.choices[0].message.content


def test_stats_come_on_the_final_chunk_without_include_usage(client):
    _, chunks = streamed_text(client, model=MODEL_ID, messages=USER, max_tokens=5, temperature=0)
    assert chunks[-1].choices[0].finish_reason is not None
    assert "mtplx_stats" in chunks[-1].model_extra
    assert all("mtplx_stats" not in c.model_extra for c in chunks[:-1])


def test_developer_role_max_completion_tokens_and_store_false_as_pi_sends_them(client):
    reply = client.chat.completions.create(
        model=MODEL_ID, max_completion_tokens=3, store=False, temperature=0,
        messages=[{"role": "developer", "content": "You are terse."}, *USER],
        tools=[{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": False}}])
    assert reply.usage.completion_tokens <= 3


def test_tool_round_trip_history_is_accepted(client):
    messages = [*USER,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "def add(a, b): return a + b"}]
    reply = client.chat.completions.create(model=MODEL_ID, messages=messages, tools=TOOLS,
                                           tool_choice="auto", max_tokens=5, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_forced_tool_choice_puts_the_call_opener_in_the_prompt(client):
    base = dict(model=MODEL_ID, messages=USER, tools=TOOLS, max_tokens=1, temperature=0)
    auto = client.chat.completions.create(tool_choice="auto", **base)
    named = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "read_file"}}, **base)
    # The prompt ends inside the call (`<tool_call>\n{"name": "read_file", "arguments": `), so it
    # is longer; the name is written, so it is a call, cut off by the cap with what the model
    # wrote of its arguments (one token).
    assert named.usage.prompt_tokens > auto.usage.prompt_tokens
    assert named.choices[0].finish_reason == "length"
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["read_file"]
    assert not named.choices[0].message.content


def test_a_forced_named_call_is_a_call_whatever_the_model_writes_as_arguments(client):
    """The tiny model does not write JSON after the forced opener: the call still ends as a
    call, its raw text as `arguments` (never as content), in both the streamed and the
    non-streamed reply."""
    base = dict(model=MODEL_ID, messages=USER, tools=TOOLS, max_tokens=24, temperature=0,
                tool_choice={"type": "function", "function": {"name": "read_file"}})
    reply = client.chat.completions.create(**base)
    calls = reply.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["read_file"] and not reply.choices[0].message.content
    streamed = "".join(c.function.arguments or "" for chunk in client.chat.completions.create(stream=True, **base)
                       for choice in chunk.choices for c in (choice.delta.tool_calls or []))
    assert streamed == calls[0].function.arguments


def test_thinking_switch_reaches_the_chat_template(client):
    base = dict(model=MODEL_ID, messages=USER, max_tokens=1, temperature=0)
    off = client.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **base)
    on = client.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": True}}, **base)
    effort_none = client.chat.completions.create(reasoning_effort="none", **base)
    effort_high = client.chat.completions.create(reasoning_effort="high", **base)
    # The template closes an empty <think></think> when thinking is off.
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert effort_none.usage.prompt_tokens == off.usage.prompt_tokens
    assert effort_high.usage.prompt_tokens == on.usage.prompt_tokens


def test_mtp_depth_extra_field_sets_the_depth_and_zero_is_plain_ar(client):
    base = dict(model=MODEL_ID, messages=USER, max_tokens=20, temperature=0)
    ar = client.chat.completions.create(extra_body={"mtp_depth": 0}, **base)
    d2 = client.chat.completions.create(extra_body={"mtp_depth": 2}, **base)
    assert ar.model_extra["mtplx_stats"]["depth"] == 0 and ar.model_extra["mtplx_stats"]["drafted"] == 0
    assert d2.model_extra["mtplx_stats"]["depth"] == 2
    assert ar.choices[0].message.content == d2.choices[0].message.content  # greedy MTP == AR


def test_output_cap_is_clamped_to_the_context_visibly(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL_ID, messages=USER,
                                                          max_tokens=32000, temperature=0)
    reply = raw.parse()
    room = 4096 - reply.usage.prompt_tokens
    assert raw.headers["x-mtplx-max-tokens"] == str(room)
    assert raw.headers["x-mtplx-max-tokens-clamped-from"] == "32000"
    assert reply.model_extra["mtplx_stats"]["max_tokens"] == room
    assert reply.model_extra["mtplx_stats"]["max_tokens_requested"] == 32000


def test_stop_sequence_ends_the_text_before_it(client):
    base = dict(model=MODEL_ID, messages=USER, max_tokens=30, temperature=0)
    full = client.chat.completions.create(**base).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = client.chat.completions.create(stop=[stop], **base)
    assert cut.choices[0].finish_reason == "stop"
    assert full.startswith(cut.choices[0].message.content)
    assert stop not in cut.choices[0].message.content


def test_ignore_eos_decodes_through_the_end_token_to_max_tokens(client):
    # A seeded reply that ends by itself (the tiny model samples its end within a few hundred
    # tokens) runs on to max_tokens with `ignore_eos`, the same tokens up to where it ended.
    base = dict(model=MODEL_ID, messages=USER, max_tokens=600, temperature=1.0)
    for seed in range(8):
        ended = client.chat.completions.create(seed=seed, **base)
        if ended.choices[0].finish_reason == "stop":
            break
    else:
        pytest.fail("eight seeded replies ran to 600 tokens without an end token")
    on = client.chat.completions.create(seed=seed, extra_body={"ignore_eos": True}, **base)
    assert on.choices[0].finish_reason == "length" and on.usage.completion_tokens == 600
    assert on.choices[0].message.content.startswith(ended.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(extra_body={"ignore_eos": "yes"}, **base)
    assert err.value.body["param"] == "ignore_eos"


# -- errors ---------------------------------------------------------------------------------

def test_bad_parameter_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_ID, messages=USER, temperature=7)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_ID, messages=USER, reasoning_effort="ludicrous")
    assert err.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "wizard", "content": "x"}])
    assert err.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_ID, messages=USER, response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_ID, messages=USER, n=2)
    assert err.value.body["param"] == "n"


def test_prompt_that_cannot_fit_is_context_length_exceeded(client):
    long = [{"role": "user", "content": "hello world " * 3000}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_ID, messages=long, max_tokens=5)
    assert err.value.code == "context_length_exceeded"


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=USER)
    assert err.value.code == "model_not_found"


def test_oversized_body_is_a_413_in_json(api):
    body = b'{"messages": "' + b"x" * (33 * 1024 * 1024) + b'"}'
    answer = httpx.post(api.base_url + "/v1/chat/completions", content=body,
                        headers={"content-type": "application/json"}, timeout=60)
    assert answer.status_code == 413
    assert answer.json()["error"]["code"] == "request_too_large"


def test_malformed_json_and_unknown_route_are_json_errors(api):
    bad = httpx.post(api.base_url + "/v1/chat/completions", content=b"{nope",
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    missing = httpx.get(api.base_url + "/v1/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong_method = httpx.get(api.base_url + "/v1/responses")
    assert wrong_method.status_code == 405 and "POST" in wrong_method.headers["allow"]
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"


# -- legacy completions ---------------------------------------------------------------------

def test_echo_logprobs_max_tokens_zero_scores_the_prompt(client):
    prompt = "def add(a, b):\n    return a + b"
    reply = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    lp = reply.choices[0].logprobs
    n = reply.usage.prompt_tokens
    assert reply.choices[0].text == prompt
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == prompt
    assert reply.usage.completion_tokens == 0



def test_scoring_streamed_is_one_chunk_with_the_same_scores_then_done(client, api):
    """stream with max_tokens 0: an SSE answer (the SDK yields it), its one chunk the
    non-streamed choice, then the usage chunk when asked, then [DONE]."""
    kwargs = dict(model=MODEL_ID, prompt="def add(a, b):", max_tokens=0, echo=True, logprobs=1)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert [len(c.choices) for c in chunks] == [1, 0]
    assert chunks[0].choices[0].text == whole.choices[0].text
    assert chunks[0].choices[0].logprobs.token_logprobs == whole.choices[0].logprobs.token_logprobs
    assert chunks[0].choices[0].finish_reason == "length"
    assert chunks[1].usage.prompt_tokens == whole.usage.prompt_tokens and chunks[1].usage.completion_tokens == 0
    with httpx.stream("POST", api.base_url + "/v1/completions", json={**kwargs, "stream": True}) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        assert raw.headers["x-mtplx-max-tokens"] == "0"
        lines = [line for line in raw.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 2

def test_plain_completion_streams_the_same_text(client):
    kwargs = dict(model=MODEL_ID, prompt="import json\n", max_tokens=25, temperature=0)
    whole = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == whole.choices[0].text
    assert whole.model_extra["mtplx_stats"]["completion_tokens"] == whole.usage.completion_tokens


def test_logprobs_without_echo_at_max_tokens_zero_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_ID, prompt="x", max_tokens=0, logprobs=1)
    assert err.value.body["param"] == "echo"


def test_an_image_part_for_a_text_only_model_is_a_400_naming_the_model(client):
    # One transparent pixel: a valid image, which this model still cannot read.
    pixel = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
             "YPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==")
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                             {"type": "image_url", "image_url": {"url": pixel}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=1)
    assert err.value.body["code"] == "model_has_no_vision"
    assert MODEL_ID in err.value.body["message"] and "no vision tower" in err.value.body["message"]
    assert client.models.list().data[0].model_extra["supports_vision"] is False
