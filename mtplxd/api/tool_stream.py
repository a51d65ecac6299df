"""A tool call's arguments, streamed as the model writes them.

Once a `<tool_call>` body has shown its function name (JSON: `{"name": "N", "arguments": {`,
Qwen XML: `<function=N>`), the call is committed: the parser announces it and from then on
hands out argument fragments as they are decided. The fragments concatenate to exactly the
call's final `arguments` string, whatever the chunking, because every decision here depends
only on text already seen (never on how it was cut):

- JSON bodies stream the model's own argument text (the object after `"arguments":`), minus
  the body's closing `}` and the whitespace around it, which are held back until the next
  character shows whether they were the end. The result is the model's text verbatim; when
  it is not a JSON object (malformed, or cut off by max_tokens) the call still ends, with
  that raw text as its arguments.
- XML bodies are rendered to a JSON object as they arrive: `{"key": ` when a parameter opens,
  a string value JSON-escaped piece by piece (escaping is per character, so pieces join to
  the whole value's escape), a typed value (schema says integer, object, ...) whole when its
  `</parameter>` arrives, `}` at `</function>`. Stray text between parameters is dropped, so
  the arguments are always a JSON object, even when the output is cut off mid-value.
"""

from __future__ import annotations

import json
import re
from typing import Any

TOOL_CLOSE = "</tool_call>"
PARAM_CLOSE = "</parameter>"
FUNCTION_CLOSE = "</function>"

# The committed header of each body style. The JSON one ends just before the arguments'
# `{` (a lookahead, so a header never depends on text that has not arrived yet; a model that
# writes its arguments as a JSON string is read whole at the block's end instead). The same
# header written by the prompt (a forced call's opener) is committed whatever follows it.
_JSON_HEAD = r'\s*\{\s*"name"\s*:\s*"([^"\\<>\n]+)"\s*,\s*"arguments"\s*:\s*'
JSON_HEADER = re.compile(_JSON_HEAD + r"(?=\{)")
FORCED_JSON_HEADER = re.compile(_JSON_HEAD)
XML_HEADER = re.compile(r"\s*<function=([^>\n<]+)>")
XML_PARAMETER = re.compile(r"<parameter=([^>\n<]+)>")
TYPED_KINDS = {"integer", "number", "boolean", "object", "array", "null"}


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def escape_piece(text: str) -> str:
    """`text` as the inside of a JSON string (no quotes)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def typed_value(raw: str, schema: dict[str, Any]) -> Any:
    """XML parameter values are text; the tool's JSON schema says what type they are."""
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kinds & TYPED_KINDS or (not kinds - {None} and raw.strip()[:1] in ("{", "[")):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def strip_one_newline(value: str) -> str:
    """Qwen XML puts the value on its own lines: one newline each side is layout."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def open_header(buffer: str) -> tuple[str, str, int] | None:
    """(style, function name, header length) when `buffer` starts with a committed header."""
    match = JSON_HEADER.match(buffer)
    if match:
        return "json", match.group(1), match.end()
    match = XML_HEADER.match(buffer)
    if match:
        return "xml", match.group(1).strip(), match.end()
    return None


def _may_become_tag(text: str) -> bool:
    """`text` (starting with `<`) may still grow into `<parameter=K>` or `</function>`."""
    if FUNCTION_CLOSE.startswith(text) or "<parameter=".startswith(text):
        return True
    return text.startswith("<parameter=") and not re.search(r"[>\n<]", text[len("<parameter="):])


class JsonArguments:
    """Streams the model's own JSON argument text out of a `{"name": ..., "arguments": ...}` body."""

    def feed(self, text: str) -> tuple[str, int]:
        """`text`: the unconsumed text after the header. Returns (fragment, characters consumed):
        all but a trailing `}` and the whitespace around it, which may be the body's end."""
        piece = settled(text)
        return piece, len(piece)

    def close(self, rest: str) -> str:
        """The call ended with `rest` unconsumed: its argument text without the body's `}`."""
        return settled(rest)


def settled(body: str) -> str:
    """`body` without its trailing whitespace, one closing `}` and the whitespace before it:
    that much may be the outer object's end, everything before it is argument text.
    Appending text never shortens the result, so what was sent stays a prefix."""
    text = body.rstrip()
    if text.endswith("}"):
        text = text[:-1].rstrip()
    return text


