"""Errors raised while reading or editing an agent's configuration file."""

from __future__ import annotations


class AgentConfigError(Exception):
    """A configuration file cannot be read or edited safely; the message says what to do."""


class ConfigParseError(AgentConfigError):
    """A file does not parse in its format; nothing was written to it."""

    def __init__(self, path: str, fmt: str, detail: str) -> None:
        self.path = path
        self.fmt = fmt
        self.detail = detail
        super().__init__(
            f"{path} is not valid {fmt} ({detail}); mtplxctl left it untouched. "
            "Fix the file (or move it aside) and run the command again."
        )


class SyntaxProblem(ValueError):
    """A format parser's complaint, before it is attached to a file path."""
