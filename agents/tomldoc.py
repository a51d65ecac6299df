"""TOML (Codex's config.toml) edited with tomlkit, which keeps comments, order and spacing.

tomlkit does not always render what it holds: a table added under a parent written with
dotted keys (`model_providers.azure.name = "…"`) comes out as a `[model_providers.mtplx]`
header in the middle of the top-level keys, which then read as keys of that table. So every
edit is checked: the new text, read by the standard library's parser (`tomllib`, which Codex's
own parser agrees with), must hold exactly the data before the edit plus the edited key.
When it does not, a new table is appended at the end of the file instead (valid TOML below a
dotted-key parent), and when that does not hold either, the edit is refused.
"""

from __future__ import annotations

import copy
import tomllib
from typing import Any, Callable

import tomlkit
from tomlkit.exceptions import TOMLKitError
from tomlkit.items import InlineTable, Table

from .data import same_data
from .errors import EditProblem, SyntaxProblem

MISSING = object()


def _plain(value: Any) -> Any:
    """tomlkit items as plain Python values (tomlkit's own `unwrap`)."""
    return value.unwrap() if hasattr(value, "unwrap") else value


def _table_for(value: dict, top_level_parent: bool) -> Table:
    """A standard table for `value`; nested dicts become sub-tables, scalars stay keys."""
    table = tomlkit.table(is_super_table=top_level_parent)
    for key, sub in value.items():
        if isinstance(sub, dict):
            table.add(key, _table_for(sub, False))
        else:
            table.add(key, sub)
    return table


def _inline_for(value: dict) -> InlineTable:
    """An inline table for `value` (what a table inside an inline table must be)."""
    table = tomlkit.inline_table()
    for key, sub in value.items():
        table.append(key, _inline_for(sub) if isinstance(sub, dict) else sub)
    return table


def _read(text: str) -> dict:
    """`text` as the TOML standard reads it; SyntaxProblem when it is not valid TOML."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SyntaxProblem(str(exc)) from None


def _with_value(data: dict, path: tuple[str, ...], value: Any) -> dict:
    """A copy of `data` with `path` set to `value` (parents created as tables).

    Raises EditProblem when a parent on the path holds a plain value.
    """
    out = copy.deepcopy(data)
    node = out
    for depth, key in enumerate(path[:-1]):
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise EditProblem(f"{'.'.join(path[: depth + 1])} is not a table")
    node[path[-1]] = copy.deepcopy(value)
    return out


def _without(data: dict, path: tuple[str, ...]) -> dict:
    """A copy of `data` without `path` (the same data when it holds no `path`)."""
    out = copy.deepcopy(data)
    node = out
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(path[-1], None)
    return out


def _readings_without(data: dict, path: tuple[str, ...]) -> list[dict]:
    """What the text may read as once `path` is removed from `data`.

    A parent table left empty has no text of its own when it was only implied by its
    sub-tables' headers ([a.b] implies a), so the reading without it is right too.
    """
    readings = [_without(data, path)]
    for depth in range(len(path) - 1, 0, -1):
        parent = path[:depth]
        node: Any = readings[-1]
        for key in parent:
            node = node.get(key) if isinstance(node, dict) else None
        if node != {}:
            break
        readings.append(_without(readings[-1], parent))
    return readings


def _missing_parents(data: dict, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The parent tables of `path` that `data` lacks, shallowest first."""
    missing, node = [], data
    for depth, key in enumerate(path[:-1]):
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            missing.append(path[: depth + 1])
    return missing


