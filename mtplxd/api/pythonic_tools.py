"""LFM2 / LFM2.5's tool-call dialect: a Python list of calls between special markers.

The model writes `<|tool_call_start|>[get_weather(city="Paris", days=3), ls(path=".")]<|tool_call_end|>`.
The body is read with `ast` (never evaluated): a list of calls (or one bare call) whose
function is a plain or dotted name and whose arguments are keywords with literal values
(strings, numbers, True/False/None, lists, dicts, and their JSON spellings true/false/null).
Anything else is not a call, and the block stays content byte for byte, as the Qwen
dialect's unparsable blocks do.

The other direction, `render_calls`, writes structured `tool_calls` of the history back in
the same syntax, for chat templates that only render an assistant's `content`.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from mtplxd.api.parsers import ToolDialect

CALL_OPEN = "<|tool_call_start|>"
CALL_CLOSE = "<|tool_call_end|>"
# JSON spellings a model trained on JSON tool schemas sometimes writes inside Python syntax.
_JSON_NAMES = {"true": True, "false": False, "null": None}


class _NotACall(ValueError):
    """The body is not a list of keyword-argument calls with literal values."""


def parse_pythonic_block(body: str, schemas: dict[str, dict[str, Any]]) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON), ...] from a pythonic call block's body, else None."""
    try:
        tree = ast.parse(body.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    try:
        calls = [_call(node) for node in nodes]
    except _NotACall:
        return None
    return calls or None


def _call(node: ast.AST) -> tuple[str, str]:
    if not isinstance(node, ast.Call) or node.args:
        raise _NotACall
    name = _dotted_name(node.func)
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            raise _NotACall
        arguments[keyword.arg] = _literal(keyword.value)
    return name, json.dumps(arguments, ensure_ascii=False)


def _dotted_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise _NotACall


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


PYTHONIC_TOOLS = ToolDialect("pythonic", CALL_OPEN, CALL_CLOSE, parse_pythonic_block)
