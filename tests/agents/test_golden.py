"""Golden files: each agent installed over a realistic user config from a temp HOME.

The `.in` files are the user's config before, the `.out` files the expected result. Run with
MTPLX_UPDATE_GOLDEN=1 to rewrite the `.out` files after an intended change (then review them).
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
import yaml

from mtplxctl.agents import manager
from mtplxctl.agents.jsonc import JsoncDocument

GOLDEN = Path(__file__).parent / "golden"
# Where each golden input goes under HOME.
LAYOUT = {
    "opencode": {"opencode.jsonc": ".config/opencode/opencode.jsonc"},
    "pi": {"models.json": ".pi/agent/models.json", "settings.json": ".pi/agent/settings.json"},
    "hermes": {"config.yaml": ".hermes/config.yaml"},
    "codex": {"config.toml": ".codex/config.toml"},
    "claude": {"settings.json": ".claude/settings.json"},
}


def _parse(path: Path) -> dict:
    """Parse a config the way its agent does (JSONC, YAML, TOML)."""
    text = path.read_text()
    if path.suffix == ".toml":
        return tomllib.loads(text)
    if path.suffix == ".yaml":
        return yaml.safe_load(text)
    return JsoncDocument(text).data()


def _place_inputs(agent: str, home: Path) -> dict[str, Path]:
    placed = {}
    for name, rel in LAYOUT[agent].items():
        dest = home / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text((GOLDEN / agent / f"{name}.in").read_text())
        placed[name] = dest
    return placed


@pytest.mark.parametrize("agent", list(LAYOUT))
def test_install_over_user_config_matches_golden_and_uninstall_restores_it(agent, env, mtplx_home, target, user_home):
    placed = _place_inputs(agent, user_home)
    result = manager.install_agent(agent, target, env, mtplx_home)
    assert result.status == "installed", result.error
    for name, path in placed.items():
        golden = GOLDEN / agent / f"{name}.out"
        if os.environ.get("MTPLX_UPDATE_GOLDEN"):
            golden.write_text(path.read_text())
        assert path.read_text() == golden.read_text(), f"{agent}/{name} differs from its golden file"
        _parse(path)  # the result parses back in the agent's format
    manager.uninstall_agent(agent, mtplx_home)
    for name, path in placed.items():
        assert path.read_text() == (GOLDEN / agent / f"{name}.in").read_text()


def test_opencode_round_trip_values(env, mtplx_home, target, user_home):
    path = _place_inputs("opencode", user_home)["opencode.jsonc"]
    manager.install_agent("opencode", target, env, mtplx_home)
    data = _parse(path)
    provider = data["provider"]["mtplx"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"] == "http://127.0.0.1:8000/v1"
    assert "apiKey" not in provider["options"]  # keyless daemon: no Authorization header
    model = provider["models"]["mtplx-tiny-coder"]
    assert model["limit"] == {"context": 32768, "output": 8192}
    assert model["reasoning"] is True
    assert data["model"] == data["small_model"] == "mtplx/mtplx-tiny-coder"
    assert data["provider"]["anthropic"] == {"options": {"timeout": 600000}}
    assert data["theme"] == "tokyonight" and data["autoupdate"] is False
    assert "// the usual default" in path.read_text() and "/* a hosted provider I also use */" in path.read_text()


def test_pi_round_trip_values(env, mtplx_home, target, user_home):
    placed = _place_inputs("pi", user_home)
    manager.install_agent("pi", target, env, mtplx_home)
    models = _parse(placed["models.json"])
    provider = models["providers"]["mtplx"]
    assert provider["api"] == "openai-completions" and provider["baseUrl"] == "http://127.0.0.1:8000/v1"
    # The real ceiling, so Pi does not send its 16384 default.
    assert provider["models"][0]["maxTokens"] == 8192
    assert provider["models"][0]["contextWindow"] == 32768
    assert provider["apiKey"] == "mtplx-local"  # Pi hides models without auth
    assert models["providers"]["ollama"]["apiKey"] == "ollama"
    settings = _parse(placed["settings.json"])
    assert settings == {"theme": "dark", "defaultProvider": "mtplx", "defaultModel": "mtplx-tiny-coder"}


def test_hermes_round_trip_values(env, mtplx_home, target, user_home):
    path = _place_inputs("hermes", user_home)["config.yaml"]
    manager.install_agent("hermes", target, env, mtplx_home)
    data = _parse(path)
    assert data["model"] == {
        "provider": "custom", "default": "mtplx-tiny-coder", "base_url": "http://127.0.0.1:8000/v1",
        "api_mode": "chat_completions", "context_length": 32768, "max_tokens": 8192,
    }
    assert data["terminal"] == {"backend": "local", "timeout": 180}
    assert "  backend: local  # run commands here\n" in path.read_text()


def test_codex_round_trip_values(env, mtplx_home, target, user_home):
    path = _place_inputs("codex", user_home)["config.toml"]
    manager.install_agent("codex", target, env, mtplx_home)
    data = _parse(path)
    assert data["model"] == "mtplx-tiny-coder" and data["model_provider"] == "mtplx"
    assert data["model_providers"]["mtplx"] == {
        "name": "mtplx (local)", "base_url": "http://127.0.0.1:8000/v1", "wire_api": "responses",
        "stream_idle_timeout_ms": 3600000}
    assert data["web_search"] == "disabled"
    assert data["features"] == {"web_search_request": True, "image_generation": False}
    assert data["model_context_window"] == 32768
    assert data["model_providers"]["openrouter"]["env_key"] == "OPENROUTER_API_KEY"
    assert data["approval_policy"] == "on-request" and data["mcp_servers"]["docs"]["command"] == "docs-mcp"


def test_claude_round_trip_values(env, mtplx_home, target, user_home):
    path = _place_inputs("claude", user_home)["settings.json"]
    manager.install_agent("claude", target, env, mtplx_home)
    data = json.loads(path.read_text())
    assert data["env"]["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8000"  # root, no /v1
    assert data["env"]["ANTHROPIC_MODEL"] == "mtplx-tiny-coder"
    assert data["env"]["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "mtplx-tiny-coder"
    assert data["env"]["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "8192"
    assert data["env"]["ANTHROPIC_AUTH_TOKEN"] == "mtplx-local"
    assert data["env"]["DISABLE_TELEMETRY"] == "1" and data["permissions"] == {"allow": ["Bash(git status)"]}
