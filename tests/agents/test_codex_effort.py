"""Codex's `model_reasoning_effort`: written only for a model that lacks some of Codex's levels,
to one the model has (the daemon answers any other with a 400); re-installing for another model
is a merge that gives the user's own setting and keys back."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from mtplxctl.agents import codex, manager
from mtplxctl.agents.target import AgentTarget

ALL_LEVELS = ("none", "minimal", "low", "medium", "high", "xhigh")  # a Qwen template's
USER_CONFIG = ('# mine\nmodel = "gpt-5"\nmodel_reasoning_effort = "xhigh"  # for the hosted model\n'
               'approval_policy = "on-request"\n\n[mcp_servers.docs]\ncommand = "docs-mcp"\n')


@pytest.mark.parametrize("levels,written", [
    (ALL_LEVELS, None),          # Qwen: thinking switch, every level works
    (("none",), "none"),         # LFM2 instruct, or a plain-AR template with no switch
    (("high",), "high"),         # LFM2.5 thinking: always reasons
    (("low", "medium", "high"), "medium"),  # Codex's default when the model has it
    ((), None),                  # an older daemon that does not say: leave Codex alone
])
def test_the_effort_written_is_one_the_model_has(target: AgentTarget, levels, written):
    assert codex.reasoning_effort(replace(target, reasoning_efforts=levels)) == written


def test_from_status_reads_the_levels(status):
    status["model"]["reasoning_efforts"] = ["none"]
    assert AgentTarget.from_status(status).reasoning_efforts == ("none",)


def _config(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def test_switching_models_rewrites_the_effort_and_keeps_the_users_keys(env, mtplx_home, target, user_home):
    path = user_home / ".codex/config.toml"
    path.parent.mkdir()
    path.write_text(USER_CONFIG)
    lfm2 = replace(target, model_id="lfm2-instruct", reasoning_efforts=("none",))
    qwen = replace(target, model_id="qwen-coder", reasoning_efforts=ALL_LEVELS)
    thinking = replace(target, model_id="lfm2.5-thinking", reasoning_efforts=("high",))

    assert manager.install_agent("codex", lfm2, env, mtplx_home).status == "installed"
    data = _config(path)
    assert (data["model"], data["model_reasoning_effort"]) == ("lfm2-instruct", "none")
    assert data["approval_policy"] == "on-request" and data["mcp_servers"]["docs"]["command"] == "docs-mcp"

    manager.install_agent("codex", qwen, env, mtplx_home)  # every level works: the user's own is back
    data = _config(path)
    assert (data["model"], data["model_reasoning_effort"]) == ("qwen-coder", "xhigh")
    assert "# for the hosted model" in path.read_text()

    manager.install_agent("codex", thinking, env, mtplx_home)
    data = _config(path)
    assert (data["model"], data["model_reasoning_effort"]) == ("lfm2.5-thinking", "high")
    assert data["approval_policy"] == "on-request" and data["mcp_servers"]["docs"]["command"] == "docs-mcp"

    manager.uninstall_agent("codex", mtplx_home)
    assert path.read_text() == USER_CONFIG


def test_an_effort_written_into_a_config_without_one_goes_when_the_model_changes(
        env, mtplx_home, target, user_home):
    path = user_home / ".codex/config.toml"
    manager.install_agent("codex", replace(target, reasoning_efforts=("none",)), env, mtplx_home)
    text = path.read_text()
    assert _config(path)["model_reasoning_effort"] == "none"
    # Top-level keys stay above the tables, where TOML needs them.
    assert text.index("model_reasoning_effort") < text.index("[features]")
    manager.install_agent("codex", replace(target, reasoning_efforts=ALL_LEVELS), env, mtplx_home)
    assert "model_reasoning_effort" not in _config(path)
    assert _config(path)["model_provider"] == "mtplx"
