"""LFM2 / LFM2.5's tool-call dialect: a Python list of calls between special markers.

The model writes `<|tool_call_start|>[get_weather(city="Paris", days=3), ls(path=".")]<|tool_call_end|>`.
The body is a list of calls (or one bare call) whose function is a plain or dotted name and
whose arguments are keywords with literal values (strings, numbers, True/False/None, lists,
dicts, and their JSON spellings true/false/null), each read with `ast` (never evaluated).
`PythonicBlock` streams it: a call is announced at its `name(`, its arguments are sent one
JSON fragment per complete argument. A block that never names a call stays content byte for
byte, as the Qwen dialect's unnamed blocks do; a named call whose arguments are not keyword
literals keeps the unreadable text under `_malformed_arguments`.

The other direction, `render_calls`, writes structured `tool_calls` of the history back in
the same syntax, for chat templates that only render an assistant's `content`.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from mtplxd.api.parsers import ToolDialect

CALL_OPEN = "<|tool_call_start|>"
CALL_CLOSE = "<|tool_call_end|>"
# JSON spellings a model trained on JSON tool schemas sometimes writes inside Python syntax.
_JSON_NAMES = {"true": True, "false": False, "null": None}


class _NotACall(ValueError):
    """A keyword argument that is not `name=literal`."""


MALFORMED_KEY = "_malformed_arguments"
_NAME = r"[^\W\d]\w*(?:\s*\.\s*[^\W\d]\w*)*"
# A call's committed header: `name(` (dotted names allowed), after the block's `[` for the first.
FIRST_HEADER = re.compile(rf"\s*(\[\s*)?({_NAME})\s*\(")
NEXT_HEADER = re.compile(rf"\s*({_NAME})\s*\(")
# Text that may still grow into a header (so the block waits rather than deciding).
FIRST_PARTIAL = re.compile(r"\s*(?:\[\s*)?(?:[^\W\d]\w*(?:\s*\.\s*(?:[^\W\d]\w*)?)*\s*)?")
NEXT_PARTIAL = re.compile(r"\s*(?:[^\W\d]\w*(?:\s*\.\s*(?:[^\W\d]\w*)?)*\s*)?")

Action = tuple[str, str]  # ("start", name) | ("arguments", fragment) | ("end", "")


class PythonicBlock:
    """Streams the calls of one pythonic block as decoded text arrives.

    A call is committed as soon as its `name(` is complete. Each keyword argument is held
    until it is complete (a `,` or the call's `)` at bracket and quote depth 0), then read
    with `ast` and sent as one JSON fragment: `{"a": 1`, `, "b": "x"`, and `}` at the `)`;
    together they are `json.dumps` of the arguments. A fragment is only ever sent for a
    complete, valid argument, so what was sent stays valid whatever follows. From the first
    argument that is not `name=literal` (positional, an expression, a repeated name) to the
    call's `)`, the model's text is kept raw under `_malformed_arguments`; so is an argument
    still open when the block ends (cut by max_tokens, or closed without `)`). Text between
    calls that is not a call is dropped. Decisions depend only on text already seen, so any
    chunking gives the same actions.
    """

    def __init__(self) -> None:
        self.state = "first"   # first | arguments | after | between | done | not_a_call
        self.in_list = False
        self.calls = 0
        self.keys: set[str] = set()
        self.segment = ""      # the current argument's text, held until it is complete
        self.raw = ""          # the malformed rest of the call, sent at its `)`
        self.depth = 0
        self.quote = ""        # the open string's quote (one or three characters)
        self.escaped = False
        self.quote_run = 0     # closing quotes seen in a row inside a triple-quoted string

    def feed(self, text: str, final: bool = False) -> tuple[list[Action], int]:
        """`text`: the block's unconsumed text; `final`: it is the rest of the block.
        Returns the decided actions and the characters consumed. Nothing is consumed before
        the first call is named, so a block that never names one is still whole."""
        actions: list[Action] = []
        used = 0
        while True:
            step = getattr(self, f"_step_{self.state}")(text[used:], final, actions)
            if step is None:
                break
            used += step
        if final and self.state == "arguments":
            self._end_call(actions, cut=True)
        return actions, used

    # -- states (each returns characters consumed, or None to stop) ----------------------

    def _step_first(self, text: str, final: bool, actions: list[Action]) -> int | None:
        match = FIRST_HEADER.match(text)
        if match:
            self.in_list = bool(match.group(1))
            return self._start(match.group(2), match.end(), actions)
        if not final and FIRST_PARTIAL.fullmatch(text):
            return None
        self.state = "not_a_call"
        return None

    def _step_between(self, text: str, final: bool, actions: list[Action]) -> int | None:
        match = NEXT_HEADER.match(text)
        if match:
            return self._start(match.group(1), match.end(), actions)
        if not final and NEXT_PARTIAL.fullmatch(text):
            return None
        self.state = "done"  # `]`, or stray text: nothing but layout follows the last call
        return 0

    def _step_after(self, text: str, final: bool, actions: list[Action]) -> int | None:
        stripped = text.lstrip()
        if not stripped:
            return len(text) or None
        if self.in_list and stripped[0] == ",":
            self.state = "between"
        else:
            self.state = "done"
        return len(text) - len(stripped) + 1

    def _step_done(self, text: str, final: bool, actions: list[Action]) -> int | None:
        return len(text) or None

    def _step_not_a_call(self, text: str, final: bool, actions: list[Action]) -> int | None:
        return None

    def _step_arguments(self, text: str, final: bool, actions: list[Action]) -> int | None:
        # The argument's text is appended in slices, not per character: a long string value
        # must not cost quadratic time.
        for i, char in enumerate(text):
            if self.quote:
                self._in_string(char)
            elif char in "'\"":
                if text.startswith(char * 3, i):
                    self.quote = char * 3
                    self.segment += text[:i + 3]
                    return i + 3
                if not final and len(text) - i < 3 and text[i:] == char * (len(text) - i):
                    self.segment += text[:i]
                    return i or None  # may still open a triple-quoted string
                self.quote = char
            elif char in "([{":
                self.depth += 1
            elif char in ")]}" and self.depth:
                self.depth -= 1
            elif char in ",)" and not self.depth:
                self.segment += text[:i]
                self._end_argument(actions, last=char == ")")
                return i + 1
        self.segment += text
        return len(text) or None

    # -- pieces -------------------------------------------------------------------------

    def _start(self, name: str, size: int, actions: list[Action]) -> int:
        actions.append(("start", re.sub(r"\s+", "", name)))
        self.state = "arguments"
        self.calls += 1
        self.keys = set()
        return size

    def _in_string(self, char: str) -> None:
        """Follow an open string to its closing quote (a backslash escapes any character)."""
        if self.escaped or char == "\\":
            self.escaped = not self.escaped
            self.quote_run = 0
        elif len(self.quote) == 1:
            self.quote = "" if char == self.quote else self.quote
        elif char == self.quote[0]:
            self.quote_run += 1
            if self.quote_run == 3:
                self.quote, self.quote_run = "", 0
        else:
            self.quote_run = 0

    def _end_argument(self, actions: list[Action], last: bool) -> None:
        """A `,` or the call's `)` closed the held argument."""
        segment, self.segment = self.segment, ""
        if not self.raw and not (last and not segment.strip()):
            try:
                key, value = _keyword(segment)
                if key in self.keys:
                    raise _NotACall
            except _NotACall:
                pass
            else:
                opening = ", " if self.keys else "{"
                self.keys.add(key)
                actions.append(("arguments", opening + _json(key) + ": " + _json(value)))
                segment = None
        if segment is not None:
            self.raw += segment + ("" if last else ",")
        if last:
            self._end_call(actions, cut=False)

    def _end_call(self, actions: list[Action], cut: bool) -> None:
        raw = (self.raw + (self.segment if cut else "")).strip()
        opening = ", " if self.keys else "{"
        if raw:
            actions.append(("arguments", opening + _json(MALFORMED_KEY) + ": " + _json(raw) + "}"))
        else:
            actions.append(("arguments", "}" if self.keys else "{}"))
        actions.append(("end", ""))
        self.segment = self.raw = self.quote = ""
        self.depth = self.quote_run = 0
        self.escaped = False
        self.state = "after"


def _json(value: Any) -> str:
    """The JSON spelling the non-streamed arguments use (`json.dumps(..., ensure_ascii=False)`)."""
    return json.dumps(value, ensure_ascii=False)


def _keyword(segment: str) -> tuple[str, Any]:
    """(name, value) of one `name=literal` argument's text."""
    try:
        node = ast.parse("_(" + segment + "\n)", mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise _NotACall from None
    if not isinstance(node, ast.Call) or node.args or len(node.keywords) != 1:
        raise _NotACall
    keyword = node.keywords[0]
    if keyword.arg is None:  # **kwargs
        raise _NotACall
    return keyword.arg, _literal(keyword.value)


def parse_pythonic_block(body: str, schemas: dict[str, dict[str, Any]]) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON), ...] of a whole block's body (what streaming it would give),
    or None when it never names a call."""
    calls: list[tuple[str, str]] = []
    for kind, text in PythonicBlock().feed(body, final=True)[0]:
        if kind == "start":
            calls.append((text, ""))
        elif kind == "arguments":
            calls[-1] = (calls[-1][0], calls[-1][1] + text)
    return calls or None


def _literal(node: ast.AST) -> Any:
    """A literal value; `true`/`false`/`null` read as JSON's."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise _NotACall
        return {_key(k): _literal(v) for k, v in zip(node.keys, node.values)}
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _NotACall from None
    if isinstance(value, (set, bytes, complex)):
        raise _NotACall  # no JSON spelling
    return value


def _key(node: ast.AST | None) -> str:
    key = _literal(node) if node is not None else None
    if not isinstance(key, str):
        raise _NotACall
    return key


def render_calls(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant's structured tool calls written as the model writes them."""
    rendered = []
    for call in tool_calls:
        function = call.get("function") or call
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = {}
        args = ", ".join(f"{key}={_python_literal(value)}" for key, value in
                         (arguments.items() if isinstance(arguments, dict) else []))
        rendered.append(f"{function.get('name', '')}({args})")
    return CALL_OPEN + "[" + ", ".join(rendered) + "]" + CALL_CLOSE


def _python_literal(value: Any) -> str:
    """A JSON value in Python syntax (strings double-quoted, as LFM2 writes them)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, (int, float, str)):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {_python_literal(v)}"
                               for k, v in value.items()) + "}"
    return json.dumps(str(value), ensure_ascii=False)


PYTHONIC_TOOLS = ToolDialect("pythonic", CALL_OPEN, CALL_CLOSE, parse_pythonic_block, block=PythonicBlock)
