"""The launchd manager's exact launchctl sequences, against a recording fake that runs the job.

The fake runs a stand-in daemon (FAKE_STANDIN) so these stay fast; test_end_to_end.py runs
the real mtplxd through the same fake.
"""

from __future__ import annotations

import os
import plistlib
import subprocess
from pathlib import Path

import pytest

from mtplxctl.launchd import ServiceError, service_manager
from mtplxctl.launchd.launchctl import LaunchdManager

UID = os.getuid()
TARGET = f"gui/{UID}/com.mtplx.mtplxd"


def _plist_path() -> Path:
    return Path.home() / "Library" / "LaunchAgents" / "com.mtplx.mtplxd.plist"


def _manager() -> LaunchdManager:
    manager = service_manager(strict=True)
    assert isinstance(manager, LaunchdManager)
    return manager


def _fresh_install_calls() -> list[list[str]]:
    return [["launchctl", "print", TARGET],
            ["launchctl", "print-disabled", f"gui/{UID}"],
            ["launchctl", "bootstrap", f"gui/{UID}", str(_plist_path())]]


def test_fresh_install_writes_plist_then_bootstraps_into_the_gui_domain(launchd_tools):
    report = _manager().install()
    assert launchd_tools.calls() == _fresh_install_calls()
    assert report.changed
    assert report.actions == [f"wrote {_plist_path()}", f"launchctl bootstrap gui/{UID} {_plist_path()}"]
    assert plistlib.loads(_plist_path().read_bytes())["Label"] == "com.mtplx.mtplxd"
    assert oct(_plist_path().stat().st_mode & 0o777) == "0o644"
    status = _manager().status()
    assert status.installed and status.loaded and status.running and status.pid
    assert status.up_to_date and status.serves_this_home and status.enabled


def test_reinstall_unchanged_leaves_the_running_daemon_alone(launchd_tools):
    _manager().install()
    pid = _manager().status().pid
    launchd_tools.calls()
    report = _manager().install()
    assert launchd_tools.calls() == [["launchctl", "print", TARGET]]
    assert not report.changed and report.actions == []
    assert _manager().status().pid == pid


def test_reinstall_with_a_changed_plist_boots_out_then_bootstraps(launchd_tools, isolated_home: Path):
    _manager().install()
    launchd_tools.calls()
    (isolated_home / "config.toml").write_text("shutdown_grace_seconds = 3\n")
    report = _manager().install()
    assert launchd_tools.calls() == [
        ["launchctl", "print", TARGET],
        ["launchctl", "bootout", TARGET],
        ["launchctl", "print", TARGET],
        ["launchctl", "print-disabled", f"gui/{UID}"],
        ["launchctl", "bootstrap", f"gui/{UID}", str(_plist_path())],
    ]
    assert report.changed
    assert plistlib.loads(_plist_path().read_bytes())["ExitTimeOut"] == 23
    # The old process got SIGTERM and exited 0; a new one runs.
    assert launchd_tools.exit_status("launchd", "com.mtplx.mtplxd") == 0
    assert _manager().status().running


def test_a_disabled_label_is_enabled_before_bootstrap(launchd_tools):
    # As a user's `launchctl disable` (or an earlier uninstall by another tool) leaves it.
    subprocess.run(["launchctl", "disable", TARGET], check=True)
    launchd_tools.calls()
    _manager().install()
    calls = launchd_tools.calls()
    assert calls[2] == ["launchctl", "enable", TARGET]
    assert calls[3][:2] == ["launchctl", "bootstrap"]


def test_uninstall_boots_out_and_removes_exactly_the_plist(launchd_tools):
    agents = Path.home() / "Library" / "LaunchAgents"
    agents.mkdir(parents=True)
    (agents / "com.example.other.plist").write_bytes(b"keep me")
    _manager().install()
    launchd_tools.calls()
    report = _manager().uninstall()
    assert launchd_tools.calls() == [["launchctl", "print", TARGET],
                                     ["launchctl", "bootout", TARGET],
                                     ["launchctl", "print", TARGET]]
    assert report.changed and report.actions[-1] == f"removed {_plist_path()}"
    assert sorted(p.name for p in agents.iterdir()) == ["com.example.other.plist"]
    assert launchd_tools.exit_status("launchd", "com.mtplx.mtplxd") == 0


def test_uninstall_when_not_installed_is_a_no_op(launchd_tools):
    report = _manager().uninstall()
    assert launchd_tools.calls() == [["launchctl", "print", TARGET]]
    assert not report.changed


def test_stop_boots_out_and_start_bootstraps_again_never_kickstart_k(launchd_tools):
    manager = _manager()
    manager.install()
    launchd_tools.calls()
    manager.stop()
    assert launchd_tools.calls() == [["launchctl", "print", TARGET],
                                     ["launchctl", "bootout", TARGET],
                                     ["launchctl", "print", TARGET]]
    assert not manager.status().loaded and manager.is_installed()
    launchd_tools.calls()
    manager.start()
    assert launchd_tools.calls() == _fresh_install_calls()
    assert manager.status().running


def test_start_of_a_loaded_but_exited_job_kickstarts_without_k(launchd_tools):
    manager = _manager()
    manager.install()
    pid = manager.status().pid
    os.kill(pid, 15)  # a clean exit 0: KeepAlive {SuccessfulExit: false} leaves it down
    _wait(lambda: launchd_tools.exit_status("launchd", "com.mtplx.mtplxd") == 0)
    status = manager.status()
    assert status.loaded and not status.running and status.last_exit_code == 0
    launchd_tools.calls()
    manager.start()
    assert launchd_tools.calls() == [["launchctl", "print", TARGET],
                                     ["launchctl", "kickstart", TARGET]]
    assert manager.status().running


def test_failed_first_bootstrap_leaves_nothing_behind(launchd_tools, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_FAIL", "launchctl bootstrap=125:Bootstrap failed: 125: Domain does not support specified action")
    with pytest.raises(ServiceError) as caught:
        _manager().install()
    assert "125" in str(caught.value) and "logged in" in caught.value.hint
    assert not _plist_path().exists()


def test_is_installed_only_for_the_home_this_shell_uses(launchd_tools, monkeypatch, tmp_path: Path):
    _manager().install()
    assert _manager().is_installed()
    monkeypatch.setenv("MTPLX_HOME", str(tmp_path / "another-home"))
    other = _manager()
    assert not other.is_installed()
    assert other.status().serves_this_home is False


def _wait(predicate, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
