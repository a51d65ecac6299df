"""Streaming-safe parsing of model output into reasoning, content and tool calls.

One `OutputParser` serves every API dialect and both modes: a non-streamed response is the
parser fed the whole text at once, a streamed one is the same parser fed each delta, so the
events of the two concatenate to the same thing whatever the chunking (a hypothesis test
checks this). Markup that could still be a tag is held back until it is decided.

Recognised output:
- `<think> ... </think>` at the start of the output (or, when the prompt already opened
  `<think>`, everything up to `</think>`) becomes reasoning.
- tool-call blocks of the model's dialect (a `ToolDialect`: its open and close markers and a
  body parser) become tool calls. The default, Qwen's, is `<tool_call> ... </tool_call>` with
  a JSON body (`{"name": ..., "arguments": {...}}`) or Qwen's XML style
  (`<function=NAME><parameter=KEY>VALUE</parameter></function>`); LFM2's pythonic dialect
  lives in `pythonic_tools`. A Qwen call streams: `ToolCallStart` as soon as its name is
  known, `ToolCallDelta` argument fragments as they are decided (tool_stream.py), then the
  whole `ToolCallEvent`; the fragments join to its `arguments` byte for byte. LFM2's block of
  several calls streams through the dialect's `block` (pythonic_tools.PythonicBlock): a start
  at each `name(`, one fragment per complete keyword argument. A body that does not parse
  stays content, byte for byte; so does an unterminated block that never showed a name.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from mtplxd.api.tool_stream import (
    FORCED_JSON_HEADER, JsonArguments, XmlArguments, open_header, partial_suffix, strip_one_newline, typed_value,
)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


@dataclass
class ReasoningDelta:
    """Text of the model's reasoning (inside <think>)."""

    text: str


@dataclass
class ContentDelta:
    """Text of the answer."""

    text: str


@dataclass
class ToolCallStart:
    """A tool call opened: its id and name are known, its arguments follow in deltas."""

    index: int
    id: str
    name: str


@dataclass
class ToolCallDelta:
    """A fragment of the arguments of call `index`."""

    index: int
    text: str


@dataclass
class ToolCallEvent:
    """One complete tool call (it ends the call's Start and Deltas); `arguments` is the
    whole arguments string, a JSON object unless the model wrote malformed JSON."""

    index: int
    id: str
    name: str
    arguments: str


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallDelta | ToolCallEvent
STREAMED_CALL_PARTS = (ToolCallStart, ToolCallDelta)


@dataclass
class _OpenCall:
    """The call being streamed: its start and the argument text sent so far."""

    start: ToolCallStart
    arguments: JsonArguments | XmlArguments | None = None  # None: a block streams it
    sent: str = ""


class BlockStream(Protocol):
    """Streams one tool-call block that may hold several calls (LFM2's pythonic list)."""

    calls: int  # calls named so far

    def feed(self, text: str, final: bool = False) -> tuple[list[tuple[str, str]], int]:
        """Actions ("start", name) / ("arguments", fragment) / ("end", "") decided by the
        block's unconsumed `text` (`final`: the rest of the block), and characters consumed;
        nothing is consumed before the first call is named."""
        ...


@dataclass(frozen=True)
class ToolDialect:
    """How one model family writes tool calls: the block's markers and its body parser.

    parse(body, schemas) -> [(name, arguments JSON), ...] for a well-formed body (one block
    may hold several calls), or None: the block then stays content.
    """

    name: str
    open: str
    close: str
    parse: Callable[[str, dict[str, dict[str, Any]]], list[tuple[str, str]] | None]
    streams: bool = False  # arguments stream as decoded (tool_stream.py reads JSON and Qwen XML)
    block: Callable[[], BlockStream] | None = None  # streams a block of several calls instead


def new_call_id() -> str:
    """A fresh tool-call id in OpenAI's style."""
    return "call_" + secrets.token_hex(12)