class TomlDocument:
    """A TOML file with path-addressed edits that keep everything else of the file."""

    fmt = "TOML"

    def __init__(self, text: str) -> None:
        self._data = _read(text)
        try:
            self.doc = tomlkit.parse(text)
        except TOMLKitError as exc:
            raise SyntaxProblem(str(exc)) from None

    @classmethod
    def empty(cls) -> "TomlDocument":
        """A new, empty file."""
        return cls("")

    def _container(self, path: tuple[str, ...]) -> Any:
        node: Any = self.doc
        for key in path:
            if not hasattr(node, "keys") or key not in node:
                return None
            node = node[key]
        return node

    def get(self, path: tuple[str, ...]) -> Any:
        """The plain value at `path`, or MISSING."""
        parent = self._container(path[:-1])
        if parent is None or not hasattr(parent, "keys") or path[-1] not in parent:
            return MISSING
        return _plain(parent[path[-1]])

    def raw(self, path: tuple[str, ...]) -> str | None:
        """The value at `path` as TOML source (a one-key document when it is a table)."""
        value = self.get(path)
        if value is MISSING:
            return None
        if isinstance(value, dict):
            return tomlkit.dumps({"value": value})
        # A plain value keeps its own spelling (multi-line arrays, quotes, number format).
        return "value = " + self._container(path[:-1]).item(path[-1]).as_string()

    def data(self) -> dict:
        """The whole document as plain Python data, as the TOML standard (tomllib) reads it."""
        return copy.deepcopy(self._data)

    def dumps(self) -> str:
        """The current text."""
        return self.doc.as_string()

    def set(self, path: tuple[str, ...], value: Any, raw: str | None = None) -> list[tuple[str, ...]]:
        """Set `path` to `value` (or to the value held by `raw`), creating parent tables.

        Returns the parent tables it created, shallowest first. Raises EditProblem, leaving the
        document as it was, when the text cannot be made to hold exactly the old data plus
        this key (a parent on the path is not a table, or tomlkit cannot render the edit).
        """
        restored = tomlkit.parse(raw)["value"] if raw is not None else None
        if restored is not None:
            value = _plain(restored)
        expected = _with_value(self._data, path, value)
        created = _missing_parents(self._data, path)
        problem = self._attempt([expected], lambda: self._set_in_place(path, value, restored))
        if problem and isinstance(value, dict) and self.get(path) is MISSING:
            problem = self._attempt([expected], lambda: self._append_table(path, value))
        if problem:
            raise EditProblem(f"setting {'.'.join(path)}: {problem}")
        return created

    def remove(self, path: tuple[str, ...]) -> bool:
        """Delete the key or table at `path`; False when it was not there.

        Raises EditProblem, leaving the document as it was, when the text without the key would
        not read as the old data less that key.
        """
        parent = self._container(path[:-1])
        if parent is None or not hasattr(parent, "keys") or path[-1] not in parent:
            return False
        readings = _readings_without(self._data, path)
        problem = self._attempt(readings, lambda: self._container(path[:-1]).__delitem__(path[-1]))
        if problem:
            raise EditProblem(f"removing {'.'.join(path)}: {problem}")
        return True

    def _attempt(self, expected: list[dict], edit: Callable[[], None]) -> str | None:
        """Run `edit`; None when the resulting text reads as one of `expected` (then it is kept), else
        why not (then the document is re-read from the text it had, which a half-done edit of
        tomlkit's model cannot spoil)."""
        before = self.dumps()
        try:
            edit()
            result = tomllib.loads(self.dumps())
        except EditProblem as exc:
            problem = str(exc)
        except (TOMLKitError, ValueError, KeyError, TypeError) as exc:
            # tomlkit raises these for structures it cannot edit (an inline table's sub-table...).
            problem = f"tomlkit: {exc}"
        else:
            if any(same_data(result, reading) for reading in expected):
                self._data = result
                return None
            problem = "tomlkit would write it where it changes other settings (a table header among dotted keys?)"
        self.doc = tomlkit.parse(before)
        return problem

    def _set_in_place(self, path: tuple[str, ...], value: Any, restored: Any) -> None:
        """Set `path` where tomlkit puts it: beside the key's siblings."""
        node: Any = self.doc
        for depth, key in enumerate(path[:-1]):
            if key not in node:
                node.add(key, self._new_parent(node, depth < len(path) - 2 or isinstance(value, dict)))
            elif not hasattr(node[key], "keys"):
                raise EditProblem(f"{'.'.join(path[: depth + 1])} is not a table")
            node = node[key]
        key = path[-1]
        if isinstance(node, InlineTable) and isinstance(value, dict):
            item: Any = _inline_for(value)
        elif isinstance(value, dict):
            item = _table_for(value, False)
        else:
            item = value if restored is None else restored
        if isinstance(item, Table) and key not in node:
            item.add(tomlkit.nl())
        node[key] = item

    @staticmethod
    def _new_parent(node: Any, only_tables: bool) -> Any:
        # A parent of only sub-tables renders as [a.b] headers, not an empty [a]; inside an
        # inline table only another inline table is allowed.
        return tomlkit.inline_table() if isinstance(node, InlineTable) else tomlkit.table(is_super_table=only_tables)

    def _append_table(self, path: tuple[str, ...], value: dict) -> None:
        """Add the table `path` as a `[a.b]` section at the end of the file.

        TOML allows a [header] sub-table below a table written with dotted keys, wherever the
        header stands; at the end it cannot capture keys that belong elsewhere.
        """
        section = tomlkit.document()
        node: Any = section
        for key in path[:-1]:
            node.add(key, tomlkit.table(is_super_table=True))
            node = node[key]
        node.add(path[-1], _table_for(value, False))
        text = self.dumps()
        if text.strip():
            text = text.rstrip("\n") + "\n\n"
        self.doc = tomlkit.parse(text + section.as_string())