class XmlArguments:
    """Renders `<parameter=K>V</parameter>...</function>` to a JSON object, piece by piece."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.properties = (schema or {}).get("properties") or {}
        self.state = "between"   # between | value | done
        self.params = 0
        self.key = ""
        self.mode = ""           # value: "" undecided, "string" streamed, "typed" held
        self.value_started = False
        self.closed_object = False

    def feed(self, buffer: str) -> tuple[str, int]:
        """Consume what is decided of `buffer` (text after the header, before `</tool_call>`);
        return (fragment, characters consumed)."""
        out: list[str] = []
        used = 0
        while True:
            step = getattr(self, f"_step_{self.state}")(buffer[used:], out)
            if step == 0:
                return "".join(out), used
            used += step

    def close(self, rest: str) -> str:
        """The call ended (`</tool_call>` or end of output) with `rest` unconsumed: close
        whatever is open so the arguments are a JSON object."""
        out: list[str] = []
        if self.state == "value":
            self._finish_value(rest, out)
        if not self.closed_object:
            out.append("{}" if not self.params else "}")
            self.closed_object = True
        self.state = "done"
        return "".join(out)

    # -- states ------------------------------------------------------------------------

    def _step_between(self, text: str, out: list[str]) -> int:
        stripped = text.lstrip()
        skipped = len(text) - len(stripped)
        if not stripped:
            return skipped
        match = XML_PARAMETER.match(stripped)
        if match:
            self.key = match.group(1).strip()
            out.append(("{" if not self.params else ", ") + json.dumps(self.key, ensure_ascii=False) + ": ")
            self.params += 1
            self.state, self.mode, self.value_started = "value", "", False
            return skipped + match.end()
        if stripped.startswith(FUNCTION_CLOSE):
            out.append("{}" if not self.params else "}")
            self.closed_object = True
            self.state = "done"
            return skipped + len(FUNCTION_CLOSE)
        if _may_become_tag(stripped):
            return skipped
        # Stray text between parameters: dropped up to the next tag.
        nxt = stripped.find("<", 1)
        return skipped + (len(stripped) if nxt < 0 else nxt)

    def _step_value(self, text: str, out: list[str]) -> int:
        end = text.find(PARAM_CLOSE)
        if end >= 0:
            self._finish_value(text[:end], out)
            self.state = "between"
            return end + len(PARAM_CLOSE)
        if not self.mode:
            self.mode = self._decide_mode(text)
            if not self.mode:
                return 0
        if self.mode == "typed":
            return 0  # held whole until </parameter>
        # String: stream all but a possible closing tag and the newline before it.
        keep = partial_suffix(text, PARAM_CLOSE)
        body = text[:len(text) - keep]
        if body.endswith("\n"):
            body = body[:-1]
        if not self.value_started:
            if not body:
                return 0
            out.append('"')
            self.value_started = True
            if body.startswith("\n"):
                body = body[1:]
                if not body:
                    return 1
                out.append(escape_piece(body))
                return len(body) + 1
        if not body:
            return 0
        out.append(escape_piece(body))
        return len(body)

    def _step_done(self, text: str, out: list[str]) -> int:
        return len(text)  # after </function>: nothing but layout belongs to the call

    # -- values -------------------------------------------------------------------------

    def _decide_mode(self, text: str) -> str:
        """"typed" when the schema (or, untyped, a leading { or [) says JSON, else "string";
        "" while an untyped value has shown only whitespace."""
        schema = self.properties.get(self.key) or {}
        kind = schema.get("type")
        kinds = set(kind) if isinstance(kind, list) else {kind}
        if kinds & TYPED_KINDS:
            return "typed"
        if kinds - {None}:
            return "string"
        stripped = text.lstrip()
        if not stripped:
            return ""
        return "typed" if stripped[0] in "{[" else "string"

    def _finish_value(self, rest: str, out: list[str]) -> None:
        """The value's last text `rest` arrived: emit what is left of it."""
        if self.mode == "string" and self.value_started:
            out.append(escape_piece(rest[:-1] if rest.endswith("\n") else rest) + '"')
            return
        if self.mode == "string":  # nothing streamed yet: the whole value is `rest`
            out.append(json.dumps(strip_one_newline(rest), ensure_ascii=False))
            return
        schema = self.properties.get(self.key) or {}
        out.append(json.dumps(typed_value(strip_one_newline(rest), schema), ensure_ascii=False))
