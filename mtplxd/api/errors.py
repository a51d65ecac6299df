"""API errors and the one place that renders them in each dialect's JSON shape.

Handlers raise `APIError` (or let a known exception through); `render_error` turns it into
OpenAI's `{"error": {message, type, param, code}}` or Anthropic's
`{"type": "error", "error": {type, message}}` with the right status. The dialect follows
the path: `/v1/messages...` is Anthropic, everything else speaks OpenAI's shape.
"""

from __future__ import annotations

import json
from typing import Any

OPENAI = "openai"
ANTHROPIC = "anthropic"

# Anthropic names its error types by status.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    507: "api_error",
}
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    507: "insufficient_memory",
}


class APIError(Exception):
    """An error answer: status, stable code, human message, and the offending parameter."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.details = details or {}  # extra fields of the error object (e.g. the guard's numbers)


def invalid(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    """A 400 for bad input, naming the parameter."""
    return APIError(400, message, code=code, param=param)


def context_length_exceeded(prompt_tokens: int, context_length: int, param: str = "messages") -> APIError:
    """A 400 for a prompt that cannot fit the model's context (`param`: the request field
    that holds it: `messages`, `prompt` or `input`)."""
    return APIError(
        400,
        f"This model's maximum context length is {context_length} tokens; the prompt is "
        f"{prompt_tokens} tokens, which leaves no room for output. Shorten the conversation.",
        code="context_length_exceeded", param=param)


def model_not_loaded(state: str) -> APIError:
    """A 503 while no model is loaded."""
    return APIError(503, f"no model is loaded (state: {state}); load one with "
                         "`mtplxctl start --model MODEL`",
                    code="model_not_loaded", headers={"Retry-After": "5"})


def group_lost(reason: str) -> APIError:
    """A 503 while a distributed serving group has lost a rank (docs/distributed.md)."""
    return APIError(503, f"the distributed serving group lost a rank: {reason}; restart it "
                         "with `mtplxctl restart`", code="group_lost", headers={"Retry-After": "30"})


def model_not_found(requested: str, served: str) -> APIError:
    """A 404 for a model id that is not the one being served."""
    return APIError(404, f"the model {requested!r} does not exist; this server serves "
                         f"{served!r} (see GET /v1/models)", code="model_not_found", param="model")


def queue_full(queued: int, retry_after_seconds: int) -> APIError:
    """A 429 while the scheduler's queue is full (max_queued requests already wait)."""
    return APIError(429, f"the server is busy: {queued} requests are already waiting for a "
                         f"generation slot (max_queued); retry after {retry_after_seconds}s",
                    code="queue_full", headers={"Retry-After": str(retry_after_seconds)})


def dialect_for_path(path: str) -> str:
    """Which error shape a path speaks."""
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI


def error_body(error: APIError, dialect: str) -> dict[str, Any]:
    """The JSON body of `error` in `dialect`."""
    if dialect == ANTHROPIC:
        kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
        return {"type": "error", "error": {**error.details, "type": kind, "message": error.message}}
    kind = _OPENAI_TYPES.get(error.status, "server_error")
    return {"error": {**error.details, "message": error.message, "type": kind, "param": error.param,
                      "code": error.code}}


def render_error(error: APIError, dialect: str) -> tuple[str, int, dict[str, str]]:
    """(body text, status, headers) ready for a Quart response."""
    headers = {"Content-Type": "application/json", **error.headers}
    if error.status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    return json.dumps(error_body(error, dialect)), error.status, headers


def from_http_status(status: int, description: str) -> APIError:
    """An APIError for a status Quart/Werkzeug raised itself (404 route, 405, 413, ...)."""
    codes = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
             413: "request_too_large"}
    messages = {
        404: "no such endpoint; see docs/api.md for the routes this server answers",
        408: "the request body did not arrive in time (body_timeout_seconds); send it whole",
        413: "the request body is larger than this server accepts",
    }
    return APIError(status, messages.get(status, description), code=codes.get(status))