def _partial_tag_suffix(text: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    return max((partial_suffix(text, tag) for tag in tags), default=0)


class OutputParser:
    """Turns generated text, fed in any chunking, into reasoning/content/tool-call events."""

    def __init__(self, *, parse_tools: bool, start_in_reasoning: bool = False,
                 tool_schemas: dict[str, dict[str, Any]] | None = None, raw: bool = False,
                 dialect: ToolDialect | None = None) -> None:
        """`raw`: plain text completion, every character is content (no markup, no trimming).
        `dialect`: the model's tool-call markup (default: Qwen's `<tool_call>`)."""
        self.parse_tools = parse_tools and not raw
        self.dialect = dialect or QWEN_TOOLS
        self.tool_schemas = tool_schemas or {}
        # "start": nothing but whitespace yet (a <think> may still open); "reasoning";
        # "content"; "tool": inside a <tool_call> block.
        self.mode = "reasoning" if start_in_reasoning else "start"
        self._buffer = ""          # undecided text (a possible tag, or a tool-call body)
        self._pending_ws = ""      # whitespace held back (dropped before a tool call / think end)
        self._reasoning_started = False
        self.reasoning_ended = False  # a </think> closed the reasoning
        self._content_started = raw
        self._call: _OpenCall | None = None
        self._block: BlockStream | None = None
        self._held: list[Event] = []  # events of a forced prefix, handed out with the first feed
        self.tool_calls = 0
        if raw:
            self.mode = "content"

    def feed_prefix(self, text: str) -> None:
        """Feed text the prompt already wrote (a forced call opener); its events (a call's
        start) come out of the next `feed` or `finish`. A forced call whose name the prompt
        wrote is a call from here on, whatever the model writes as its arguments."""
        self._held += self.feed(text)
        if self.mode == "tool" and self._call is None and self.dialect.streams and self.dialect.block is None:
            forced = FORCED_JSON_HEADER.fullmatch(self._buffer)
            if forced:
                self._open_call(self._held, "json", forced.group(1), forced.end())

    @property
    def in_reasoning(self) -> bool:
        """True while the text being produced is reasoning."""
        return self.mode == "reasoning"

    def feed(self, text: str) -> list[Event]:
        """Consume a delta; return the events that are now decided."""
        self._buffer += text
        events, self._held = self._held, []
        while True:
            before = (self.mode, len(self._buffer))
            getattr(self, f"_step_{self.mode}")(events)
            if (self.mode, len(self._buffer)) == before:
                return _merge(events)

    def finish(self) -> list[Event]:
        """The output ended: flush everything held back as what it is."""
        events, self._held = self._held, []
        if self.mode == "tool" and self.dialect.block is not None:
            text = self._buffer
            cut = len(text) - partial_suffix(text, self.dialect.close)
            self._close_block(events, text[:cut], text[cut:])
        elif self.mode == "tool" and self._call is not None:
            # Cut off mid-call (max_tokens): it was announced, so it ends as a call.
            close = self.dialect.close
            self._end_call(events, self._buffer[:len(self._buffer) - partial_suffix(self._buffer, close)])
        elif self.mode == "tool":
            # An unterminated block that never named a function is not a call: give its
            # text back as content.
            self._emit_content(events, self._pending_ws + self.dialect.open + self._buffer)
        elif self.mode == "reasoning":
            self._emit_reasoning(events, (self._pending_ws if self._buffer else "") + self._buffer)
        elif self.mode == "start" or not self._content_started:
            self._emit_content(events, (self._pending_ws + self._buffer).lstrip())
        elif self._buffer or self._pending_ws:
            self._emit_content(events, self._pending_ws + self._buffer)
        self._buffer = self._pending_ws = ""
        self.mode = "content"
        return _merge(events)

    # -- states -------------------------------------------------------------------------

    def _step_start(self, events: list[Event]) -> None:
        stripped = self._buffer.lstrip()
        if not stripped:
            return
        if stripped.startswith(THINK_OPEN):
            self._buffer = stripped[len(THINK_OPEN):]
            self.mode = "reasoning"
            return
        if THINK_OPEN.startswith(stripped):
            return  # could still become <think>
        self.mode = "content"

    def _step_reasoning(self, events: list[Event]) -> None:
        if not self._reasoning_started:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return
        end = self._buffer.find(THINK_CLOSE)
        if end >= 0:
            body = self._buffer[:end].rstrip()
            if body:
                self._emit_reasoning(events, self._pending_ws + body)
            self._buffer = self._buffer[end + len(THINK_CLOSE):]
            self.mode = "content"
            self.reasoning_ended = True
            self._pending_ws = ""
            return
        keep = _partial_tag_suffix(self._buffer, [THINK_CLOSE])
        body = self._buffer[:len(self._buffer) - keep]
        # Trailing whitespace waits: it is dropped if </think> follows.
        decided = body.rstrip()
        tail = body[len(decided):]
        if decided:
            self._emit_reasoning(events, self._pending_ws + decided)
            self._pending_ws = ""
        self._pending_ws += tail
        self._buffer = self._buffer[len(body):]

    def _step_content(self, events: list[Event]) -> None:
        if not self._content_started:
            # The whitespace between </think> and the answer is layout, not content.
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return
        if self.parse_tools:
            opener = self.dialect.open
            start = self._buffer.find(opener)
            if start >= 0:
                self._emit_held_content(events, self._buffer[:start])
                self._buffer = self._buffer[start + len(opener):]
                self.mode = "tool"
                return
            keep = _partial_tag_suffix(self._buffer, [opener])
        else:
            keep = 0
        self._emit_held_content(events, self._buffer[:len(self._buffer) - keep], hold_ws=self.parse_tools)
        self._buffer = self._buffer[len(self._buffer) - keep:]

    def _step_tool(self, events: list[Event]) -> None:
        if self.dialect.block is not None:
            self._stream_block(events)
            return
        if self._call is not None:
            self._stream_call(events)
            return
        opener, closer = self.dialect.open, self.dialect.close
        end = self._buffer.find(closer)
        if self.dialect.streams:
            header = open_header(self._buffer if end < 0 else self._buffer[:end])
            if header is not None:
                self._open_call(events, *header)
                return
        if end < 0:
            return
        body = self._buffer[:end]
        self._buffer = self._buffer[end + len(closer):]
        self.mode = "content"
        calls = self.dialect.parse(body, self.tool_schemas)
        if not calls:
            self._emit_content(events, self._pending_ws + opener + body + closer)
            self._pending_ws = ""
            return
        self._pending_ws = ""  # whitespace before a call is layout
        for name, arguments in calls:
            start = ToolCallStart(self.tool_calls, new_call_id(), name)
            events.extend([start, ToolCallDelta(start.index, arguments)])
            self._call = _OpenCall(start, JsonArguments(), arguments)
            self._end_call(events, "")

    def _open_call(self, events: list[Event], style: str, name: str, header_size: int) -> None:
        start = ToolCallStart(self.tool_calls, new_call_id(), name)
        arguments = JsonArguments() if style == "json" else XmlArguments(self.tool_schemas.get(name) or {})
        self._call = _OpenCall(start, arguments)
        self._buffer = self._buffer[header_size:]
        self._pending_ws = ""  # whitespace before a call is layout
        events.append(start)

    def _stream_call(self, events: list[Event]) -> None:
        end = self._buffer.find(self.dialect.close)
        if end >= 0:
            body = self._buffer[:end]
            self._buffer = self._buffer[end + len(self.dialect.close):]
            self._end_call(events, body)
            return
        visible = self._buffer[:len(self._buffer) - partial_suffix(self._buffer, self.dialect.close)]
        assert self._call is not None
        piece, used = self._call.arguments.feed(visible)
        self._buffer = self._buffer[used:]
        self._send_arguments(events, piece)

    def _stream_block(self, events: list[Event]) -> None:
        close = self.dialect.close
        end = self._buffer.find(close)
        if end >= 0:
            body = self._buffer[:end]
            self._buffer = self._buffer[end + len(close):]
            self._close_block(events, body, close)
            return
        visible = self._buffer[:len(self._buffer) - partial_suffix(self._buffer, close)]
        actions, used = self._open_block().feed(visible)
        self._buffer = self._buffer[used:]
        self._apply_block(events, actions)

    def _close_block(self, events: list[Event], body: str, closer: str) -> None:
        """The block ended with `body` unconsumed (`closer`: its close marker, or what the
        output ended with of it): end its calls, or give it back as content when it never
        named one."""
        block = self._open_block()
        self._block = None
        actions, _ = block.feed(body, final=True)
        self.mode = "content"
        if block.calls:
            self._apply_block(events, actions)
            return
        self._emit_content(events, self._pending_ws + self.dialect.open + body + closer)
        self._pending_ws = ""

    def _open_block(self) -> BlockStream:
        if self._block is None:
            assert self.dialect.block is not None
            self._block = self.dialect.block()
        return self._block

    def _apply_block(self, events: list[Event], actions: list[tuple[str, str]]) -> None:
        for kind, text in actions:
            if kind == "start":
                self._call = _OpenCall(ToolCallStart(self.tool_calls, new_call_id(), text))
                self._pending_ws = ""  # whitespace before a call is layout
                events.append(self._call.start)
            elif kind == "arguments":
                self._send_arguments(events, text)
            else:
                self._finish_call(events)

    def _send_arguments(self, events: list[Event], piece: str) -> None:
        if piece and self._call is not None:
            self._call.sent += piece
            events.append(ToolCallDelta(self._call.start.index, piece))

    def _end_call(self, events: list[Event], rest: str) -> None:
        """The call's text ended with `rest` not yet consumed: send the last fragment and
        the whole call."""
        call = self._call
        assert call is not None and call.arguments is not None
        piece, used = call.arguments.feed(rest)
        self._send_arguments(events, piece + call.arguments.close(rest[used:]))
        self._finish_call(events)
        self.mode = "content"

    def _finish_call(self, events: list[Event]) -> None:
        """The open call's arguments are all sent: emit the whole call."""
        call = self._call
        assert call is not None
        events.append(ToolCallEvent(call.start.index, call.start.id, call.start.name, call.sent))
        self._call = None
        self.tool_calls += 1
        # Whitespace between consecutive calls is layout too.
        self._content_started = False

    # -- emitting -----------------------------------------------------------------------

    def _emit_held_content(self, events: list[Event], text: str, hold_ws: bool = True) -> None:
        """Emit content, holding back trailing whitespace (it may precede a tool call)."""
        if not text:
            return
        decided = text.rstrip() if hold_ws else text
        if decided:
            self._emit_content(events, self._pending_ws + decided)
            self._pending_ws = ""
        self._pending_ws += text[len(decided):]

    def _emit_content(self, events: list[Event], text: str) -> None:
        if text:
            self._content_started = True
            events.append(ContentDelta(text))

    def _emit_reasoning(self, events: list[Event], text: str) -> None:
        if text:
            self._reasoning_started = True
            events.append(ReasoningDelta(text))


def _merge(events: list[Event]) -> list[Event]:
    """Join adjacent deltas of the same kind (fewer, larger SSE frames)."""
    merged: list[Event] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, ToolCallDelta) and isinstance(last, ToolCallDelta) and last.index == event.index:
            merged[-1] = ToolCallDelta(event.index, last.text + event.text)
        elif last is not None and type(event) is type(last) and isinstance(event, (ContentDelta, ReasoningDelta)):
            merged[-1] = type(event)(last.text + event.text)  # type: ignore[union-attr]
        else:
            merged.append(event)
    return merged


