"""Pi: a provider in `models.json` and the default model in `settings.json`.

Files live in `$PI_CODING_AGENT_DIR` (default `~/.pi/agent`). Owned entries:
`providers.mtplx` in models.json; `defaultProvider` and `defaultModel` in settings.json.
The model entry advertises the real output ceiling as `maxTokens`, so Pi asks for what the
model can give instead of its built-in 16384 default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .base import Facts, as_int, dig, env_path, home
from .merge import Entry, FilePlan
from .target import PROVIDER_ID, AgentTarget

name = "pi"
title = "Pi"
binary = "pi"
# Pi hides models that have no auth configured, so a keyless daemon still gets a dummy key.
KEYLESS_API_KEY = "mtplx-local"


def config_dir(env: Mapping[str, str]) -> Path:
    """`$PI_CODING_AGENT_DIR`, default `~/.pi/agent`."""
    return env_path(env, "PI_CODING_AGENT_DIR") or home(env) / ".pi" / "agent"


def api_key_value(target: AgentTarget) -> str:
    """The `apiKey` field: a command reading the key's variable, or the keyless dummy.

    `!command` is resolved by every Pi version; the env syntax changed (`VAR` then `$VAR`).
    """
    return f"!printenv {target.api_key_env}" if target.api_key_env else KEYLESS_API_KEY


def provider_entry(target: AgentTarget) -> dict[str, Any]:
    """The `providers.mtplx` object with its one model."""
    return {
        "baseUrl": target.base_url,
        "api": "openai-completions",
        "apiKey": api_key_value(target),
        "models": [
            {
                "id": target.model_id,
                "name": target.model_id,
                "reasoning": target.reasoning,
                "input": ["text"],
                "contextWindow": target.context_window,
                "maxTokens": target.max_output_tokens,
                "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
            }
        ],
    }


def plans(target: AgentTarget, env: Mapping[str, str]) -> list[FilePlan]:
    """models.json (the provider) and settings.json (the defaults)."""
    directory = config_dir(env)
    return [
        FilePlan(directory / "models.json", "jsonc", (Entry(("providers", PROVIDER_ID), provider_entry(target)),)),
        FilePlan(
            directory / "settings.json",
            "jsonc",
            (Entry(("defaultProvider",), PROVIDER_ID), Entry(("defaultModel",), target.model_id)),
        ),
    ]


def facts(docs: list[Any]) -> Facts:
    """Endpoint, model and limits as the installed Pi files state them."""
    provider = dig(docs[0].data(), "providers", PROVIDER_ID) or {}
    model = dig(provider, "models", 0) or {}
    settings = docs[1].data() if len(docs) > 1 else {}
    api_key = provider.get("apiKey")
    key_env = api_key.split(None, 1)[1] if isinstance(api_key, str) and api_key.startswith("!printenv ") else None
    return Facts(
        base_url=provider.get("baseUrl"),
        model_id=model.get("id"),
        context_window=as_int(model.get("contextWindow")),
        max_output_tokens=as_int(model.get("maxTokens")),
        selected=settings.get("defaultProvider") == PROVIDER_ID and settings.get("defaultModel") == model.get("id"),
        key_env=key_env,
    )


def notes(target: AgentTarget) -> list[str]:
    """The launch hint."""
    return [f"run `pi` (or `pi --provider {PROVIDER_ID} --model {target.model_id}`)"]
