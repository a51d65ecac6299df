"""Server-sent events: frame encoders per dialect and the streaming Response.

OpenAI chat/completions: `data: {json}` frames, `: keep-alive` comments while quiet, and a
terminal `data: [DONE]` (after an `{"error": ...}` frame when the request failed).
Anthropic: `event: TYPE` + `data: {json}` frames; keep-alive is Anthropic's own `ping`
event; a failure ends with an `error` event.
Responses: `event: TYPE` + `data: {json}` with a `sequence_number`; keep-alives are comments;
a failure ends with `response.failed`.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from quart import Response

COMMENT_KEEPALIVE = b": keep-alive\n\n"
OPENAI_DONE = b"data: [DONE]\n\n"


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def openai_frame(data: dict[str, Any]) -> bytes:
    """One OpenAI data frame."""
    return f"data: {_dumps(data)}\n\n".encode()


def event_frame(event: str, data: dict[str, Any]) -> bytes:
    """One named event frame (Anthropic, Responses)."""
    return f"event: {event}\ndata: {_dumps(data)}\n\n".encode()


def anthropic_event(data: dict[str, Any]) -> bytes:
    """An Anthropic event: the event name is the payload's `type`."""
    return event_frame(data["type"], data)


ANTHROPIC_PING = anthropic_event({"type": "ping"})


class ResponsesEvents:
    """Numbers Responses events in order (`sequence_number`)."""

    def __init__(self) -> None:
        self.sequence = 0

    def frame(self, event: str, data: dict[str, Any]) -> bytes:
        payload = {"type": event, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return event_frame(event, payload)


def sse_response(body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> Response:
    """A streaming text/event-stream Response with no timeout (generations may be long)."""
    response = Response(body, status=200, mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    for name, value in (headers or {}).items():
        response.headers[name] = value
    response.timeout = None
    return response