_XML_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def parse_tool_call_body(body: str, schemas: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    """(name, arguments JSON) from a <tool_call> body in JSON or Qwen XML style, else None."""
    stripped = body.strip()
    if stripped.startswith("{"):
        return _parse_json_call(stripped)
    match = _XML_FUNCTION.match(stripped)
    if match:
        return _parse_xml_call(match.group(1).strip(), match.group(2), schemas)
    return None


def _parse_qwen_block(body: str, schemas: dict[str, dict[str, Any]]) -> list[tuple[str, str]] | None:
    call = parse_tool_call_body(body, schemas)
    return [call] if call else None


QWEN_TOOLS = ToolDialect("qwen", TOOL_OPEN, TOOL_CLOSE, _parse_qwen_block, streams=True)


def _parse_json_call(text: str) -> tuple[str, str] | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return data["name"], json.dumps(arguments, ensure_ascii=False)


def _parse_xml_call(name: str, inner: str, schemas: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    properties = (schemas.get(name) or {}).get("properties") or {}
    arguments: dict[str, Any] = {}
    rest = _XML_PARAMETER.sub("", inner)
    if rest.strip():
        return None  # stray text inside <function>: not a well-formed call
    for key, raw in _XML_PARAMETER.findall(inner):
        key = key.strip()
        arguments[key] = typed_value(strip_one_newline(raw), (properties.get(key) or {}))
    return name, json.dumps(arguments, ensure_ascii=False)


@dataclass
class ParsedOutput:
    """A whole response: reasoning, content and calls, as the non-streamed APIs return it."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallEvent] = field(default_factory=list)
    blocks: list[Event] = field(default_factory=list)  # in order, same-kind neighbours merged;
    # a call is its ToolCallEvent here (its Start and Deltas are left out)


def collect(events: Iterable[Event]) -> ParsedOutput:
    """Fold a sequence of events into a ParsedOutput."""
    out = ParsedOutput()
    events = [e for e in events if not isinstance(e, STREAMED_CALL_PARTS)]
    for event in events:
        if isinstance(event, ReasoningDelta):
            out.reasoning += event.text
        elif isinstance(event, ContentDelta):
            out.content += event.text
        else:
            out.tool_calls.append(event)
    out.blocks = _merge(events)
    return out


def parse_text(text: str, *, parse_tools: bool, start_in_reasoning: bool = False,
               tool_schemas: dict[str, dict[str, Any]] | None = None,
               prefix: str = "", dialect: ToolDialect | None = None) -> ParsedOutput:
    """Parse a whole output at once (the non-streamed path)."""
    parser = OutputParser(parse_tools=parse_tools, start_in_reasoning=start_in_reasoning,
                          tool_schemas=tool_schemas, dialect=dialect)
    parser.feed_prefix(prefix)
    events = parser.feed(text) + parser.finish()
    return collect(events)
