"""Claude Code: the `env` block of its settings.json pointed at the daemon's Anthropic endpoint.

File: `$CLAUDE_CONFIG_DIR/settings.json` (default `~/.claude`). Owned entries:
`env.ANTHROPIC_BASE_URL` (the server root, without /v1), `env.ANTHROPIC_MODEL` and the
three `env.ANTHROPIC_DEFAULT_*_MODEL` tiers, `env.CLAUDE_CODE_MAX_OUTPUT_TOKENS` (the real
ceiling), `env.API_TIMEOUT_MS` (an hour: a cold CPU prefill can outlast the default 600 s),
and the credential: a dummy `env.ANTHROPIC_AUTH_TOKEN` for a keyless daemon, or an
`apiKeyHelper` command that prints the key's variable when the daemon requires one (the env
block holds only literals, and the key must not be pasted there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .base import Facts, as_int, env_path, home
from .merge import Entry, FilePlan
from .target import AgentTarget

name = "claude"
title = "Claude Code"
binary = "claude"
KEYLESS_TOKEN = "mtplx-local"
API_TIMEOUT_MS = "3600000"
_TIERS = ("ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL")


def config_dir(env: Mapping[str, str]) -> Path:
    """`$CLAUDE_CONFIG_DIR`, default `~/.claude`."""
    return env_path(env, "CLAUDE_CONFIG_DIR") or home(env) / ".claude"


def plans(target: AgentTarget, env: Mapping[str, str]) -> list[FilePlan]:
    """settings.json: the env variables (and apiKeyHelper when a key is needed)."""
    entries = [
        Entry(("env", "ANTHROPIC_BASE_URL"), target.server_root),
        Entry(("env", "ANTHROPIC_MODEL"), target.model_id),
        *(Entry(("env", tier), target.model_id) for tier in _TIERS),
        Entry(("env", "CLAUDE_CODE_MAX_OUTPUT_TOKENS"), str(target.max_output_tokens)),
        # Claude Code gives up on a request after 600 s by default; a cold prefill of its 24k
        # first prompt (or of a 64k conversation) on a CPU can take longer.
        Entry(("env", "API_TIMEOUT_MS"), API_TIMEOUT_MS),
    ]
    if target.api_key_env:
        entries.append(Entry(("apiKeyHelper",), f"printenv {target.api_key_env}"))
    else:
        entries.append(Entry(("env", "ANTHROPIC_AUTH_TOKEN"), KEYLESS_TOKEN))
    return [FilePlan(config_dir(env) / "settings.json", "jsonc", tuple(entries))]


def facts(docs: list[Any]) -> Facts:
    """Endpoint, model and output cap as the installed settings.json states them."""
    data = docs[0].data()
    env_block = data.get("env") if isinstance(data.get("env"), dict) else {}
    base = env_block.get("ANTHROPIC_BASE_URL")
    helper = data.get("apiKeyHelper")
    key_env = helper.split(None, 1)[1] if isinstance(helper, str) and helper.startswith("printenv ") else None
    return Facts(
        # Compared with the OpenAI base URL elsewhere: report it in that form.
        base_url=(base.rstrip("/") + "/v1") if isinstance(base, str) else None,
        model_id=env_block.get("ANTHROPIC_MODEL"),
        context_window=None,
        max_output_tokens=as_int(env_block.get("CLAUDE_CODE_MAX_OUTPUT_TOKENS")),
        selected=isinstance(base, str),
        key_env=key_env,
    )


def notes(target: AgentTarget) -> list[str]:
    """What overrides these settings, and the launch hint."""
    return [
        "an ANTHROPIC_API_KEY exported in your shell takes precedence over these settings: unset it",
        f"run `claude` (or `claude -p \"...\" --model {target.model_id}`)",
    ]
