"""doctor: installed configs checked against the daemon's status, good and broken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtplxctl.agents import manager
from mtplxctl.agents.checks import FAIL, OK, WARN, check_agent
from mtplxctl.agents.record import load_record
from mtplxctl.commands.doctor import diagnose, exit_code


def _levels(checks):
    """The worst level seen for each check name."""
    rank = {OK: 0, WARN: 1, FAIL: 2}
    worst: dict[str, str] = {}
    for c in checks:
        if rank[c.level] >= rank.get(worst.get(c.name, OK), 0):
            worst[c.name] = c.level
    return worst


@pytest.fixture
def installed(env, mtplx_home, target):
    for agent in manager.AGENTS:
        manager.install_agent(agent, target, env, mtplx_home)
    return load_record(mtplx_home)


@pytest.mark.parametrize("agent", list(manager.AGENTS))
def test_fresh_install_is_healthy(agent, installed, env, status):
    checks = check_agent(agent, installed[agent], status, env)
    levels = _levels(checks)
    assert levels["config"] == levels["base_url"] == levels["model"] == OK
    assert FAIL not in levels.values()
    if agent == "hermes":  # 32768 < Hermes' 64000 minimum: said, not failed
        assert [c for c in checks if c.level == WARN and "64000" in c.detail]
    else:
        assert WARN not in levels.values()


@pytest.mark.parametrize("agent", list(manager.AGENTS))
def test_daemon_on_another_port_is_a_failure(agent, installed, env, status):
    status["http"]["base_url"] = "http://127.0.0.1:9999/v1"
    checks = check_agent(agent, installed[agent], status, env)
    assert _levels(checks)["base_url"] == FAIL
    assert "mtplxctl agents install" in next(c.detail for c in checks if c.name == "base_url")


@pytest.mark.parametrize("agent", list(manager.AGENTS))
def test_other_model_served_is_a_failure(agent, installed, env, status):
    status["model"]["id"] = "another-model"
    assert _levels(check_agent(agent, installed[agent], status, env))["model"] == FAIL


@pytest.mark.parametrize("agent", ["opencode", "pi", "hermes", "claude"])
def test_output_cap_above_the_served_ceiling_is_a_failure(agent, installed, env, status):
    status["model"]["max_output_tokens"] = 4096
    assert _levels(check_agent(agent, installed[agent], status, env))["output"] == FAIL


@pytest.mark.parametrize("agent", ["opencode", "pi", "hermes", "codex"])
def test_context_larger_than_served_is_a_failure(agent, installed, env, status):
    status["model"]["context_length"] = 16384
    assert _levels(check_agent(agent, installed[agent], status, env))["context"] == FAIL


def test_broken_config_is_reported_not_raised(installed, env, status):
    path = Path(installed["codex"]["files"][0]["path"])
    path.write_text(path.read_text() + "this is = = not toml\n")
    checks = check_agent("codex", installed["codex"], status, env)
    assert [(c.name, c.level) for c in checks] == [("config", FAIL)]
    assert "not valid TOML" in checks[0].detail


def test_missing_config_and_removed_entry_are_failures(installed, env, status):
    Path(installed["hermes"]["files"][0]["path"]).unlink()
    assert _levels(check_agent("hermes", installed["hermes"], status, env)) == {"config": FAIL}
    path = Path(installed["opencode"]["files"][0]["path"])
    data = json.loads(path.read_text())
    del data["provider"]["mtplx"]
    path.write_text(json.dumps(data))
    assert _levels(check_agent("opencode", installed["opencode"], status, env))["entry"] == FAIL


def test_default_switched_away_by_the_user_is_a_warning(installed, env, status):
    path = Path(installed["opencode"]["files"][0]["path"])
    data = json.loads(path.read_text())
    data["model"] = "anthropic/claude-sonnet-4"
    path.write_text(json.dumps(data))
    assert _levels(check_agent("opencode", installed["opencode"], status, env))["default"] == WARN


def test_keyed_daemon_needs_the_reference_and_the_variable(env, mtplx_home, keyed_target, target, status):
    manager.install_agent("codex", keyed_target, env, mtplx_home)
    record = load_record(mtplx_home)["codex"]
    status["http"]["key_required"] = True
    assert _levels(check_agent("codex", record, status, env))["api_key"] == WARN  # variable unset
    assert _levels(check_agent("codex", record, status, {**env, "MTPLX_API_KEY": "k"}))["api_key"] == OK
    manager.uninstall_agent("codex", mtplx_home)
    manager.install_agent("codex", target, env, mtplx_home)
    record = load_record(mtplx_home)["codex"]
    assert _levels(check_agent("codex", record, status, env))["api_key"] == FAIL  # written keyless


def test_diagnose_and_exit_codes(installed, env, status):
    checks = diagnose(status, installed, env)
    assert exit_code(checks, True) == 0
    down = diagnose(None, installed, env)
    assert down[0].level == FAIL and exit_code(down, False) == 3
    assert all(c.level != FAIL for c in down[1:])  # configs still checked for presence/parse
    status["model"]["id"] = "other"
    assert exit_code(diagnose(status, installed, env), True) == 1
    assert diagnose(status, {}, env)[1].name == "installed"
