"""YAML (Hermes' config.yaml) edited one top-level block at a time.

PyYAML drops comments and ruamel.yaml re-indents what it rewrites, so neither can promise the
user's file back byte for byte. Hermes' settings that mtplx owns are whole top-level blocks
(`model:`), so this module edits text: it finds the lines of a top-level key's block, replaces
or appends exactly those lines, and leaves every other line as it was. After each edit the
result is parsed again with PyYAML and must equal the intended data; when it does not (an
alias left pointing at a replaced block's anchor, flow-style top level, multi-document files),
the edit is refused rather than guessed.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from .data import same_data
from .errors import EditProblem, SyntaxProblem

MISSING = object()
_EMPTY_FLOW = re.compile(r"^\{\}[ \t]*(#.*)?\n?$")
_KEY_LINE = re.compile(r"""^(?P<key>[A-Za-z_][\w.-]*|"[^"\n]*"|'[^'\n]*')[ \t]*:(?:[ \t]|$)""")


def _load(text: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SyntaxProblem(str(exc).replace("\n", " ")) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SyntaxProblem("the top level is not a mapping")
    return data


def _unquote(key: str) -> str:
    return key[1:-1] if key[:1] in "\"'" else key


class YamlDocument:
    """A YAML mapping file with top-level-key edits that keep every other line."""

    fmt = "YAML"

    def __init__(self, text: str) -> None:
        self.text = text
        self._data = _load(text)
        self._blocks = self._scan()

    @classmethod
    def empty(cls) -> "YamlDocument":
        """A new, empty file."""
        return cls("")

    def _scan(self) -> dict[str, tuple[int, int]]:
        """Map each top-level key to the [start, end) line range of its block."""
        lines = self.text.splitlines(keepends=True)
        starts: list[tuple[str, int]] = []
        for i, line in enumerate(lines):
            if not line.strip() or line[0] in " \t#" or line.rstrip() in ("---", "..."):
                continue
            if starts and (line.startswith("- ") or line.rstrip() == "-"):
                continue  # a block sequence may sit at its key's own indentation
            if not self._data and _EMPTY_FLOW.match(line):
                continue  # `{}`: an empty mapping written in flow style
            match = _KEY_LINE.match(line)
            if not match:
                raise SyntaxProblem(
                    f"line {i + 1}: the top level is not a plain block mapping, which mtplxctl edits only as one"
                )
            starts.append((_unquote(match.group("key")), i))
        blocks: dict[str, tuple[int, int]] = {}
        for n, (key, start) in enumerate(starts):
            end = starts[n + 1][1] if n + 1 < len(starts) else len(lines)
            # Blank lines and column-0 comments after a block belong to what follows it.
            while end > start + 1 and (not lines[end - 1].strip() or lines[end - 1].startswith("#")
                                       or lines[end - 1].rstrip() in ("---", "...")):
                end -= 1
            blocks[key] = (start, end)
        if set(blocks) != set(self._data):
            raise SyntaxProblem("the top-level keys could not be told apart line by line")
        return blocks

    def get(self, path: tuple[str, ...]) -> Any:
        """The value at `path`, or MISSING."""
        node: Any = self._data
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return MISSING
            node = node[key]
        return node

    def raw(self, path: tuple[str, ...]) -> str | None:
        """The exact lines of the top-level block `path` (one key deep), or None."""
        self._top_only(path)
        if path[0] not in self._blocks:
            return None
        start, end = self._blocks[path[0]]
        return "".join(self.text.splitlines(keepends=True)[start:end])

    def data(self) -> dict:
        """The whole document as plain Python data."""
        return self._data

    def dumps(self) -> str:
        """The current text."""
        return self.text

    @staticmethod
    def _top_only(path: tuple[str, ...]) -> None:
        if len(path) != 1:
            raise ValueError("YamlDocument edits top-level keys only")

    @staticmethod
    def _reading(new_text: str) -> dict:
        """The data of an edited text; EditProblem when the edit broke it (an alias whose anchor
        went with a replaced block)."""
        try:
            return _load(new_text)
        except SyntaxProblem as exc:
            raise EditProblem(f"the edited file would not parse: {exc}") from None

    def _apply(self, new_text: str, expected: dict) -> None:
        if not same_data(self._reading(new_text), expected):
            raise EditProblem("an edit of one block changed other settings (anchors or aliases?)")
        self.text = new_text
        self._data = expected
        self._blocks = self._scan()

    def set(self, path: tuple[str, ...], value: Any, raw: str | None = None) -> list[tuple[str, ...]]:
        """Replace (or append) the top-level block `path` with `value`, or with the lines `raw`.

        Raises EditProblem, changing nothing, when the result would change another block.
        """
        self._top_only(path)
        key = path[0]
        block = raw if raw is not None else yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=False)
        new_text = self._with_block(key, block)
        if raw is not None:
            # The recorded lines may use an alias of an anchor in another block (`<<: *defaults`),
            # so their value is what they mean inside the whole file, not on their own.
            value = self._reading(new_text).get(key)
        self._apply(new_text, {**self._data, key: value})
        return []

    def _with_block(self, key: str, block: str) -> str:
        """The text with top-level block `key` replaced by (or appended as) the lines `block`."""
        lines = self.text.splitlines(keepends=True)
        if key in self._blocks:
            start, end = self._blocks[key]
            if not block.endswith("\n") and end < len(lines):
                block += "\n"
            new_text = "".join(lines[:start]) + block + "".join(lines[end:])
        else:
            base = self.text
            if not self._data:
                base = "".join(line for line in lines if not _EMPTY_FLOW.match(line))
            sep = "" if not base or base.endswith("\n") else "\n"
            new_text = base + sep + block
        return new_text

    def remove(self, path: tuple[str, ...]) -> bool:
        """Delete the lines of top-level block `path`; False when it was not there."""
        self._top_only(path)
        key = path[0]
        if key not in self._blocks:
            return False
        start, end = self._blocks[key]
        lines = self.text.splitlines(keepends=True)
        expected = {k: v for k, v in self._data.items() if k != key}
        self._apply("".join(lines[:start]) + "".join(lines[end:]), expected)
        return True
