"""Anthropic `/v1/messages` and `/v1/messages/count_tokens` (what Claude Code speaks)."""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any, AsyncIterator

from quart import Response

from mtplxd.api import sse
from mtplxd.api.errors import ANTHROPIC, error_body, invalid
from mtplxd.api.images import image_part
from mtplxd.api.openai import as_api_error
from mtplxd.api.parsers import (
    ContentDelta, Event, ReasoningDelta, ToolCallDelta, ToolCallEvent, ToolCallStart,
)
from mtplxd.api.schemas import (
    Conversation, GenParams, Reader, function_tool, join_text_parts, read_sampling, read_stop,
    text_of,
)
from mtplxd.api.service import TICK, Generations, Outcome, Plan

log = logging.getLogger(__name__)


def parse_messages_request(data: dict[str, Any]
                           ) -> tuple[str | None, Conversation, GenParams, bool, list[str]]:
    """(model, conversation, params, stream, ignored server tools) from a Messages body."""
    body = Reader(data)
    model = body.str("model")
    messages: list[dict[str, Any]] = []
    system = body.raw("system")
    if system is not None:
        messages.append({"role": "system", "content": text_of(system, "system")})
    raw_messages = body.list("messages", required=True)
    if not raw_messages:
        raise invalid("`messages` must contain at least one message", "messages")
    for i, raw in enumerate(raw_messages):
        messages.extend(_to_chat(raw, f"messages[{i}]"))
    tools, ignored = [], []
    for i, raw in enumerate(body.list("tools")):
        tool = Reader(raw, f"tools[{i}]")
        kind = tool.str("type")
        if kind not in (None, "custom"):
            ignored.append(kind)  # Anthropic-hosted tools (web_search_...): nothing here runs them
            continue
        tools.append(function_tool(tool.raw("name"), tool.raw("description"), tool.raw("input_schema"),
                                   f"tools[{i}]"))
    conversation = Conversation(messages=messages, tools=tools, tool_choice=_tool_choice(body, tools))
    thinking = body.obj("thinking")
    if thinking is not None:
        kind = thinking.str("type", required=True, choices=("enabled", "disabled", "adaptive"))
        conversation.enable_thinking = kind != "disabled"
    params = GenParams()
    read_sampling(body, params)
    params.stop = read_stop(body, "stop_sequences")
    params.max_tokens = body.int("max_tokens", low=1)
    stream = bool(body.bool("stream", False))
    return model, conversation, params, stream, ignored


