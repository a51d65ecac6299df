"""`mtplxctl agents` and `mtplxctl doctor` end to end, against a real daemon on a tiny model."""

from __future__ import annotations

import json
import time
import tomllib

import pytest

from mtplxctl.cli import main
from support.daemon import start_daemon


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_install_without_a_daemon_exits_3(capsys, user_home):
    code, _ = _run(capsys, "agents", "install", "opencode")
    assert code == 3
    assert not (user_home / ".config").exists()


def test_unknown_agent_is_an_error(capsys):
    assert _run(capsys, "agents", "status", "vim")[0] == 1


def test_status_json_lists_every_agent(capsys):
    code, out = _run(capsys, "agents", "status", "--json")
    assert code == 0
    assert [a["agent"] for a in json.loads(out)["agents"]] == ["opencode", "pi", "hermes", "codex", "claude"]


def test_doctor_without_a_daemon_exits_3(capsys):
    code, out = _run(capsys, "doctor", "--json")
    assert code == 3 and json.loads(out)["ok"] is False


@pytest.fixture
def daemon(tmp_path):
    """A real mtplxd on a free port serving a tiny random-weight model; yields its status."""
    from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint

    running = start_daemon("--model", str(write_tiny_checkpoint(tmp_path / "tiny-coder")))
    try:
        deadline = time.monotonic() + 60
        status = running.client.call("daemon.status")
        while (status.get("model") or {}).get("state") != "loaded" and time.monotonic() < deadline:
            time.sleep(0.2)
            status = running.client.call("daemon.status")
        assert status["model"]["state"] == "loaded", status
        yield status
    finally:
        running.stop()


def test_install_doctor_uninstall_against_the_live_daemon(capsys, daemon, user_home):
    codex = user_home / ".codex/config.toml"
    codex.parent.mkdir()
    codex.write_text('# mine\nmodel = "gpt-5"\n')

    code, out = _run(capsys, "agents", "install", "opencode", "codex", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["dry_run"] is True
    assert codex.read_text() == '# mine\nmodel = "gpt-5"\n' and not (user_home / ".config").exists()

    code, out = _run(capsys, "agents", "install", "opencode", "codex", "--json")
    assert code == 0, out
    assert {a["status"] for a in json.loads(out)["agents"]} == {"installed"}
    data = tomllib.loads(codex.read_text())
    assert data["model"] == daemon["model"]["id"]
    assert data["model_providers"]["mtplx"]["base_url"] == daemon["http"]["base_url"]
    assert data["model_context_window"] == daemon["model"]["context_length"]

    code, out = _run(capsys, "doctor", "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"], report
    assert {c["agent"] for c in report["checks"]} >= {"daemon", "opencode", "codex"}

    code, out = _run(capsys, "agents", "status", "--json")
    installed = {a["agent"]: a["installed"] for a in json.loads(out)["agents"]}
    assert installed["opencode"] and installed["codex"] and not installed["pi"]

    code, out = _run(capsys, "agents", "uninstall", "all", "--json")
    assert code == 0
    assert codex.read_text() == '# mine\nmodel = "gpt-5"\n'
    assert not (user_home / ".config").exists()
