"""End to end on Linux: the fake service manager runs the real mtplxd from the generated unit's
ExecStart (or the plist's ProgramArguments), and `mtplxctl` subprocesses drive it as a user would.

The fakes give the daemon only what the real managers give it (a minimal environment plus the
service file's Environment=/EnvironmentVariables), so MTPLX_HOME must come from the service file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from support.daemon import run_ctl, start_daemon
from support.waiting import wait_gone

STOP = ["systemctl", "--user", "stop", "mtplxd.service"]


@pytest.fixture
def real_daemon(fake_tools, daemon_config: Path, monkeypatch: pytest.MonkeyPatch):
    """The fakes run the real `python -m mtplxd` instead of the stand-in."""
    monkeypatch.delenv("FAKE_STANDIN")
    return fake_tools


def _json(result) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_systemd_unit_runs_the_daemon_and_mtplxctl_start_stop_go_through_systemctl(
        real_daemon, monkeypatch: pytest.MonkeyPatch, isolated_home: Path):
    monkeypatch.setenv("MTPLX_SERVICE_MANAGER", "systemd")
    installed = _json(run_ctl("service", "install", "--json"))
    assert installed["manager"] == "systemd" and installed["changed"]
    assert installed["daemon"]["supervisor"] == "systemd"
    calls = real_daemon.calls()
    assert ["systemctl", "--user", "enable", "--now", "mtplxd.service"] in calls

    status = _json(run_ctl("status", "--json"))
    pid = real_daemon.main_pid("systemd", "mtplxd.service")
    assert status["running"] and status["supervisor"] == "systemd" and status["pid"] == pid
    assert status["home"] == str(isolated_home)
    assert "systemd" in run_ctl("status").stdout

    service = _json(run_ctl("service", "status", "--json"))
    assert service["running"] and service["pid"] == pid and service["enabled"]

    stopped = run_ctl("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert STOP in real_daemon.calls()
    assert real_daemon.exit_status("systemd", "mtplxd.service") == 0  # SIGTERM -> drain -> exit 0
    assert wait_gone(pid)
    assert run_ctl("status").returncode == 3
    # The daemon's output went where the unit's StandardOutput= says.
    assert (isolated_home / "logs" / "mtplxd.out").exists()

    started = _json(run_ctl("start", "--json"))
    assert ["systemctl", "--user", "start", "mtplxd.service"] in real_daemon.calls()
    assert started["supervisor"] == "systemd" and started["pid"] != pid

    removed = run_ctl("service", "uninstall")
    assert removed.returncode == 0, removed.stderr
    assert real_daemon.exit_status("systemd", "mtplxd.service") == 0
    assert wait_gone(started["pid"])
    after = run_ctl("service", "status", "--json")
    assert after.returncode == 3 and json.loads(after.stdout)["installed"] is False


def test_launchagent_takes_over_a_hand_started_daemon_and_stop_boots_it_out(
        real_daemon, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MTPLX_SERVICE_MANAGER", "launchd")
    by_hand = start_daemon("--no-model")

    installed = _json(run_ctl("service", "install", "--json"))
    assert installed["notes"] and str(by_hand.pid) in installed["notes"][0]
    assert by_hand.process.wait(20) == 0
    assert installed["daemon"]["supervisor"] == "launchd"
    target = f"gui/{os.getuid()}/com.mtplx.mtplxd"
    pid = real_daemon.main_pid("launchd", "com.mtplx.mtplxd")
    assert installed["daemon"]["pid"] == pid

    human = run_ctl("service", "status")
    assert human.returncode == 0 and f"running, pid {pid}" in human.stdout

    real_daemon.calls()
    stopped = run_ctl("stop")
    assert stopped.returncode == 0, stopped.stderr
    calls = real_daemon.calls()
    assert ["launchctl", "bootout", target] in calls
    assert not any("-k" in call for call in calls)
    assert real_daemon.exit_status("launchd", "com.mtplx.mtplxd") == 0
    assert wait_gone(pid)

    assert run_ctl("service", "uninstall").returncode == 0
    assert not (Path.home() / "Library" / "LaunchAgents" / "com.mtplx.mtplxd.plist").exists()
