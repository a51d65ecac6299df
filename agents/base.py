"""What every agent module provides, and the facts doctor reads back from a config."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

from .merge import FilePlan
from .target import AgentTarget


@dataclass(frozen=True)
class Facts:
    """What an installed config says about the endpoint, read back from the file.

    `selected` is whether the agent's default model is still the mtplx one; `key_env` is the
    environment variable the config references for the API key (None when it references none).
    """

    base_url: str | None
    model_id: str | None
    context_window: int | None
    max_output_tokens: int | None
    selected: bool
    key_env: str | None = None


class Agent(Protocol):
    """One coding agent: where its config lives, what mtplx writes there, and how to read it."""

    name: str
    title: str
    binary: str

    def plans(self, target: AgentTarget, env: Mapping[str, str]) -> list[FilePlan]:
        """The files and entries to write for `target`, at locations resolved from `env`."""

    def facts(self, docs: list[Any]) -> Facts:
        """Read back the installed entries from the documents of `plans` (same order)."""

    def notes(self, target: AgentTarget) -> list[str]:
        """Warnings and the launch hint to show after an install."""

    def config_dir(self, env: Mapping[str, str]) -> Path:
        """The agent's configuration directory (used to detect whether it is set up here)."""


def home(env: Mapping[str, str]) -> Path:
    """The user's home directory as `env` says (HOME), else the process's."""
    value = env.get("HOME")
    return Path(value).expanduser() if value else Path.home()


def env_path(env: Mapping[str, str], name: str) -> Path | None:
    """The path in environment variable `name` with `~` expanded against HOME, or None."""
    value = env.get(name)
    if not value:
        return None
    if value == "~" or value.startswith("~/"):
        return home(env) / value[2:]
    return Path(value)


def detected(agent: Agent, env: Mapping[str, str]) -> bool:
    """True when the agent looks installed here: its binary is on PATH or its config dir exists."""
    return shutil.which(agent.binary, path=env.get("PATH")) is not None or agent.config_dir(env).is_dir()


def dig(data: Any, *keys: Any) -> Any:
    """`data[k1][k2]...`, or None as soon as a level is missing or not a container."""
    for key in keys:
        if isinstance(data, dict):
            data = data.get(key)
        elif isinstance(data, list) and isinstance(key, int) and -len(data) <= key < len(data):
            data = data[key]
        else:
            return None
    return data


def as_int(value: Any) -> int | None:
    """An integer read from a config value (numbers or numeric strings), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None
