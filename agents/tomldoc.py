"""TOML (Codex's config.toml) edited with tomlkit, which keeps comments, order and spacing."""

from __future__ import annotations

from typing import Any

import tomlkit
from tomlkit.exceptions import TOMLKitError
from tomlkit.items import Table

from .errors import SyntaxProblem

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


class TomlDocument:
    """A TOML file with path-addressed edits that keep everything else of the file."""

    fmt = "TOML"

    def __init__(self, text: str) -> None:
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
        """The whole document as plain Python data."""
        return self.doc.unwrap()

    def dumps(self) -> str:
        """The current text."""
        return self.doc.as_string()

    def set(self, path: tuple[str, ...], value: Any, raw: str | None = None) -> list[tuple[str, ...]]:
        """Set `path` to `value` (or to the value held by `raw`), creating parent tables.

        Returns the parent tables it created, shallowest first. Raises SyntaxProblem when a
        parent on the path is not a table.
        """
        restored = None
        if raw is not None:
            restored = tomlkit.parse(raw)["value"]
            value = _plain(restored)
        node: Any = self.doc
        created: list[tuple[str, ...]] = []
        for depth, key in enumerate(path[:-1]):
            if key not in node:
                # A parent of only sub-tables renders as [a.b] headers, not an empty [a].
                only_tables = depth < len(path) - 2 or isinstance(value, dict)
                node.add(key, tomlkit.table(is_super_table=only_tables))
                created.append(path[: depth + 1])
            elif not hasattr(node[key], "keys"):
                raise SyntaxProblem(f"{'.'.join(path[: depth + 1])} is not a table")
            node = node[key]
        key = path[-1]
        item = _table_for(value, False) if isinstance(value, dict) else (value if restored is None else restored)
        if isinstance(item, Table) and key not in node:
            item.add(tomlkit.nl())
        node[key] = item
        return created

    def remove(self, path: tuple[str, ...]) -> bool:
        """Delete the key or table at `path`; False when it was not there."""
        parent = self._container(path[:-1])
        if parent is None or not hasattr(parent, "keys") or path[-1] not in parent:
            return False
        del parent[path[-1]]
        return True
