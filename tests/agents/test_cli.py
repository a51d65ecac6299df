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


def _narrow(monkeypatch, *modules):
    """Point each command module's console at one 80-column recording console."""
    from rich.console import Console

    console = Console(width=80, record=True, highlight=False)
    for module in modules:
        monkeypatch.setattr(module, "console", console)
    return console


def test_status_and_agents_status_keep_everything_in_80_columns(capsys, daemon, monkeypatch):
    import mtplxctl.commands.agents as agents_cmd
    import mtplxctl.commands.daemon as daemon_cmd

    assert _run(capsys, "agents", "install", "opencode", "codex")[0] == 0
    for argv in (["status"], ["agents", "status"]):
        console = _narrow(monkeypatch, daemon_cmd, agents_cmd)
        assert main(argv) == 0
        shown = console.export_text()
        assert "…" not in shown and max(map(len, shown.splitlines())) <= 80, shown
        cells = [cell for row in _cells(shown) for cell in row]
        for whole in (daemon["http"]["base_url"], daemon["model"]["id"]):
            assert any(cell.startswith(whole) for cell in cells), (whole, shown)


def _cells(table: str) -> list[list[str]]:
    """The cells of a rendered rich table, each with its wrapped or folded lines joined again
    (spaces dropped, so a wrapped and a folded cell read the same). A row starts where the
    first column has text; borderless tables split their two columns at the first space run."""
    rows: list[list[str]] = []
    for line in table.splitlines():
        if "│" in line:
            parts = [p.strip() for p in line.strip().strip("│").split("│")]
        elif line.startswith(" ") or not line.strip():
            parts = ["", line.strip()]
        else:
            parts = [p for p in line.split("  ", 1)]
            parts = [parts[0].strip(), parts[1].strip() if len(parts) > 1 else ""]
        if set("".join(parts)) <= set("━─┳┻╇┏┓┗┛┡┩└┘┌┐├┤┬┴┼ "):
            continue
        if parts[0] or not rows:
            rows.append(["".join(p.split()) for p in parts])
        else:
            rows[-1] = [a + "".join(b.split()) for a, b in zip(rows[-1], parts)]
    return rows


def test_install_all_names_what_it_skipped_and_why(capsys, daemon, user_home):
    (user_home / ".codex").mkdir()  # only Codex looks installed here
    code, out = _run(capsys, "agents", "install", "all", "--json")
    assert code == 0, out
    results = {a["agent"]: a for a in json.loads(out)["agents"]}
    assert results["codex"]["status"] == "installed"
    for name in ("opencode", "pi", "hermes"):
        assert results[name]["status"] == "skipped"
        assert "not found" in results[name]["notes"][0]
        assert f"`mtplxctl agents install {name}` writes it anyway" in results[name]["notes"][0]
    assert results["claude"]["status"] == "skipped" and "opt-in" in results["claude"]["notes"][0]


def test_a_named_agent_installs_before_its_binary_exists_with_a_note(capsys, daemon, user_home):
    code, out = _run(capsys, "agents", "install", "pi", "--json")
    assert code == 0, out
    [pi] = json.loads(out)["agents"]
    assert pi["status"] == "installed" and "not found" in pi["notes"][0] and "once it is installed" in pi["notes"][0]
