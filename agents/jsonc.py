"""JSONC (JSON with comments and trailing commas) edited in place.

OpenCode, Pi and Claude Code read JSON or JSONC, and users keep comments in those files. No
well-kept Python library round-trips JSONC, so this module parses the text into nodes that
remember their source spans, and edits the text itself: setting a member replaces or inserts
exactly that member's text, removing one deletes exactly that text. Everything else of the
file (comments, spacing, key order, number spellings) stays byte for byte.

Members are always inserted after the last member of their object, which makes an insert
followed by a remove return the original bytes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import EditProblem, SyntaxProblem

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = {"true": True, "false": False, "null": None}
MISSING = object()


@dataclass
class Node:
    """One JSON value and the span `[start, end)` of its text."""

    kind: str  # "object", "array" or "scalar"
    start: int
    end: int
    scalar: Any = None
    members: list["Member"] = field(default_factory=list)
    items: list["Node"] = field(default_factory=list)

    def to_python(self) -> Any:
        """The plain Python value of this node (later duplicate keys win, as in JSON)."""
        if self.kind == "object":
            return {m.key: m.value.to_python() for m in self.members}
        if self.kind == "array":
            return [item.to_python() for item in self.items]
        return self.scalar

    def member(self, key: str) -> "Member | None":
        """The last member named `key` (the one a JSON reader keeps), or None."""
        for m in reversed(self.members):
            if m.key == key:
                return m
        return None


@dataclass
class Member:
    key: str
    key_start: int
    value: Node


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, message: str, pos: int | None = None) -> SyntaxProblem:
        pos = self.pos if pos is None else pos
        line = self.text.count("\n", 0, pos) + 1
        col = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return SyntaxProblem(f"line {line} column {col}: {message}")

    def skip(self) -> None:
        """Skip whitespace and comments."""
        text, n = self.text, len(self.text)
        while self.pos < n:
            ch = text[self.pos]
            if ch in " \t\r\n\ufeff":
                self.pos += 1
            elif text.startswith("//", self.pos):
                nl = text.find("\n", self.pos)
                self.pos = n if nl < 0 else nl + 1
            elif text.startswith("/*", self.pos):
                close = text.find("*/", self.pos + 2)
                if close < 0:
                    raise self.fail("unterminated /* comment")
                self.pos = close + 2
            else:
                return

    def value(self) -> Node:
        self.skip()
        if self.pos >= len(self.text):
            raise self.fail("unexpected end of file")
        ch = self.text[self.pos]
        if ch == "{":
            return self.obj()
        if ch == "[":
            return self.arr()
        if ch == '"':
            return self._string_node()
        match = _NUMBER.match(self.text, self.pos)
        if match and match.end() > self.pos:
            start, self.pos = self.pos, match.end()
            raw = match.group()
            num: Any = float(raw) if any(c in raw for c in ".eE") else int(raw)
            return Node("scalar", start, self.pos, scalar=num)
        for word, val in _LITERALS.items():
            if self.text.startswith(word, self.pos):
                start = self.pos
                self.pos += len(word)
                return Node("scalar", start, self.pos, scalar=val)
        raise self.fail(f"unexpected character {ch!r}")

    def _string_node(self) -> Node:
        start = self.pos
        value = self.string()
        return Node("scalar", start, self.pos, scalar=value)

    def string(self) -> str:
        start = self.pos
        i = start + 1
        text = self.text
        while i < len(text):
            ch = text[i]
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                try:
                    value = json.loads(text[start : i + 1])
                except json.JSONDecodeError as exc:
                    raise self.fail(f"bad string: {exc.msg}", start) from None
                self.pos = i + 1
                return value
            if ch == "\n":
                break
            i += 1
        raise self.fail("unterminated string", start)

    def obj(self) -> Node:
        node = Node("object", self.pos, self.pos)
        self.pos += 1
        while True:
            self.skip()
            if self.pos >= len(self.text):
                raise self.fail("unterminated object", node.start)
            if self.text[self.pos] == "}":
                self.pos += 1
                node.end = self.pos
                return node
            if self.text[self.pos] != '"':
                raise self.fail("expected a quoted key or '}'")
            key_start = self.pos
            key = self.string()
            self.skip()
            if not self.text.startswith(":", self.pos):
                raise self.fail("expected ':' after key")
            self.pos += 1
            node.members.append(Member(key, key_start, self.value()))
            self.skip()
            if self.text.startswith(",", self.pos):
                self.pos += 1
            elif not self.text.startswith("}", self.pos):
                raise self.fail("expected ',' or '}'")

    def arr(self) -> Node:
        node = Node("array", self.pos, self.pos)
        self.pos += 1
        while True:
            self.skip()
            if self.pos >= len(self.text):
                raise self.fail("unterminated array", node.start)
            if self.text[self.pos] == "]":
                self.pos += 1
                node.end = self.pos
                return node
            node.items.append(self.value())
            self.skip()
            if self.text.startswith(",", self.pos):
                self.pos += 1
            elif not self.text.startswith("]", self.pos):
                raise self.fail("expected ',' or ']'")


def parse(text: str) -> Node | None:
    """Parse JSONC text into a node tree; None for a file holding only whitespace/comments.

    Raises SyntaxProblem (with line and column) for anything else that is not JSONC.
    """
    parser = _Parser(text)
    parser.skip()
    if parser.pos >= len(text):
        return None
    root = parser.value()
    parser.skip()
    if parser.pos < len(text):
        raise parser.fail("unexpected text after the top-level value")
    return root


def _line_indent(text: str, pos: int) -> str:
    """The leading whitespace of the line that holds `pos`."""
    line_start = text.rfind("\n", 0, pos) + 1
    match = re.match(r"[ \t]*", text[line_start:])
    return match.group() if match else ""


def _indent_unit(text: str) -> str:
    """The file's indentation step: the first indented line's leading whitespace, else 2 spaces."""
    match = re.search(r"\n([ \t]+)\S", text)
    return match.group(1) if match else "  "


def _render(value: Any, unit: str, indent: str) -> str:
    """`value` as pretty JSON whose continuation lines start at `indent`."""
    body = json.dumps(value, indent=unit, ensure_ascii=False)
    return body.replace("\n", "\n" + indent)


class JsoncDocument:
    """A JSONC file's text with path-addressed edits that touch only the addressed member."""

    fmt = "JSON/JSONC"

    def __init__(self, text: str) -> None:
        self.text = text
        self.root = parse(text)
        if self.root is not None and self.root.kind != "object":
            raise SyntaxProblem("the top-level value is not an object")

    @classmethod
    def empty(cls) -> "JsoncDocument":
        """The text of a new file: an empty object."""
        return cls("{}\n")

    # -- reading -------------------------------------------------------------------------------
    def _node(self, path: tuple[str, ...]) -> Node | None:
        node = self.root
        for key in path:
            if node is None or node.kind != "object":
                return None
            member = node.member(key)
            node = member.value if member else None
        return node

    def get(self, path: tuple[str, ...]) -> Any:
        """The Python value at `path`, or MISSING."""
        node = self._node(path)
        return MISSING if node is None else node.to_python()

    def raw(self, path: tuple[str, ...]) -> str | None:
        """The exact source text of the value at `path`, or None when absent."""
        node = self._node(path)
        return None if node is None else self.text[node.start : node.end]

    def data(self) -> dict:
        """The whole document as plain Python data ({} for an empty file)."""
        return {} if self.root is None else self.root.to_python()

    def dumps(self) -> str:
        """The current text."""
        return self.text

    # -- editing -------------------------------------------------------------------------------
    def _replace(self, start: int, end: int, new: str) -> None:
        self.text = self.text[:start] + new + self.text[end:]
        self.root = parse(self.text)

    def set(self, path: tuple[str, ...], value: Any, raw: str | None = None) -> list[tuple[str, ...]]:
        """Set `path` to `value` (or to the literal source `raw`), creating parent objects.

        Returns the paths of the parent objects it had to create, shallowest first, so that
        a later `remove` can take them away again. Raises SyntaxProblem when a parent on the
        path exists but is not an object.
        """
        if self.root is None:
            # A blank (comment-only) file: keep its text and put the object after it.
            sep = "" if not self.text or self.text.endswith("\n") else "\n"
            self._replace(len(self.text), len(self.text), sep + "{}\n")
        node = self.root
        depth = 0
        while depth < len(path) - 1:
            member = node.member(path[depth])
            if member is None:
                break
            if member.value.kind != "object":
                raise EditProblem(f"{'.'.join(path[: depth + 1])} is not an object")
            node = member.value
            depth += 1
        created = [path[: i + 1] for i in range(depth, len(path) - 1)]
        if raw is not None and created:
            value, raw = parse(raw).to_python(), None
        nested: Any = value
        for key in reversed(path[depth + 1 :]):
            nested = {key: nested}
        key = path[depth]
        existing = node.member(key)
        unit = _indent_unit(self.text)
        if existing is not None and depth == len(path) - 1:
            indent = _line_indent(self.text, existing.key_start)
            new = raw if raw is not None else _render(nested, unit, indent)
            self._replace(existing.value.start, existing.value.end, new)
            return []
        self._insert_member(node, key, nested, unit, raw if not created else None)
        return created

    def _insert_member(self, obj: Node, key: str, value: Any, unit: str, raw: str | None) -> None:
        key_text = json.dumps(key, ensure_ascii=False)
        if obj.members:
            last = obj.members[-1]
            first = obj.members[0]
            same_line = "\n" not in self.text[obj.start : first.key_start]
            if same_line:
                body = raw if raw is not None else json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
                insert = f", {key_text}: {body}"
            else:
                indent = _line_indent(self.text, last.key_start)
                body = raw if raw is not None else _render(value, unit, indent)
                insert = f",\n{indent}{key_text}: {body}"
            self._replace(last.value.end, last.value.end, insert)
            return
        outer = _line_indent(self.text, obj.start)
        indent = outer + unit
        body = raw if raw is not None else _render(value, unit, indent)
        interior = self.text[obj.start + 1 : obj.end - 1]
        if interior.strip() == "":
            self._replace(obj.start + 1, obj.end - 1, f"\n{indent}{key_text}: {body}\n{outer}")
        else:
            # Keep the comments inside the object: the member goes before them.
            self._replace(obj.start + 1, obj.start + 1, f"\n{indent}{key_text}: {body}")

    def remove(self, path: tuple[str, ...]) -> bool:
        """Delete the member at `path` with its separator; False when it was not there."""
        parent = self._node(path[:-1])
        if parent is None or parent.kind != "object":
            return False
        member = parent.member(path[-1])
        if member is None:
            return False
        index = parent.members.index(member)
        if index > 0:
            self._replace(parent.members[index - 1].value.end, member.value.end, "")
            return True
        if len(parent.members) > 1:
            self._replace(member.key_start, parent.members[1].key_start, "")
            return True
        end = member.value.end
        rest = self.text[end : parent.end - 1]
        comma = re.match(r"\s*,", rest)
        if comma:
            end += comma.end()
        self._replace(member.key_start, end, "")
        parent = self._node(path[:-1])
        interior = self.text[parent.start + 1 : parent.end - 1]
        if interior.strip() == "":
            self._replace(parent.start + 1, parent.end - 1, "")
        return True
