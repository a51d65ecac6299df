"""Errors raised while reading or editing an agent's configuration file."""

from __future__ import annotations


class AgentConfigError(Exception):
    """A configuration file cannot be read or edited safely; the message says what to do."""


class FileConfigError(AgentConfigError):
    """One file's fault (`detail`, in `fmt`); nothing was written to it."""

    def __init__(self, path: str, fmt: str, detail: str, message: str) -> None:
        self.path = path
        self.fmt = fmt
        self.detail = detail
        super().__init__(message)


class ConfigParseError(FileConfigError):
    """A file does not parse in its format; nothing was written to it."""

    def __init__(self, path: str, fmt: str, detail: str) -> None:
        super().__init__(path, fmt, detail,
                         f"{path} is not valid {fmt} ({detail}); mtplxctl left it untouched. "
                         "Fix the file (or move it aside) and run the command again.")


class SyntaxProblem(ValueError):
    """A format parser's complaint, before it is attached to a file path."""


class ConfigEditError(FileConfigError):
    """A file parses, but the edit cannot be made without changing other settings; nothing was written."""

    def __init__(self, path: str, fmt: str, detail: str) -> None:
        super().__init__(path, fmt, detail,
                         f"{path}: mtplxctl cannot make its edit to this {fmt} file without changing other "
                         f"settings ({detail}); it left the file untouched. Add the entries by hand "
                         "(docs/agents.md lists them) or rewrite that part of the file in plain form, and "
                         "run the command again.")


class EditProblem(ValueError):
    """An editor's complaint that an edit would not give the intended data, before it is attached to a path."""
