"""Hypothesis over request bodies of every generation endpoint, against the real daemon: no
5xx, no crash, no unexpected-error log line, streams always terminate."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

MODEL_ID = "tiny-qwen3"

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=8)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "", "robot"])
part_types = st.sampled_from(["text", "input_text", "output_text", "image_url", "tool_use", "tool_result",
                              "thinking", "function_call", "function_call_output", "message", "bogus"])
parts = st.lists(st.fixed_dictionaries({"type": part_types}, optional={
    "text": st.one_of(st.text(max_size=20), junk), "content": junk, "input": junk, "name": junk,
    "id": junk, "tool_use_id": junk}), max_size=3)
content = st.one_of(st.text(max_size=30), parts, junk)
message = st.fixed_dictionaries({"role": roles, "content": content}, optional={
    "tool_calls": st.one_of(junk, st.lists(st.fixed_dictionaries({"id": st.text(max_size=5), "type": st.just("function"),
                                                                  "function": st.fixed_dictionaries({
                                                                      "name": st.text(max_size=8),
                                                                      "arguments": st.one_of(st.text(max_size=10), junk)})}),
                                           max_size=2)),
    "tool_call_id": junk, "reasoning_content": junk, "type": part_types, "call_id": junk,
    "arguments": junk, "output": junk, "name": junk})
messages = st.one_of(st.lists(message, min_size=0, max_size=4), junk)
tool = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["function", "custom", "namespace", "web_search", "x"])},
                          optional={"function": st.fixed_dictionaries({"name": st.one_of(st.text(max_size=8), junk)},
                                                                      optional={"parameters": junk}),
                                    "name": st.one_of(st.text(max_size=8), junk), "parameters": junk,
                                    "input_schema": junk, "tools": junk}),
    junk)
# A cap is always present (valid or not): no fuzzed request may generate a whole context.
cap = st.one_of(st.integers(0, 4), st.integers(-5, -1), st.text(max_size=3), st.floats(), st.booleans())
common = {
    "model": st.one_of(st.just(MODEL_ID), junk), "stream": st.one_of(st.booleans(), junk),
    "temperature": st.one_of(st.floats(-1, 3), junk), "top_p": st.one_of(st.floats(-1, 2), junk),
    "top_k": st.one_of(st.integers(-3, 100), junk), "min_p": junk, "seed": st.one_of(st.integers(), junk),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), junk),
    "mtp_depth": st.one_of(st.integers(-2, 12), junk), "tools": st.one_of(st.lists(tool, max_size=3), junk),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any"]), junk),
    "stream_options": junk, "presence_penalty": junk, "frequency_penalty": junk,
    "reasoning_effort": st.one_of(st.sampled_from(["none", "low", "high", "xhigh", "max"]), junk),
    "chat_template_kwargs": junk, "response_format": junk, "n": junk, "logprobs": junk, "echo": junk,
    "thinking": junk, "system": st.one_of(st.text(max_size=10), junk), "reasoning": junk, "text": junk,
    "instructions": st.one_of(st.text(max_size=10), junk), "previous_response_id": junk,
}
ENDPOINTS = {
    "/v1/chat/completions": ({"messages": messages, "max_tokens": cap}, {"max_completion_tokens": cap}),
    "/v1/completions": ({"prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-1, 500), max_size=6), junk),
                         "max_tokens": cap}, {}),
    "/v1/messages": ({"messages": messages, "max_tokens": cap}, {}),
    "/v1/messages/count_tokens": ({"messages": messages}, {}),
    "/v1/responses": ({"input": st.one_of(st.text(max_size=20), messages), "max_output_tokens": cap}, {}),
}


VALID = {
    "/v1/chat/completions": {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"model": MODEL_ID, "prompt": "def f():", "max_tokens": 2},
    "/v1/messages": {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": MODEL_ID, "input": "hi", "max_output_tokens": 2},
}


def bodies(path: str):
    """Wholly fuzzed bodies, and valid bodies with one or two fields fuzzed (these reach the model)."""
    required, extra = ENDPOINTS[path]
    fields = {**common, **extra}
    one_field = st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys}))
    return st.one_of(st.fixed_dictionaries(required, optional=fields),
                     one_field.map(lambda changed: {**VALID[path], **changed}))


def post(http: httpx.Client, path: str, content: bytes) -> tuple[int, bytes]:
    with http.stream("POST", path, content=content, headers={"content-type": "application/json"}) as answer:
        return answer.status_code, answer.read()


@pytest.fixture(scope="module")
def http(api):
    with api.http() as client:
        yield client


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_fuzzed_bodies_never_cause_a_server_error(api, http, path):
    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies(path))
    def check(body):
        status, payload = post(http, path, json.dumps(body).encode())
        event(f"status {status}")
        assert status < 500, payload[:500]
        if status == 200 and payload.startswith(b"data:"):
            assert payload.rstrip().endswith(b"data: [DONE]"), payload[-300:]
        elif status >= 400:
            assert json.loads(payload)  # errors are JSON, in the dialect's shape

    check()
    assert api.process.poll() is None
    assert "unexpected error" not in api.log()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.one_of(st.binary(max_size=60), st.just(b"[" * 100_000), st.just(b'{"a":' * 50_000),
                     st.text(max_size=40).map(str.encode)))
def test_fuzzed_raw_bytes_are_400s(api, http, raw):
    status, payload = post(http, "/v1/chat/completions", raw)
    assert 400 <= status < 500, payload[:300]
