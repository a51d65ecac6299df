"""Codex CLI: a Responses-API provider, selected as the default, with hosted tools off.

File: `$CODEX_HOME/config.toml` (default `~/.codex`). Owned entries: top-level `model`,
`model_provider`, `web_search`, `model_context_window`, `model_reasoning_effort` (only for a
model that lacks some of Codex's levels); `features.image_generation`; the table
`model_providers.mtplx`. Codex sends its hosted `web_search` and `image_generation` tools by
default, which a local model cannot run, so both are switched off here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .base import Facts, as_int, dig, env_path, home
from .merge import Entry, FilePlan
from .target import PROVIDER_ID, AgentTarget

name = "codex"
title = "Codex CLI"
binary = "codex"


def config_dir(env: Mapping[str, str]) -> Path:
    """`$CODEX_HOME`, default `~/.codex`."""
    return env_path(env, "CODEX_HOME") or home(env) / ".codex"


# Codex drops a stream that sends no event for 300 s by default, and the daemon's keep-alive
# comments do not count: a cold 11k-token first prompt took longer than that to prefill on two
# loaded CPU cores, and Codex then re-sent it from scratch, five times. An hour covers a cold
# 64k prefill on a slow machine; a dead local server still fails the connection at once.
STREAM_IDLE_TIMEOUT_MS = 3_600_000


def provider_entry(target: AgentTarget) -> dict[str, Any]:
    """The `[model_providers.mtplx]` table."""
    entry: dict[str, Any] = {"name": "mtplx (local)", "base_url": target.base_url, "wire_api": "responses",
                             "stream_idle_timeout_ms": STREAM_IDLE_TIMEOUT_MS}
    if target.api_key_env:
        entry["env_key"] = target.api_key_env
    return entry


# Codex's `model_reasoning_effort` values, and the one it sends when the key is unset.
CODEX_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
CODEX_DEFAULT_EFFORT = "medium"


def reasoning_effort(target: AgentTarget) -> str | None:
    """The `model_reasoning_effort` to write: None when the model takes every level Codex can
    send (the user's own setting, or Codex's default, then works), else one the model has.

    The daemon answers an effort the model's family lacks with a 400, so Codex left at its
    default would fail every request to, say, an LFM2 instruct model (levels: "none").
    """
    levels = [level for level in target.reasoning_efforts if level in CODEX_EFFORTS]
    if not levels or len(levels) == len(CODEX_EFFORTS):
        return None  # the daemon did not say (an older one), or every level works
    for preferred in (CODEX_DEFAULT_EFFORT, "none"):
        if preferred in levels:
            return preferred
    return levels[0]


def plans(target: AgentTarget, env: Mapping[str, str]) -> list[FilePlan]:
    """config.toml: top-level selection keys first (TOML wants them above tables), then tables."""
    effort = reasoning_effort(target)
    top_level = (
        Entry(("model",), target.model_id),
        Entry(("model_provider",), PROVIDER_ID),
        Entry(("model_context_window",), target.context_window),
        *([Entry(("model_reasoning_effort",), effort)] if effort else []),
        Entry(("web_search",), "disabled"),
    )
    tables = (
        Entry(("features", "image_generation"), False),
        Entry(("model_providers", PROVIDER_ID), provider_entry(target)),
    )
    return [FilePlan(config_dir(env) / "config.toml", "toml", top_level + tables)]


def facts(docs: list[Any]) -> Facts:
    """Endpoint, model and context window as the installed config.toml states them."""
    data = docs[0].data()
    provider = dig(data, "model_providers", PROVIDER_ID) or {}
    selected = data.get("model_provider") == PROVIDER_ID
    return Facts(
        base_url=provider.get("base_url"),
        model_id=data.get("model") if selected else None,
        context_window=as_int(data.get("model_context_window")),
        max_output_tokens=None,  # Codex sends no output cap
        selected=selected,
        key_env=provider.get("env_key"),
    )


def notes(target: AgentTarget) -> list[str]:
    """The launch hint."""
    return ["run `codex` (it now uses the local model by default)"]
