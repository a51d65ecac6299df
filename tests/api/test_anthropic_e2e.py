"""Anthropic /v1/messages and count_tokens through the real `anthropic` client."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

MODEL_ID = "tiny-qwen3"
GREEDY = {"extra_body": {"temperature": 0}}  # this SDK version has no `temperature` argument
USER = [{"role": "user", "content": "write a function that adds two numbers"}]
TOOLS = [{"name": "read_file", "description": "Read a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def client(api):
    with anthropic.Anthropic(base_url=api.base_url, api_key="unused", max_retries=0) as c:
        yield c


def sse_events(api, body):
    """(event name, payload) pairs of a raw streamed /v1/messages answer."""
    events = []
    with httpx.stream("POST", api.base_url + "/v1/messages", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


def test_message_has_text_usage_stats_and_max_tokens_stop_reason(client):
    reply = client.messages.create(model=MODEL_ID, max_tokens=6, messages=USER, **GREEDY)
    assert reply.role == "assistant" and reply.type == "message"
    assert reply.stop_reason in ("max_tokens", "end_turn")
    if reply.stop_reason == "max_tokens":
        assert reply.usage.output_tokens == 6
    assert reply.model_extra["mtplx_stats"]["completion_tokens"] == reply.usage.output_tokens
    assert all(block.type == "text" for block in reply.content)


def test_stream_events_come_in_anthropic_order_and_equal_the_whole_message(client, api):
    body = {"model": MODEL_ID, "max_tokens": 30, "messages": USER}
    whole = client.messages.create(**body, **GREEDY)
    events = sse_events(api, {**body, "temperature": 0})
    names = [n for n, _ in events if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert all(n == d["type"] for n, d in events)
    if any(n == "content_block_start" for n in names):
        body_names = names[1:-2]
        assert body_names[0] == "content_block_start" and body_names[-1] == "content_block_stop"
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "".join(b.text for b in whole.content)
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"]["stop_reason"] == whole.stop_reason
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    assert "mtplx_stats" in delta


def test_sdk_stream_helper_accumulates_the_same_message(client):
    body = dict(model=MODEL_ID, max_tokens=20, messages=USER, **GREEDY)
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [b.text for b in final.content] == [b.text for b in whole.content]
    assert final.stop_reason == whole.stop_reason


def test_stop_sequence_is_reported_with_the_sequence(client):
    body = dict(model=MODEL_ID, max_tokens=30, messages=USER, **GREEDY)
    text = "".join(b.text for b in client.messages.create(**body).content)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    reply = client.messages.create(stop_sequences=[stop], **body)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop


def test_tool_use_and_tool_result_history_and_thinking_blocks_are_accepted(client):
    messages = [
        *USER,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should read it.", "signature": ""},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "x = 1"}]},
            {"type": "text", "text": "Now explain it."}]},
    ]
    reply = client.messages.create(model=MODEL_ID, max_tokens=4, messages=messages, tools=TOOLS,
                                   system=[{"type": "text", "text": "Be brief."}], **GREEDY,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert reply.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_count_tokens_matches_the_prompt_the_model_sees(client):
    count = client.messages.count_tokens(model=MODEL_ID, messages=USER, system="Be brief.")
    reply = client.messages.create(model=MODEL_ID, max_tokens=1, messages=USER, system="Be brief.")
    # Anthropic's input_tokens leaves out prompt tokens read from the cache (the session bank
    # holds this prompt's prefix from earlier tests); count_tokens counts them all.
    assert count.input_tokens == reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)


def test_errors_come_in_anthropic_shape(client, api):
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-opus-9", max_tokens=5, messages=USER)
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL_ID, max_tokens=5, messages=[{"role": "robot", "content": "x"}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].role" in err.value.body["error"]["message"]
    raw = httpx.post(api.base_url + "/v1/messages", content=b"[1,2]",
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["type"] == "error"


def test_an_image_block_for_a_text_only_model_is_a_400_naming_the_model(client):
    source = {"type": "base64", "media_type": "image/png", "data": (
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==")}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL_ID, max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "image", "source": source}]}])
    error = err.value.body["error"]
    assert error["type"] == "invalid_request_error" and MODEL_ID in error["message"]
    assert "no vision tower" in error["message"]


def test_a_document_block_in_a_user_turn_is_refused_saying_to_send_its_text(client):
    """A PDF or text `document` block is not read here: the 400 says so and what to send
    instead, not that only user turns carry images (it is a user turn)."""
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                               "data": "the spec"}}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL_ID, max_tokens=5, messages=[
            {"role": "user", "content": [document, {"type": "text", "text": "summarize it"}]}])
    message = err.value.body["error"]["message"]
    assert "`messages[0].content[0]` is a document block" in message
    assert "send the document's text as a text block" in message
    assert "image" not in message


def test_an_image_block_in_an_assistant_turn_is_refused_as_one(client):
    source = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL_ID, max_tokens=5, messages=[
            {"role": "user", "content": "draw"},
            {"role": "assistant", "content": [{"type": "image", "source": source}]},
            {"role": "user", "content": "again"}])
    assert ("`messages[1].content[0]` is an image block in an assistant turn; only user turns "
            "may carry images") in err.value.body["error"]["message"]


def test_a_forced_named_tool_is_a_tool_use_block_whatever_the_model_writes(client):
    """`tool_choice` naming a tool writes its name in the prompt: the reply is a tool_use of
    that tool, the tiny model's non-JSON arguments kept under `_malformed_arguments`."""
    reply = client.messages.create(model=MODEL_ID, max_tokens=24, messages=USER, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "read_file"}, **GREEDY)
    assert [b.type for b in reply.content] == ["tool_use"] and reply.content[0].name == "read_file"
    assert reply.stop_reason in ("tool_use", "max_tokens")
    assert isinstance(reply.content[0].input, dict)
