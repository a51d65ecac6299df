"""OpenCode: a provider entry (@ai-sdk/openai-compatible) and the default model, in its global config.

Written file: `$OPENCODE_CONFIG` when set, else the highest-precedence global file that exists
in `$XDG_CONFIG_HOME/opencode` (`opencode.jsonc`, `opencode.json`, `config.json`), else a new
`opencode.json` there. Owned entries: `provider.mtplx`, `model`, `small_model`. Comments stay.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from .base import Facts, as_int, dig, env_path, home
from .merge import Entry, FilePlan
from .target import PROVIDER_ID, AgentTarget

name = "opencode"
title = "OpenCode"
binary = "opencode"
_GLOBAL_FILES = ("opencode.jsonc", "opencode.json", "config.json")


def config_dir(env: Mapping[str, str]) -> Path:
    """`$XDG_CONFIG_HOME/opencode`, default `~/.config/opencode`."""
    return (env_path(env, "XDG_CONFIG_HOME") or home(env) / ".config") / "opencode"


def config_file(env: Mapping[str, str]) -> Path:
    """The file mtplxctl writes (see the module docstring for the order)."""
    explicit = env_path(env, "OPENCODE_CONFIG")
    if explicit:
        return explicit
    directory = config_dir(env)
    for filename in _GLOBAL_FILES:
        if (directory / filename).exists():
            return directory / filename
    return directory / "opencode.json"


def provider_entry(target: AgentTarget) -> dict[str, Any]:
    """The `provider.mtplx` object: endpoint, model limits and reasoning flag."""
    options: dict[str, Any] = {"baseURL": target.base_url, "timeout": False}
    if target.api_key_env:
        options["apiKey"] = "{env:%s}" % target.api_key_env
    return {
        "npm": "@ai-sdk/openai-compatible",
        "name": "mtplx (local)",
        "options": options,
        "models": {
            target.model_id: {
                "name": target.model_id,
                "tool_call": True,
                "reasoning": target.reasoning,
                "limit": {"context": target.context_window, "output": target.max_output_tokens},
            }
        },
    }


def plans(target: AgentTarget, env: Mapping[str, str]) -> list[FilePlan]:
    """One file: the provider entry plus `model` and `small_model` set to it."""
    selected = f"{PROVIDER_ID}/{target.model_id}"
    return [
        FilePlan(
            config_file(env),
            "jsonc",
            (
                Entry(("provider", PROVIDER_ID), provider_entry(target)),
                Entry(("model",), selected),
                Entry(("small_model",), selected),
            ),
        )
    ]


def facts(docs: list[Any]) -> Facts:
    """Endpoint, model and limits as the installed OpenCode config states them."""
    data = docs[0].data()
    provider = dig(data, "provider", PROVIDER_ID) or {}
    models = provider.get("models") if isinstance(provider.get("models"), dict) else {}
    model_id = next(iter(models), None)
    limit = dig(models, model_id, "limit") or {}
    api_key = dig(provider, "options", "apiKey")
    key = re.fullmatch(r"\{env:([^}]+)\}", api_key) if isinstance(api_key, str) else None
    return Facts(
        base_url=dig(provider, "options", "baseURL"),
        model_id=model_id,
        context_window=as_int(limit.get("context")),
        max_output_tokens=as_int(limit.get("output")),
        selected=data.get("model") == f"{PROVIDER_ID}/{model_id}",
        key_env=key.group(1) if key else None,
    )


def notes(target: AgentTarget) -> list[str]:
    """The launch hint."""
    return [f"run `opencode` (or `opencode run -m {PROVIDER_ID}/{target.model_id} \"...\"`)"]
