"""Error shapes per dialect, status mapping, and typed request reading that names parameters."""

from __future__ import annotations

import json

import pytest

from mtplxd.api.errors import (
    ANTHROPIC, OPENAI, APIError, context_length_exceeded, dialect_for_path, error_body,
    from_http_status, model_not_loaded, render_error,
)
from mtplxd.api.schemas import Reader, read_stop, text_of
from mtplxd.api.service import _translate
from mtplxd.guard import InsufficientMemory


def test_openai_shape_has_message_type_param_code():
    body = error_body(APIError(400, "bad", code="invalid_request", param="temperature"), OPENAI)
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "temperature",
                              "code": "invalid_request"}}


def test_anthropic_shape_has_type_error_and_typed_error():
    body = error_body(APIError(404, "nope"), ANTHROPIC)
    assert body == {"type": "error", "error": {"type": "not_found_error", "message": "nope"}}
    assert error_body(APIError(413, "big"), ANTHROPIC)["error"]["type"] == "request_too_large"


def test_dialect_follows_the_path():
    assert dialect_for_path("/v1/messages") == ANTHROPIC
    assert dialect_for_path("/v1/messages/count_tokens") == ANTHROPIC
    assert dialect_for_path("/v1/responses") == OPENAI


def test_statuses_and_headers():
    text, status, headers = render_error(model_not_loaded("none"), OPENAI)
    assert status == 503 and headers["Retry-After"] == "5"
    assert json.loads(text)["error"]["code"] == "model_not_loaded"
    _, status, headers = render_error(APIError(401, "key"), ANTHROPIC)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    error = context_length_exceeded(5000, 4096)
    assert (error.status, error.code) == (400, "context_length_exceeded")
    assert from_http_status(413, "").code == "request_too_large"


def test_memory_guard_refusal_is_a_507_with_the_guards_numbers():
    refusal = InsufficientMemory(needed_bytes=3 << 30, available_bytes=1 << 30,
                                 holders={"weights": 8 << 30}, limit_bytes=12 << 30,
                                 hint="lower max_tokens")
    error = _translate(refusal)
    assert isinstance(error, APIError) and error.status == 507 and error.code == "insufficient_memory"
    body = error_body(error, OPENAI)["error"]
    assert body["type"] == "insufficient_memory" and body["held_by"] == {"weights": 8 << 30}
    assert body["needed_bytes"] == 3 << 30 and body["hint"] == "lower max_tokens"
    assert error_body(error, ANTHROPIC)["error"]["needed_bytes"] == 3 << 30
    assert _translate(MemoryError("metal allocation failed")).status == 507


def test_reader_names_nested_parameters():
    body = Reader({"a": {"b": "x"}, "n": 1.5, "t": True, "s": ["ok", 3]})
    with pytest.raises(APIError) as err:
        body.obj("a").int("b")
    assert err.value.param == "a.b"
    with pytest.raises(APIError) as err:
        body.int("n")
    assert err.value.param == "n"
    with pytest.raises(APIError):
        body.float("t")  # booleans are not numbers
    with pytest.raises(APIError) as err:
        read_stop(body, "s")
    assert err.value.param == "s"
    with pytest.raises(APIError) as err:
        text_of([{"type": "image_url", "image_url": {}}], "messages[0].content")
    assert err.value.param == "messages[0].content[0]" and err.value.code == "unsupported_content"
    assert text_of([{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}], "c") == "ab"
