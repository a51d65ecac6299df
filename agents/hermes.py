"""Hermes Agent: the `model:` block of its config.yaml pointing at the daemon.

File: `$HERMES_HOME/config.yaml` (default `~/.hermes`). Owned entry: the top-level `model`
block (replaced whole while installed, restored on uninstall). `context_length` and
`max_tokens` are always set: without `max_tokens` Hermes asks custom endpoints for 65536
output tokens. When the daemon requires a key, the endpoint goes in a named custom provider
(the top-level `custom_providers` block) whose `key_env` names the key's variable, because
the `model` block itself only takes a literal `api_key`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .base import Facts, as_int, env_path, home
from .merge import Entry, FilePlan
from .target import PROVIDER_ID, AgentTarget

name = "hermes"
title = "Hermes Agent"
binary = "hermes"
# Hermes refuses to start with a smaller context window (agent/model_metadata.py).
HERMES_MIN_CONTEXT = 64_000


def config_dir(env: Mapping[str, str]) -> Path:
    """`$HERMES_HOME`, default `~/.hermes`."""
    return env_path(env, "HERMES_HOME") or home(env) / ".hermes"


def model_block(target: AgentTarget) -> dict[str, Any]:
    """The `model:` mapping."""
    block: dict[str, Any] = {"provider": "custom", "default": target.model_id}
    if target.api_key_env:
        block["provider"] = f"custom:{PROVIDER_ID}"
    else:
        block["base_url"] = target.base_url
        block["api_mode"] = "chat_completions"
    block["context_length"] = target.context_window
    block["max_tokens"] = target.max_output_tokens
    return block


def custom_providers_block(target: AgentTarget) -> list[dict[str, Any]]:
    """The `custom_providers:` list holding the keyed endpoint."""
    return [
        {
            "name": PROVIDER_ID,
            "base_url": target.base_url,
            "key_env": target.api_key_env,
            "api_mode": "chat_completions",
            "models": {target.model_id: {"context_length": target.context_window}},
        }
    ]


def plans(target: AgentTarget, env: Mapping[str, str]) -> list[FilePlan]:
    """config.yaml: the model block (and the custom provider when a key is needed)."""
    entries = [Entry(("model",), model_block(target))]
    if target.api_key_env:
        entries.insert(0, Entry(("custom_providers",), custom_providers_block(target)))
    return [FilePlan(config_dir(env) / "config.yaml", "yaml", tuple(entries))]


def conflicts(target: AgentTarget, docs: list[Any]) -> str | None:
    """Why installing here would take over something of the user's, or None."""
    if not target.api_key_env:
        return None
    existing = docs[0].data().get("custom_providers")
    only_mine = isinstance(existing, list) and len(existing) == 1 and isinstance(existing[0], dict) \
        and existing[0].get("name") == PROVIDER_ID
    if existing is not None and not only_mine:
        return (
            "config.yaml already has custom_providers of yours; add this entry to that list yourself, "
            f"then set model.provider to custom:{PROVIDER_ID}: name: {PROVIDER_ID}, base_url: {target.base_url}, "
            f"key_env: {target.api_key_env}, api_mode: chat_completions"
        )
    return None


def facts(docs: list[Any]) -> Facts:
    """Endpoint, model and limits as the installed config.yaml states them."""
    data = docs[0].data()
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    provider = model.get("provider")
    base_url, key_env = model.get("base_url"), None
    if provider == f"custom:{PROVIDER_ID}":
        named = [p for p in (data.get("custom_providers") or []) if isinstance(p, dict) and p.get("name") == PROVIDER_ID]
        if named:
            base_url, key_env = named[0].get("base_url"), named[0].get("key_env")
    return Facts(
        base_url=base_url,
        model_id=model.get("default") or model.get("model"),
        context_window=as_int(model.get("context_length")),
        max_output_tokens=as_int(model.get("max_tokens")),
        selected=provider in ("custom", f"custom:{PROVIDER_ID}"),
        key_env=key_env,
    )


def notes(target: AgentTarget) -> list[str]:
    """The 64K-context warning when it applies, and the launch hint."""
    out = []
    if target.context_window < HERMES_MIN_CONTEXT:
        out.append(
            f"warning: Hermes refuses to start with a context window under {HERMES_MIN_CONTEXT} tokens; "
            f"{target.model_id} is served with {target.context_window}. Serve it with a larger context."
        )
    out.append("run `hermes`")
    return out
