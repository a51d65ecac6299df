"""Hypothesis over request bodies, headers and paths of every endpoint, against the real daemon:
no 5xx, no crash, no unexpected-error log line, streams always terminate.

CI runs a modest number of cases; `MTPLX_FUZZ_EXAMPLES=10000` runs the long campaign that
docs/reliability.md reports.
"""

from __future__ import annotations

import json
import os
import socket

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

MODEL_ID = "tiny-qwen3"
EXAMPLES = int(os.environ.get("MTPLX_FUZZ_EXAMPLES", "0"))  # 0: each test's CI-sized default


def examples(default: int) -> int:
    return EXAMPLES or default


# Any code point, lone UTF-16 surrogates included (json.dumps writes them as `\ud800` escapes,
# as a JavaScript client that cut a string mid-pair would).
any_char = st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr))


def texts(max_size: int) -> st.SearchStrategy[str]:
    return st.text(any_char, max_size=max_size)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), texts(max_size=12))
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(texts(max_size=8), inner, max_size=3)), max_leaves=8)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "", "robot"])
part_types = st.sampled_from(["text", "input_text", "output_text", "image_url", "tool_use", "tool_result",
                              "thinking", "function_call", "function_call_output", "message", "bogus"])
parts = st.lists(st.fixed_dictionaries({"type": part_types}, optional={
    "text": st.one_of(texts(max_size=20), junk), "content": junk, "input": junk, "name": junk,
    "id": junk, "tool_use_id": junk}), max_size=3)
content = st.one_of(texts(max_size=30), parts, junk)
message = st.fixed_dictionaries({"role": roles, "content": content}, optional={
    "tool_calls": st.one_of(junk, st.lists(st.fixed_dictionaries({"id": texts(max_size=5), "type": st.just("function"),
                                                                  "function": st.fixed_dictionaries({
                                                                      "name": texts(max_size=8),
                                                                      "arguments": st.one_of(texts(max_size=10), junk)})}),
                                           max_size=2)),
    "tool_call_id": junk, "reasoning_content": junk, "type": part_types, "call_id": junk,
    "arguments": junk, "output": junk, "name": junk})
messages = st.one_of(st.lists(message, min_size=0, max_size=4), junk)
tool = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["function", "custom", "namespace", "web_search", "x"])},
                          optional={"function": st.fixed_dictionaries({"name": st.one_of(texts(max_size=8), junk)},
                                                                      optional={"parameters": junk}),
                                    "name": st.one_of(texts(max_size=8), junk), "parameters": junk,
                                    "input_schema": junk, "tools": junk}),
    junk)
# A cap is always present (valid or not): no fuzzed request may generate a whole context.
cap = st.one_of(st.integers(0, 4), st.integers(-5, -1), texts(max_size=3), st.floats(), st.booleans())
common = {
    "model": st.one_of(st.just(MODEL_ID), junk), "stream": st.one_of(st.booleans(), junk),
    "temperature": st.one_of(st.floats(-1, 3), junk), "top_p": st.one_of(st.floats(-1, 2), junk),
    "top_k": st.one_of(st.integers(-3, 100), junk), "min_p": junk, "seed": st.one_of(st.integers(), junk),
    "stop": st.one_of(texts(max_size=3), st.lists(texts(max_size=3), max_size=3), junk),
    "mtp_depth": st.one_of(st.integers(-2, 12), junk), "tools": st.one_of(st.lists(tool, max_size=3), junk),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any"]), junk),
    "stream_options": junk, "presence_penalty": junk, "frequency_penalty": junk,
    "reasoning_effort": st.one_of(st.sampled_from(["none", "low", "high", "xhigh", "max"]), junk),
    "chat_template_kwargs": junk, "response_format": junk, "n": junk, "logprobs": junk, "echo": junk,
    "thinking": junk, "system": st.one_of(texts(max_size=10), junk), "reasoning": junk, "text": junk,
    "instructions": st.one_of(texts(max_size=10), junk), "previous_response_id": junk,
}
ENDPOINTS = {
    "/v1/chat/completions": ({"messages": messages, "max_tokens": cap}, {"max_completion_tokens": cap}),
    "/v1/completions": ({"prompt": st.one_of(texts(max_size=30), st.lists(st.integers(-1, 500), max_size=6), junk),
                         "max_tokens": cap}, {}),
    "/v1/messages": ({"messages": messages, "max_tokens": cap}, {}),
    "/v1/messages/count_tokens": ({"messages": messages}, {}),
    "/v1/responses": ({"input": st.one_of(texts(max_size=20), messages), "max_output_tokens": cap}, {}),
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
    @settings(max_examples=examples(120), deadline=None, suppress_health_check=list(HealthCheck))
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


@settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.one_of(st.binary(max_size=60), st.just(b"[" * 100_000), st.just(b'{"a":' * 50_000),
                     texts(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_fuzzed_raw_bytes_are_400s(api, http, raw):
    status, payload = post(http, "/v1/chat/completions", raw)
    assert 400 <= status < 500, payload[:300]


header_names = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz-_0123456789"), min_size=1, max_size=16) | \
    st.sampled_from(["authorization", "x-api-key", "origin", "content-type", "accept", "host",
                     "x-session-id", "anthropic-version", "user-agent", "content-encoding", "expect",
                     "transfer-encoding"])
# Header values are bytes on the wire: anything but CR, LF and NUL.
header_values = st.binary(max_size=40).map(
    lambda b: b.replace(b"\r", b"").replace(b"\n", b"").replace(b"\0", b"").strip())
GET_PATHS = ["/health", "/v1/models", f"/v1/models/{MODEL_ID}", "/metrics", "/v1/mtplx/flight"]


def raw_exchange(port: int, head: bytes, body: bytes, timeout: float = 60) -> tuple[int, bytes]:
    """Send one request as raw bytes (so no client library vets it first); return the status
    and the answer's head."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    status_line = answer.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 "), answer[:300]
    return int(status_line.split()[1]), answer


@settings(max_examples=examples(80), deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(sorted(ENDPOINTS)),
       headers=st.dictionaries(header_names, header_values, max_size=4))
def test_fuzzed_headers_never_cause_a_server_error(api, path, headers):
    body = json.dumps(VALID[path]).encode()
    lines = [f"POST {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close",
             b"Content-Type: application/json", f"Content-Length: {len(body)}".encode()]
    lines += [name.encode() + b": " + value for name, value in headers.items()
              if name not in {"content-length", "transfer-encoding", "host", "connection"}]
    status, answer = raw_exchange(api.port, b"\r\n".join(lines) + b"\r\n\r\n", body)
    event(f"status {status}")
    assert status < 500, answer[:300]
    assert api.process.poll() is None


@settings(max_examples=examples(80), deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.one_of(st.sampled_from(GET_PATHS),
                      texts(max_size=20).map(lambda t: "/v1/models/" + t),
                      texts(max_size=20).map(lambda t: "/" + t)),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH"]))
def test_fuzzed_paths_and_methods_never_cause_a_server_error(api, http, path, method):
    from urllib.parse import quote

    url = quote(path.encode("utf-8", "surrogatepass"), safe="/")
    with http.stream(method, url, content=b"{}" if method in {"POST", "PUT", "PATCH"} else None) as answer:
        payload = answer.read()
    assert answer.status_code < 500, (method, url, payload[:300])
    if answer.status_code >= 400 and method != "HEAD":
        assert json.loads(payload)
    assert api.process.poll() is None
