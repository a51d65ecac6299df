"""JSON-RPC 2.0 framing for the control socket: one JSON object per line.

Versioned by PROTOCOL_VERSION (returned by `daemon.status`); docs/control-protocol.md is the
user-facing description. Errors carry the numeric JSON-RPC `code`, a human `message`, and a
stable string in `data.reason` that scripts can match on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = 1

# A request larger than this is refused and the connection closed: no method takes more.
MAX_MESSAGE_BYTES = 1 << 20

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
# Application errors (the JSON-RPC server-error range).
APP_ERROR = -32000


class RpcError(Exception):
    """An error to send back to the caller; `reason` is the stable machine-readable name.
    `request_id`: the id of the request it answers, where the request got as far as a valid
    one (a parse error answers with a null id)."""

    def __init__(self, code: int, message: str, reason: str, data: dict[str, Any] | None = None,
                 request_id: int | str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.data = data or {}
        self.request_id = request_id

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "data": {"reason": self.reason, **self.data}}


def app_error(reason: str, message: str, **data: Any) -> RpcError:
    """An application-level error (model not loaded, bad config value, ...)."""
    return RpcError(APP_ERROR, message, reason, data)


def invalid_params(message: str) -> RpcError:
    return RpcError(INVALID_PARAMS, message, "invalid_params")


@dataclass(frozen=True)
class Request:
    method: str
    params: dict[str, Any]
    id: int | str | None
    # JSON-RPC 2.0: a request without an `id` member is a notification and gets no response;
    # `"id": null` is an ordinary request, answered with `"id": null`.
    notification: bool = False


def parse_request(line: bytes) -> Request:
    """Decode one line into a Request, or raise RpcError with the JSON-RPC code that fits."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError) as exc:
        # ValueError covers bad UTF-8, bad JSON and integer literals past Python's digit limit;
        # RecursionError a line nested deeper than the parser's stack.
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise RpcError(PARSE_ERROR, f"parse error: {reason}", "parse_error") from None
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, "expected a JSON-RPC 2.0 object", "invalid_request")
    method = message.get("method")
    if not isinstance(method, str) or not method:
        raise RpcError(INVALID_REQUEST, "method must be a non-empty string", "invalid_request")
    request_id = message.get("id")
    if request_id is not None and (isinstance(request_id, bool) or not isinstance(request_id, (int, str))):
        raise RpcError(INVALID_REQUEST, "id must be a string or an integer", "invalid_request")
    params = message.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RpcError(INVALID_PARAMS, "params must be an object", "invalid_params", request_id=request_id)
    return Request(method=method, params=params, id=request_id, notification="id" not in message)


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), default=str).encode() + b"\n"


def result_message(request_id: int | str | None, result: Any) -> bytes:
    return encode({"jsonrpc": "2.0", "id": request_id, "result": result})


def error_message(request_id: int | str | None, error: RpcError) -> bytes:
    return encode({"jsonrpc": "2.0", "id": request_id, "error": error.to_json()})


def notification_message(method: str, params: dict[str, Any]) -> bytes:
    return encode({"jsonrpc": "2.0", "method": method, "params": params})
