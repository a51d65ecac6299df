"""`mtplxctl service ...` exit codes and output, in process (the end-to-end file runs subprocesses)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtplxctl.cli import main


def _json(capsys: pytest.CaptureFixture) -> dict:
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("verb", ["install", "uninstall", "status"])
def test_no_service_manager_is_an_error_with_a_way_out(verb, monkeypatch, capsys):
    monkeypatch.setenv("MTPLX_SERVICE_MANAGER", "none")
    assert main(["service", verb]) == 1
    assert "mtplxctl start" in capsys.readouterr().err


def test_unknown_override_is_an_error(monkeypatch, capsys):
    monkeypatch.setenv("MTPLX_SERVICE_MANAGER", "upstart")
    assert main(["service", "status"]) == 1
    assert "expected launchd, systemd or none" in capsys.readouterr().err


def test_broken_config_refuses_install_and_writes_nothing(launchd_tools, isolated_home: Path, capsys):
    isolated_home.mkdir(parents=True, exist_ok=True)
    (isolated_home / "config.toml").write_text("shutdown_grace_seconds = 'soon'\n")
    assert main(["service", "install"]) == 1
    assert "configuration error" in capsys.readouterr().err
    assert launchd_tools.calls() == []
    assert not (Path.home() / "Library" / "LaunchAgents").exists()


def test_install_no_wait_json_then_status_and_uninstall(systemd_tools, capsys):
    assert main(["service", "install", "--no-wait", "--json"]) == 0
    installed = _json(capsys)
    assert installed["installed"] and installed["changed"] and installed["daemon"] is None
    assert installed["actions"][1:] == ["systemctl --user daemon-reload",
                                        "systemctl --user enable --now mtplxd.service"]
    assert main(["service", "status", "--json"]) == 0
    status = _json(capsys)
    assert status["manager"] == "systemd" and status["running"] and status["up_to_date"]
    assert main(["service", "uninstall", "--json"]) == 0
    assert _json(capsys)["uninstalled"] is True
    assert main(["service", "status", "--json"]) == 3
    assert _json(capsys)["installed"] is False


def test_status_of_an_installed_but_stopped_service_exits_3_with_a_hint(launchd_tools, capsys):
    assert main(["service", "install", "--no-wait"]) == 0
    from mtplxctl.launchd import service_manager

    service_manager().stop()
    capsys.readouterr()
    assert main(["service", "status"]) == 3
    out = capsys.readouterr().out
    assert "not loaded" in out and "mtplxctl start" in out


def test_install_without_a_systemd_user_session_leaves_the_running_daemon_alone(
        systemd_tools, monkeypatch, capsys):
    from support.daemon import start_daemon

    running = start_daemon("--no-model")
    try:
        monkeypatch.setenv("FAKE_FAIL", "systemctl show=1:Failed to connect to bus: No medium found")
        assert main(["service", "install"]) == 1
        err = " ".join(capsys.readouterr().err.split())
        assert "there is no systemd user session for you here" in err
        assert "loginctl enable-linger $USER" in err and "`mtplxctl start`" in err
        assert "Traceback" not in err
        assert running.process.poll() is None and running.client.is_running()
        assert not any("enable" in call for call in systemd_tools.calls())
        assert not (Path.home() / ".config/systemd/user/mtplxd.service").exists()
    finally:
        running.stop()


def test_a_unit_that_fails_to_start_gives_the_hand_started_daemon_back(systemd_tools, monkeypatch,
                                                                        capsys):
    from mtplxctl.client import ControlClient
    from mtplxd.paths import Paths
    from support.daemon import start_daemon

    running = start_daemon("--no-model")
    try:
        monkeypatch.setenv("FAKE_FAIL", "systemctl enable=1:Job for mtplxd.service failed")
        assert main(["service", "install"]) == 1
        assert "mtplxd was restarted by hand as before (it is running again)" in \
            " ".join(capsys.readouterr().err.split())
        client = ControlClient(Paths.from_env().socket)
        assert client.is_running() and client.call("daemon.status")["pid"] != running.pid
    finally:
        running.stop()
        try:
            ControlClient(Paths.from_env().socket).call("daemon.shutdown")
        except Exception:
            pass


def test_start_through_the_service_refuses_every_start_only_option_in_one_message(systemd_tools, capsys):
    assert main(["service", "install", "--no-wait"]) == 0
    from mtplxctl.launchd import service_manager

    service_manager().stop()
    systemd_tools.calls()
    capsys.readouterr()
    code = main(["start", "--model", "/nonexistent/model", "--host", "0.0.0.0", "--port", "0",
                 "--embedding-model", "e1", "--embedding-model", "e2", "--retrieval-trust-remote-code"])
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert code == 1
    assert "cannot take --host, --port, --embedding-model, --retrieval-trust-remote-code" in err
    for key in ("host", "port", "embedding_model", "retrieval_trust_remote_code"):
        assert f"mtplxctl config set {key} VALUE" in err
    assert "--hosts" not in err and "reranker" not in err  # only what was passed
    assert not any(call[:3] == ["systemctl", "--user", "start"] for call in systemd_tools.calls())


def test_restart_through_the_service_refuses_start_only_options_before_stopping(systemd_tools, capsys):
    """With the service installed the next daemon could not take --port: say so while the
    running daemon still serves, instead of stopping it first."""
    from mtplxctl.launchd import service_manager
    from support.daemon import start_daemon

    assert main(["service", "install", "--no-wait"]) == 0
    service_manager().stop()
    running = start_daemon("--no-model")
    try:
        capsys.readouterr()
        assert main(["restart", "--port", "28742"]) == 1
        err = " ".join(capsys.readouterr().err.split())
        assert "cannot restart: the login service runs mtplxd with the saved configuration, so it " \
               "cannot take --port" in err
        assert f"mtplxd (pid {running.pid}) is still running, nothing was stopped" in err
        assert running.process.poll() is None and running.client.is_running()
    finally:
        running.stop()
