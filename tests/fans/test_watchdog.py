"""The watchdog as a real detached process watching a real process that dies."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtplxd.fans import watchdog
from mtplxd.fans.hwmon import HwmonBackend
from mtplxd.fans.lease import Lease, clear_lease, process_start_time, write_lease
from support.waiting import wait_for


@pytest.fixture
def victim():
    """A process standing in for the daemon."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process
    if process.poll() is None:
        process.kill()
    process.wait(10)


def _take_fans(hwmon, lease_path: Path, pid: int) -> Lease:
    """What the daemon does before it spawns the watchdog: lease first, then the write."""
    backend = HwmonBackend(hwmon.root)
    lease = Lease(daemon_pid=pid, daemon_started=process_start_time(pid), mode="max",
                  record=backend.snapshot())
    write_lease(lease_path, lease)
    backend.apply_max()
    return lease


def test_kill_9_of_the_watched_process_restores_within_3_seconds(hwmon, tmp_path, victim):
    lease_path = tmp_path / "fans.lease"
    lease = _take_fans(hwmon, lease_path, victim.pid)
    guard = watchdog.spawn(lease_path, victim.pid, lease.token, tmp_path / "watchdog.log")
    assert watchdog.wait_ready(guard) is None  # from here on the kill must be seen, not polled
    assert guard.poll() is None and hwmon.attr("pwm1_enable") == "1"

    victim.send_signal(signal.SIGKILL)  # left unreaped: a zombie counts as dead
    took = wait_for(lambda: hwmon.attr("pwm1_enable") == "2", timeout=3.0)
    assert took is not None, (tmp_path / "watchdog.log").read_text()
    assert guard.wait(5) == 0
    assert not lease_path.exists()
    assert "restored" in (tmp_path / "watchdog.log").read_text()


def test_a_clean_release_makes_the_watchdog_exit_without_touching_fans(hwmon, tmp_path, victim):
    lease_path = tmp_path / "fans.lease"
    lease = _take_fans(hwmon, lease_path, victim.pid)
    guard = watchdog.spawn(lease_path, victim.pid, lease.token)
    assert watchdog.wait_ready(guard) is None
    hwmon.write("pwm1_enable", "4")  # whatever the owner restored, the watchdog leaves it be
    clear_lease(lease_path, lease.token)
    assert guard.wait(3) == 0
    assert hwmon.attr("pwm1_enable") == "4"
    assert victim.poll() is None


def test_a_replaced_lease_ends_the_old_watchdog(hwmon, tmp_path, victim):
    lease_path = tmp_path / "fans.lease"
    lease = _take_fans(hwmon, lease_path, victim.pid)
    guard = watchdog.spawn(lease_path, victim.pid, lease.token)
    assert watchdog.wait_ready(guard) is None
    write_lease(lease_path, Lease(daemon_pid=victim.pid, daemon_started=lease.daemon_started,
                                  mode="smart", record=lease.record))
    assert guard.wait(3) == 0
    assert lease_path.exists()


def test_a_daemon_already_dead_when_the_watchdog_starts_is_restored(hwmon, tmp_path, victim):
    lease_path = tmp_path / "fans.lease"
    lease = _take_fans(hwmon, lease_path, victim.pid)
    victim.kill()
    victim.wait(5)
    guard = watchdog.spawn(lease_path, victim.pid, lease.token)
    assert guard.wait(5) == 0
    assert hwmon.attr("pwm1_enable") == "2" and not lease_path.exists()


def test_hangup_and_terminate_do_not_stop_the_watchdog(hwmon, tmp_path, victim):
    lease_path = tmp_path / "fans.lease"
    lease = _take_fans(hwmon, lease_path, victim.pid)
    guard = watchdog.spawn(lease_path, victim.pid, lease.token)
    assert watchdog.wait_ready(guard) is None
    guard.send_signal(signal.SIGHUP)
    guard.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert guard.poll() is None
    victim.kill()
    assert guard.wait(5) == 0
    assert hwmon.attr("pwm1_enable") == "2"


def test_a_failed_restore_leaves_the_lease_for_the_next_start(hwmon, tmp_path, victim, make_unwritable,
                                                             monkeypatch):
    lease_path = tmp_path / "fans.lease"
    lease = _take_fans(hwmon, lease_path, victim.pid)
    make_unwritable(hwmon.device / "pwm1_enable")
    victim.kill()
    victim.wait(5)
    monkeypatch.setattr(watchdog, "RETRY_DELAYS", (0.0, 0.01))
    assert watchdog.restore_after_death(lease_path, victim.pid, lease.token) == 1
    assert lease_path.exists()


def test_a_watchdog_with_nothing_to_watch_exits_at_start_and_says_so(hwmon, tmp_path, victim):
    lease_path = tmp_path / "fans.lease"
    _take_fans(hwmon, lease_path, victim.pid)
    guard = watchdog.spawn(lease_path, victim.pid, token="not-this-lease")
    assert "exited at start (code 0)" in watchdog.wait_ready(guard)