def _to_chat(raw: Any, name: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat-format messages (tool results become `tool` messages)."""
    msg = Reader(raw, name)
    role = msg.str("role", required=True, choices=("user", "assistant", "system"))
    content = msg.raw("content")
    if role == "system":
        # Claude Code 2.1.x (beta mid-conversation-system) sends system messages between
        # turns; like every system text they join the leading system prompt, in order.
        return [{"role": "system", "content": text_of(content, f"{name}.content")}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"`{name}.content` must be a string or an array of content blocks", f"{name}.content")
    out: list[dict[str, Any]] = []
    text, reasoning, calls = [], [], []
    for j, block in enumerate(content):
        where = f"{name}.content[{j}]"
        b = Reader(block, where)
        kind = b.str("type", required=True)
        if kind == "text":
            text.append({"type": "text", "text": b.str("text", "")})
        elif kind == "thinking" and role == "assistant":
            reasoning.append(b.str("thinking", ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use" and role == "assistant":
            arguments = b.raw("input") or {}
            if not isinstance(arguments, dict):
                raise invalid(f"`{where}.input` must be an object", f"{where}.input")
            calls.append({"id": b.str("id", ""), "type": "function",
                          "function": {"name": b.str("name", required=True), "arguments": arguments}})
        elif kind == "tool_result" and role == "user":
            out.append({"role": "tool", "tool_call_id": b.str("tool_use_id", ""),
                        "content": text_of(b.raw("content"), f"{where}.content")})
        elif kind == "image" and role == "user":
            text.append(image_part(kind, block, where))
        elif kind == "image":
            raise invalid(f"`{where}` is an image block in an {role} turn; only user turns may "
                          "carry images", where, code="unsupported_content")
        elif kind == "document":
            raise invalid(f"`{where}` is a document block (a PDF or text document), which this "
                          "server does not read; send the document's text as a text block", where,
                          code="unsupported_content")
        else:
            raise invalid(f"`{where}.type` {kind!r} is not valid in a {role} message", f"{where}.type")
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": join_text_parts(text)}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    elif text or not out:
        out.append({"role": "user", "content": join_text_parts(text)})
    return out


def _tool_choice(body: Reader, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    choice = body.obj("tool_choice")
    if choice is None:
        return "auto"
    kind = choice.str("type", required=True, choices=("auto", "any", "tool", "none"))
    if kind in ("any", "tool") and not tools:
        raise invalid("`tool_choice` forces a tool but no `tools` were given", "tool_choice")
    if kind == "any":
        return "required"
    if kind == "tool":
        name = choice.str("name", required=True)
        if name not in {t["function"]["name"] for t in tools}:
            raise invalid(f"`tool_choice.name` {name!r} is not among `tools`", "tool_choice.name")
        return {"name": name}
    return kind


def stop_reason(outcome: Outcome) -> str:
    """Anthropic's stop_reason: max_tokens before stop_sequence before tool_use."""
    if outcome.result.finish_reason == "length":
        return "max_tokens"
    if outcome.stop_sequence is not None:
        return "stop_sequence"
    if outcome.parsed.tool_calls:
        return "tool_use"
    return "end_turn"


def _usage(outcome: Outcome) -> dict[str, Any]:
    stats = outcome.result.stats
    return {"input_tokens": stats.prompt_tokens - stats.cached_tokens,
            "cache_read_input_tokens": stats.cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": stats.completion_tokens}


def _block(event: Event) -> dict[str, Any]:
    if isinstance(event, ReasoningDelta):
        return {"type": "thinking", "thinking": event.text, "signature": ""}
    if isinstance(event, ContentDelta):
        return {"type": "text", "text": event.text}
    assert isinstance(event, ToolCallEvent)
    return {"type": "tool_use", "id": _tool_id(event), "name": event.name,
            "input": tool_input(event.arguments)}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's `input` object. Arguments the model wrote as malformed (or cut-off) JSON keep
    their text under `_malformed_arguments`: Anthropic's `input` must be an object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"_malformed_arguments": arguments}


def _tool_id(call: ToolCallEvent | ToolCallStart) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _headers(plan: Plan, ignored: list[str]) -> dict[str, str]:
    headers = plan.headers()
    if ignored:
        headers["X-MTPLX-Ignored-Tools"] = ",".join(ignored)
    return headers


async def messages(gen: Generations, data: dict[str, Any]) -> Response | tuple[dict, int, dict]:
    """POST /v1/messages."""
    model, conversation, params, stream, ignored = parse_messages_request(data)
    if ignored:
        log.warning("ignoring server tools this daemon cannot run: %s", ", ".join(ignored))
    plan = await gen.plan_chat("messages", model, conversation, params)
    message_id = "msg_" + secrets.token_hex(12)
    if stream:
        await gen.open_stream(plan)
        return sse.sse_response(_stream(gen, plan, message_id), _headers(plan, ignored))
    outcome = await gen.complete(plan)
    body = {
        "id": message_id, "type": "message", "role": "assistant", "model": plan.model_id,
        "content": [_block(e) for e in outcome.parsed.blocks],
        "stop_reason": stop_reason(outcome), "stop_sequence": outcome.stop_sequence,
        "usage": _usage(outcome),
        "mtplx_stats": outcome.mtplx_stats(),
    }
    return body, 200, _headers(plan, ignored)


async def count_tokens(gen: Generations, data: dict[str, Any]) -> tuple[dict, int]:
    """POST /v1/messages/count_tokens."""
    model, conversation, _, _, _ = parse_messages_request(data)
    return {"input_tokens": await gen.count_chat_tokens(model, conversation)}, 200


async def _stream(gen: Generations, plan: Plan, message_id: str) -> AsyncIterator[bytes]:
    yield sse.anthropic_event({"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": plan.model_id,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(plan.request.prompt_ids), "output_tokens": 0}}})
    blocks = _BlockWriter()
    try:
        async for item in gen.stream(plan):
            if item is TICK:
                yield sse.ANTHROPIC_PING
            elif isinstance(item, Outcome):
                yield blocks.close()
                yield sse.anthropic_event({
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason(item), "stop_sequence": item.stop_sequence},
                    "usage": _usage(item), "mtplx_stats": item.mtplx_stats()})
                yield sse.anthropic_event({"type": "message_stop"})
            else:
                for event in item:
                    yield blocks.write(event)
    except Exception as exc:
        yield sse.anthropic_event(error_body(as_api_error(exc), ANTHROPIC))


class _BlockWriter:
    """Opens, fills and closes content blocks in Anthropic's event order."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: type | None = None

    def close(self) -> bytes:
        if self.open_kind is None:
            return b""
        self.open_kind = None
        return sse.anthropic_event({"type": "content_block_stop", "index": self.index})

    def write(self, event: Event) -> bytes:
        """The frames for one parser event. A tool call is its own block: opened by its
        start, filled by `input_json_delta` fragments, closed by its end."""
        if isinstance(event, ToolCallEvent):
            return self.close()
        if isinstance(event, ToolCallDelta):
            return self._delta({"type": "input_json_delta", "partial_json": event.text})
        out = b""
        if isinstance(event, ToolCallStart) or type(event) is not self.open_kind:
            out += self.close()
            self.index += 1
            self.open_kind = type(event)
            out += sse.anthropic_event({"type": "content_block_start", "index": self.index,
                                        "content_block": _empty_block(event)})
        if isinstance(event, ReasoningDelta):
            out += self._delta({"type": "thinking_delta", "thinking": event.text})
        elif isinstance(event, ContentDelta):
            out += self._delta({"type": "text_delta", "text": event.text})
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse.anthropic_event({"type": "content_block_delta", "index": self.index, "delta": delta})


def _empty_block(event: Event) -> dict[str, Any]:
    """The content block a `content_block_start` announces, before any delta."""
    if isinstance(event, ToolCallStart):
        return {"type": "tool_use", "id": _tool_id(event), "name": event.name, "input": {}}
    if isinstance(event, ReasoningDelta):
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}
