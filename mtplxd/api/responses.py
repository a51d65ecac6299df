"""OpenAI `/v1/responses`, stateless (what Codex speaks).

Every request carries its whole conversation (`input` items + `instructions`); nothing is
stored, so `previous_response_id` is refused. Function, custom (freeform) and namespace
tools reach the model; hosted tools this daemon cannot run (`web_search`,
`image_generation`, `file_search`, ...) are declared-only: they are dropped with a warning
(log line and an `X-MTPLX-Ignored-Tools` header), because a model that is never told about
a tool cannot call it. A request that *forces* a hosted tool through `tool_choice` gets a
400 naming the tool and the Codex setting that turns it off.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any, AsyncIterator

from quart import Response

from mtplxd.api import chat_format, sse
from mtplxd.api.errors import APIError, invalid
from mtplxd.api.openai import as_api_error
from mtplxd.api.logprobs import LogprobItems, chat_content
from mtplxd.api.parsers import (
    ContentDelta, Event, ReasoningDelta, ToolCallDelta, ToolCallEvent, ToolCallStart,
)
from mtplxd.api.schemas import (
    Conversation, GenParams, Reader, arguments_object, function_tool, read_sampling, text_of,
)
from mtplxd.api.service import TICK, Generations, Outcome, Plan

log = logging.getLogger(__name__)

HOSTED_TOOLS = {
    "web_search": 'set `web_search = "disabled"` in Codex config.toml',
    "web_search_preview": 'set `web_search = "disabled"` in Codex config.toml',
    "image_generation": "set `[features] image_generation = false` in Codex config.toml",
    "file_search": "remove the file_search tool from the request",
    "code_interpreter": "remove the code_interpreter tool from the request",
    "computer_use_preview": "remove the computer_use_preview tool from the request",
    "computer": "remove the computer tool from the request",
    "mcp": "run MCP servers on the client side (Codex does this by default)",
    "local_shell": "use Codex's default shell tool (a function tool) instead of local_shell",
    "tool_search": "remove the tool_search tool from the request",
}
NAMESPACE_SEPARATOR = "__"


class ToolMap:
    """Chat-format tools for the model and how to turn a model's call back into an item."""

    def __init__(self) -> None:
        self.tools: list[dict[str, Any]] = []
        self.kinds: dict[str, tuple[str, str, str | None]] = {}  # flat -> (kind, name, namespace)
        self.ignored: list[str] = []

    def add(self, raw: Any, where: str, namespace: str | None = None) -> None:
        tool = Reader(raw, where)
        kind = tool.str("type", required=True)
        if kind == "function":
            self._add(tool.str("name", required=True), "function", namespace,
                      function_tool(tool.raw("name"), tool.raw("description"), tool.raw("parameters"), where))
        elif kind == "custom":
            name = tool.str("name", required=True)
            schema = {"type": "object", "properties": {"input": {
                "type": "string", "description": "the tool's freeform input"}}, "required": ["input"]}
            self._add(name, "custom", namespace, function_tool(name, tool.raw("description"), schema, where))
        elif kind == "namespace" and namespace is None:
            ns = tool.str("name", required=True)
            for i, inner in enumerate(tool.list("tools")):
                self.add(inner, f"{where}.tools[{i}]", namespace=ns)
        elif kind in HOSTED_TOOLS:
            self.ignored.append(kind)
        else:
            raise invalid(f"`{where}.type` {kind!r} is not a tool type this server supports "
                          "(function, custom, namespace)", f"{where}.type", code="unsupported_tool")

    def _add(self, name: str, kind: str, namespace: str | None, tool: dict[str, Any]) -> None:
        flat = flat_name(name, namespace)
        tool["function"]["name"] = flat
        self.tools.append(tool)
        self.kinds[flat] = (kind, name, namespace)

    def item_for(self, call: ToolCallStart | ToolCallEvent) -> dict[str, Any]:
        """The output item for a model's tool call: complete for a ToolCallEvent, in progress
        with empty arguments for a ToolCallStart (a stream fills it with `complete`)."""
        kind, name, namespace = self.kinds.get(call.name, ("function", call.name, None))
        item: dict[str, Any]
        if kind == "custom":
            item = {"type": "custom_tool_call", "id": "ctc_" + call.id[5:], "call_id": call.id,
                    "name": name, "input": "", "status": "in_progress"}
        else:
            item = {"type": "function_call", "id": "fc_" + call.id[5:], "call_id": call.id,
                    "name": name, "arguments": "", "status": "in_progress"}
        if namespace:
            item["namespace"] = namespace
        if isinstance(call, ToolCallEvent):
            complete(item, call.arguments)
        return item


