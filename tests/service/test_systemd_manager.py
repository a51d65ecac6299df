"""The systemd manager's exact `systemctl --user` sequences, against a recording fake that runs
the unit (a stand-in daemon here; the real mtplxd in test_end_to_end.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mtplxctl.launchd import ServiceError, service_manager
from mtplxctl.launchd.systemd import SHOW_PROPERTIES, SystemdManager

SHOW = ["systemctl", "--user", "show", "mtplxd.service", "--property=" + ",".join(SHOW_PROPERTIES)]
RELOAD = ["systemctl", "--user", "daemon-reload"]
ENABLE_NOW = ["systemctl", "--user", "enable", "--now", "mtplxd.service"]


def _unit_dir() -> Path:
    return Path.home() / ".config" / "systemd" / "user"


def _manager() -> SystemdManager:
    manager = service_manager(strict=True)
    assert isinstance(manager, SystemdManager)
    return manager


def test_fresh_install_writes_unit_reloads_and_enables_now(systemd_tools):
    report = _manager().install()
    assert systemd_tools.calls() == [SHOW, RELOAD, ENABLE_NOW]
    assert report.changed and report.actions[0] == f"wrote {_unit_dir() / 'mtplxd.service'}"
    assert (_unit_dir() / "default.target.wants" / "mtplxd.service").is_symlink()
    status = _manager().status()
    assert status.installed and status.loaded and status.enabled and status.running
    assert status.pid == systemd_tools.main_pid("systemd", "mtplxd.service")
    assert status.up_to_date and status.serves_this_home


def test_reinstall_unchanged_does_not_restart(systemd_tools):
    _manager().install()
    pid = _manager().status().pid
    systemd_tools.calls()
    report = _manager().install()
    assert systemd_tools.calls() == [SHOW, RELOAD, ENABLE_NOW]
    assert not report.changed
    assert _manager().status().pid == pid


def test_reinstall_with_a_changed_unit_restarts_the_running_service(systemd_tools, isolated_home: Path):
    _manager().install()
    pid = _manager().status().pid
    systemd_tools.calls()
    (isolated_home / "config.toml").write_text("shutdown_grace_seconds = 5\n")
    report = _manager().install()
    assert systemd_tools.calls() == [SHOW, RELOAD, ENABLE_NOW,
                                     ["systemctl", "--user", "restart", "mtplxd.service"]]
    assert report.changed
    assert "TimeoutStopSec=25" in (_unit_dir() / "mtplxd.service").read_text()
    assert _manager().status().pid not in (None, pid)
    assert systemd_tools.exit_status("systemd", "mtplxd.service") == 0


def test_uninstall_disables_stops_removes_and_reloads(systemd_tools):
    _manager().install()
    pid = _manager().status().pid
    systemd_tools.calls()
    report = _manager().uninstall()
    assert systemd_tools.calls() == [["systemctl", "--user", "disable", "--now", "mtplxd.service"], RELOAD]
    assert report.changed
    # Only systemd's (now empty) .wants directory is left, as `systemctl disable` leaves it.
    left = sorted(str(p.relative_to(_unit_dir())) for p in _unit_dir().rglob("*"))
    assert left == ["default.target.wants"]
    assert systemd_tools.exit_status("systemd", "mtplxd.service") == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert _manager().status().loaded is False


def test_uninstall_when_not_installed_runs_nothing(systemd_tools):
    assert not _manager().uninstall().changed
    assert systemd_tools.calls() == []


def test_stop_and_start_use_systemctl_and_stop_is_a_clean_exit(systemd_tools):
    manager = _manager()
    manager.install()
    systemd_tools.calls()
    manager.stop()
    assert systemd_tools.calls() == [["systemctl", "--user", "stop", "mtplxd.service"]]
    status = manager.status()
    assert not status.running and status.state == "inactive (dead)" and status.last_exit_code == 0
    manager.start()
    assert systemd_tools.calls()[-1] == ["systemctl", "--user", "start", "mtplxd.service"]
    assert manager.status().running


def test_no_user_manager_fails_with_a_linger_hint_and_leaves_nothing(systemd_tools, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "systemctl daemon-reload=1:Failed to connect to bus: No medium found")
    with pytest.raises(ServiceError) as caught:
        _manager().install()
    assert "enable-linger" in caught.value.hint
    assert not (_unit_dir() / "mtplxd.service").exists()
