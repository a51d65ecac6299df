"""The method table of the control plane.

A handler is `async def handler(params: dict, notify: Notify) -> result`. It raises RpcError for
errors the caller should see; `notify(method, params)` streams a progress notification on the
caller's connection before the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

Notify = Callable[[str, dict[str, Any]], Awaitable[None]]
Handler = Callable[[dict[str, Any], Notify], Awaitable[Any]]


@dataclass(frozen=True)
class Method:
    name: str
    handler: Handler
    doc: str


class MethodRegistry:
    """Namespaced methods (`daemon.status`, `model.load`, ...) by name."""

    def __init__(self) -> None:
        self._methods: dict[str, Method] = {}

    def add(self, name: str, handler: Handler, doc: str = "") -> None:
        """Register `handler` under `name`; a name can be registered once."""
        if name in self._methods:
            raise ValueError(f"control method {name!r} is already registered")
        self._methods[name] = Method(name, handler, doc or (handler.__doc__ or "").strip())

    def get(self, name: str) -> Method | None:
        return self._methods.get(name)

    def names(self) -> list[str]:
        return sorted(self._methods)