def complete(item: dict[str, Any], arguments: str) -> None:
    """Fill a call item with the call's whole arguments (a custom tool's `input` is the text
    the model put under `input`, or the raw arguments when it wrote something else)."""
    if item["type"] == "custom_tool_call":
        try:
            args = json.loads(arguments)
        except ValueError:
            args = None
        text = args.get("input") if isinstance(args, dict) else None
        item["input"] = text if isinstance(text, str) else arguments
    else:
        item["arguments"] = arguments
    item["status"] = "completed"


def flat_name(name: str, namespace: str | None) -> str:
    """The one name the model sees for a (possibly namespaced) tool."""
    if not namespace or name.startswith(namespace + NAMESPACE_SEPARATOR):
        return name
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def parse_responses_request(data: dict[str, Any]) -> tuple[str | None, Conversation, GenParams, bool, ToolMap]:
    """(model, conversation, params, stream, tool map) from a Responses body."""
    body = Reader(data)
    if body.has("previous_response_id"):
        raise invalid("this server is stateless: `previous_response_id` is not supported; send the "
                      "whole conversation in `input` (Codex does with `store = false`)",
                      "previous_response_id", code="unsupported_parameter")
    model = body.str("model")
    tools = ToolMap()
    for i, raw in enumerate(body.list("tools")):
        tools.add(raw, f"tools[{i}]")
    messages: list[dict[str, Any]] = []
    instructions = body.str("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    raw_input = body.raw("input")
    if isinstance(raw_input, str):
        messages.append({"role": "user", "content": raw_input})
    elif isinstance(raw_input, list):
        for i, item in enumerate(raw_input):
            _add_item(messages, item, f"input[{i}]", tools)
    else:
        raise invalid("`input` must be a string or an array of items", "input")
    if not any(m["role"] != "system" for m in messages):
        raise invalid("`input` must contain at least one message", "input")
    conversation = Conversation(messages=messages, tools=tools.tools,
                                tool_choice=_tool_choice(body, tools))
    reasoning = body.obj("reasoning")
    if reasoning is not None:
        conversation.enable_thinking = chat_format.thinking_for_effort(
            reasoning.str("effort"), "reasoning.effort")
        conversation.reasoning_effort = reasoning.str("effort")
        conversation.effort_param = "reasoning.effort"
    text = body.obj("text")
    fmt = text.obj("format") if text else None
    if fmt is not None and fmt.str("type", "text") != "text":
        raise APIError(400, f"`text.format` {fmt.str('type')!r} is not supported: this server has no "
                            "constrained decoding", code="unsupported_parameter", param="text.format")
    params = GenParams()
    read_sampling(body, params)
    params.max_tokens = body.int("max_output_tokens", low=1)
    params.logprobs = _wanted_logprobs(body)
    return model, conversation, params, bool(body.bool("stream", False)), tools


def _wanted_logprobs(body: Reader) -> int | None:
    """`include: ["message.output_text.logprobs"]` and/or `top_logprobs` (0-20): how many
    alternatives per generated token's logprob; None = no logprobs."""
    top = body.int("top_logprobs", low=0, high=20)
    include = body.list("include")
    if top is None and "message.output_text.logprobs" not in include:
        return None
    return top or 0


def _add_item(messages: list[dict[str, Any]], raw: Any, where: str, tools: ToolMap) -> None:
    item = Reader(raw, where)
    kind = item.str("type", "message")
    if kind == "message":
        role = item.str("role", required=True, choices=("user", "assistant", "system", "developer"))
        role = "system" if role == "developer" else role
        messages.append({"role": role, "content": text_of(item.raw("content"), f"{where}.content",
                                                          text_types=("input_text", "output_text", "text",
                                                                      "refusal"),
                                                          images=role == "user")})
    elif kind in ("function_call", "custom_tool_call"):
        name = flat_name(item.str("name", required=True), item.str("namespace"))
        if kind == "function_call":
            arguments = arguments_object(item.raw("arguments") or "{}", f"{where}.arguments")
        else:
            arguments = {"input": item.str("input", "")}
        call = {"id": item.str("call_id", ""), "type": "function",
                "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = item.raw("output")
        content = output if isinstance(output, str) else text_of(output, f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item.str("call_id", ""), "content": content})
    elif kind == "reasoning":
        return  # earlier reasoning: the chat templates drop it from history anyway
    else:
        raise invalid(f"`{where}.type` {kind!r} is not an input item this server understands "
                      "(message, function_call, function_call_output, custom_tool_call, "
                      "custom_tool_call_output, reasoning)", f"{where}.type")


def _tool_choice(body: Reader, tools: ToolMap) -> str | dict[str, Any]:
    choice = body.raw("tool_choice")
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise invalid("`tool_choice` must be auto, none, required or a tool", "tool_choice")
        if choice == "required" and not tools.tools:
            raise invalid("`tool_choice` is required but no function tools were given", "tool_choice")
        return choice
    reader = Reader(choice, "tool_choice")
    kind = reader.str("type", required=True)
    if kind in HOSTED_TOOLS:
        raise invalid(f"`tool_choice` forces the hosted tool {kind!r}, which this server cannot run; "
                      f"{HOSTED_TOOLS[kind]}", "tool_choice", code="unsupported_tool")
    if kind in ("function", "custom"):
        name = flat_name(reader.str("name", required=True), reader.str("namespace"))
        if name not in tools.kinds:
            raise invalid(f"`tool_choice.name` {name!r} is not among `tools`", "tool_choice.name")
        return {"name": name}
    if kind == "allowed_tools":
        return reader.str("mode", "auto", choices=("auto", "required"))
    raise invalid(f"`tool_choice.type` {kind!r} is not supported", "tool_choice.type")


# -- rendering ----------------------------------------------------------------------------

class _Items:
    """Builds output items from parser events, for both the streamed and the whole response."""

    def __init__(self, tools: ToolMap) -> None:
        self.tools = tools
        self.items: list[dict[str, Any]] = []

    def new_item(self, event: Event) -> dict[str, Any]:
        suffix = secrets.token_hex(12)
        if isinstance(event, ReasoningDelta):
            item = {"type": "reasoning", "id": "rs_" + suffix, "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        elif isinstance(event, ContentDelta):
            item = {"type": "message", "id": "msg_" + suffix, "status": "in_progress", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        else:
            item = self.tools.item_for(event)
        self.items.append(item)
        return item


def _response_object(response_id: str, plan: Plan, status: str, output: list[dict[str, Any]],
                     body: dict[str, Any], outcome: Outcome | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": plan.created, "status": status,
        "model": plan.model_id, "output": output, "parallel_tool_calls": True,
        # The request's own tools and sampling, as OpenAI echoes them; nothing is stored.
        "tool_choice": body.get("tool_choice", "auto"), "store": False,
        "tools": body["tools"] if isinstance(body.get("tools"), list) else [],
        # Both were read by read_sampling at parse time: a number here, or absent.
        "temperature": Reader(body).float("temperature"), "top_p": Reader(body).float("top_p"),
        "instructions": body.get("instructions") if isinstance(body.get("instructions"), str) else None,
        "max_output_tokens": plan.max_tokens, "incomplete_details": None, "error": None,
        "usage": None,
    }
    if outcome is not None:
        stats = outcome.result.stats
        obj["usage"] = {
            "input_tokens": stats.prompt_tokens,
            "input_tokens_details": {"cached_tokens": stats.cached_tokens},
            "output_tokens": stats.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": outcome.reasoning_tokens},
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        }
        if outcome.result.finish_reason == "length":
            obj["status"] = "incomplete"
            obj["incomplete_details"] = {"reason": "max_output_tokens"}
        obj["mtplx_stats"] = outcome.mtplx_stats()
    return obj


def _finished(item: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """`item` with its final status: "incomplete" for the one the output cap cut off (a call's
    arguments may then be cut mid-JSON: an agent must not run it as if whole)."""
    if "status" in item:
        item["status"] = status
    return item


def _headers(plan: Plan, tools: ToolMap) -> dict[str, str]:
    headers = plan.headers()
    if tools.ignored:
        headers["X-MTPLX-Ignored-Tools"] = ",".join(tools.ignored)
    return headers


async def responses(gen: Generations, data: dict[str, Any]) -> Response | tuple[dict, int, dict]:
    """POST /v1/responses."""
    model, conversation, params, stream, tools = parse_responses_request(data)
    if tools.ignored:
        log.warning("ignoring hosted tools this daemon cannot run: %s", ", ".join(tools.ignored))
    plan = await gen.plan_chat("responses", model, conversation, params)
    response_id = "resp_" + secrets.token_hex(12)
    if stream:
        await gen.open_stream(plan)
        return sse.sse_response(_stream(gen, plan, response_id, data, tools), _headers(plan, tools))
    outcome = await gen.complete(plan)
    items = _Items(tools)
    logprobs = chat_content(await gen.show_logprobs(outcome.logprobs)) if outcome.logprobs is not None else []
    for event in outcome.parsed.blocks:
        item = items.new_item(event)
        if isinstance(event, ReasoningDelta):
            item["content"][0]["text"] = event.text
        elif isinstance(event, ContentDelta):
            item["content"][0]["text"] = event.text
            # Every generated token's logprob, in order, goes with the (first) answer text.
            item["content"][0]["logprobs"], logprobs = logprobs, []
        _finished(item)
    if outcome.result.finish_reason == "length" and items.items:
        _finished(items.items[-1], "incomplete")  # the item the cap cut off
    body = _response_object(response_id, plan, "completed", items.items, data, outcome)
    return body, 200, _headers(plan, tools)


async def _stream(gen: Generations, plan: Plan, response_id: str, body: dict[str, Any],
                  tools: ToolMap) -> AsyncIterator[bytes]:
    events = sse.ResponsesEvents()
    items = _Items(tools)
    yield events.frame("response.created", {"response": _response_object(response_id, plan, "in_progress", [], body)})
    yield events.frame("response.in_progress", {"response": _response_object(response_id, plan, "in_progress", [], body)})
    writer = _StreamWriter(events, items)
    try:
        async for item in gen.stream(plan):
            if item is TICK:
                yield sse.COMMENT_KEEPALIVE
            elif isinstance(item, LogprobItems):
                writer.logprobs += chat_content(await gen.show_logprobs(item.entries))
            elif isinstance(item, Outcome):
                yield writer.finish(cut=item.result.finish_reason == "length")
                final = _response_object(response_id, plan, "completed", items.items, body, item)
                name = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                yield events.frame(name, {"response": final})
            else:
                for event in item:
                    yield writer.write(event)
    except Exception as exc:
        error = as_api_error(exc)
        failed = _response_object(response_id, plan, "failed", items.items, body)
        failed["error"] = {"code": error.code or "server_error", "message": error.message}
        yield events.frame("response.failed", {"response": failed})


class _StreamWriter:
    """Emits the Responses event sequence for each output item as parser events arrive."""

    def __init__(self, events: sse.ResponsesEvents, items: _Items) -> None:
        self.events = events
        self.items = items
        self.logprobs: list[dict[str, Any]] = []  # decoded tokens' logprobs not sent yet
        self.current: dict[str, Any] | None = None
        self.kind: type | None = None

    @property
    def index(self) -> int:
        return len(self.items.items) - 1

    def finish(self, cut: bool = False) -> bytes:
        """Close the open item at the end of the stream, "incomplete" when the output cap
        (`cut`) ended it. Tokens decoded after the last message closed (a trailing tool call,
        the end-of-turn token) no text delta can carry; their logprobs join the last message's
        part, as the whole response puts every token's."""
        out = self.close("incomplete" if cut else "completed")
        messages = [item for item in self.items.items if item["type"] == "message"]
        if messages and self.logprobs:
            messages[-1]["content"][0]["logprobs"].extend(self.logprobs)
            self.logprobs = []
        return out

    def close(self, status: str = "completed") -> bytes:
        item, self.current, self.kind = self.current, None, None
        if item is None:
            return b""
        out = b""
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            done: dict[str, Any] = {"item_id": item["id"], "output_index": self.index, "content_index": 0,
                                    "text": part["text"]}
            if item["type"] == "message":
                # Tokens decoded after the last text delta (held-back text, the end-of-turn
                # token): their logprobs belong to this text too; the done event has them all.
                part["logprobs"].extend(self.logprobs)
                self.logprobs = []
                done["logprobs"] = part["logprobs"]
            name = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            out += self.events.frame(name, done)
            out += self.events.frame("response.content_part.done", {
                "item_id": item["id"], "output_index": self.index, "content_index": 0, "part": part})
        return out + self.events.frame("response.output_item.done",
                                       {"output_index": self.index, "item": _finished(item, status)})

    def write(self, event: Event) -> bytes:
        """The frames for one parser event. A function call's arguments stream as
        `function_call_arguments.delta`; a custom tool's input is the `input` field inside
        the model's JSON, so it is sent whole when the call ends."""
        if isinstance(event, ToolCallDelta):
            return self._arguments_delta(event.text)
        if isinstance(event, ToolCallEvent):
            return self._end_call(event)
        out = b""
        if isinstance(event, ToolCallStart) or type(event) is not self.kind:
            out += self.close()
            item = self.items.new_item(event)
            self.current, self.kind = item, type(event)
            out += self.events.frame("response.output_item.added",
                                     {"output_index": self.index, "item": json.loads(json.dumps(item))})
            if item["type"] in ("message", "reasoning"):
                out += self.events.frame("response.content_part.added", {
                    "item_id": item["id"], "output_index": self.index, "content_index": 0,
                    "part": dict(item["content"][0])})
        item = self.current
        assert item is not None
        if isinstance(event, (ContentDelta, ReasoningDelta)):
            item["content"][0]["text"] += event.text
            name = "response.output_text.delta" if isinstance(event, ContentDelta) else "response.reasoning_text.delta"
            extra: dict[str, Any] = {}
            if isinstance(event, ContentDelta):
                # The logprobs of every token decoded since the last text delta (reasoning and
                # call tokens included) ride on the next one.
                extra["logprobs"], self.logprobs = self.logprobs, []
                item["content"][0]["logprobs"].extend(extra["logprobs"])
            out += self.events.frame(name, {"item_id": item["id"], "output_index": self.index,
                                            "content_index": 0, "delta": event.text, **extra})
        return out

    def _arguments_delta(self, text: str) -> bytes:
        item = self.current
        if item is None or item["type"] != "function_call":
            return b""
        return self.events.frame("response.function_call_arguments.delta", {
            "item_id": item["id"], "output_index": self.index, "delta": text})

    def _end_call(self, call: ToolCallEvent) -> bytes:
        item = self.current
        assert item is not None
        complete(item, call.arguments)
        if item["type"] == "function_call":
            out = self.events.frame("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": self.index, "arguments": item["arguments"],
                "name": item["name"]})
        else:
            out = self.events.frame("response.custom_tool_call_input.delta", {
                "item_id": item["id"], "output_index": self.index, "delta": item["input"]})
            out += self.events.frame("response.custom_tool_call_input.done", {
                "item_id": item["id"], "output_index": self.index, "input": item["input"]})
        # The item stays open until the next one starts or the stream ends: only then is it
        # known whether the output cap cut it (finish), and its output_item.done says so.
        return out
