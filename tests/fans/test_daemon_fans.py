"""Fans with a real daemon process: kill -9, clean stops, stale leases, failing writes, the CLI."""

from __future__ import annotations

import json
import signal
import tomllib

import httpx
import psutil
import pytest

from mtplxd.fans.lease import Lease, write_lease
from mtplxd.paths import Paths

from support.daemon import RunningDaemon, run_ctl, start_daemon
from support.waiting import wait_for


@pytest.fixture
def start(hwmon):
    """Start `python -m mtplxd --no-model` on the fake hwmon tree; kill it after the test."""
    running: list[RunningDaemon] = []

    def starter(mode: str = "max") -> RunningDaemon:
        daemon = start_daemon("--no-model", env={"MTPLX_HWMON_ROOT": str(hwmon.root),
                                                 "MTPLX_FAN_MODE": mode, "MTPLX_PORT": "0"})
        running.append(daemon)
        return daemon

    yield starter
    for daemon in running:
        if daemon.process.poll() is None:
            daemon.process.kill()
        daemon.process.wait(10)


def _fans(daemon: RunningDaemon) -> dict:
    return daemon.client.call("daemon.status")["fans"]


def _exited(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_max_mode_daemon_sets_manual_and_kill_9_restores_within_3_seconds(start, hwmon):
    daemon = start("max")
    fans = _fans(daemon)
    assert fans["manual"] and fans["mode"] == "max" and fans["backend"] == "hwmon"
    assert (hwmon.attr("pwm1_enable"), hwmon.attr("pwm1")) == ("1", "255")
    watchdog_pid = fans["holder"]["watchdog_pid"]
    assert not _exited(watchdog_pid)

    daemon.process.send_signal(signal.SIGKILL)
    took = wait_for(lambda: hwmon.attr("pwm1_enable") == "2", timeout=3.0)
    assert took is not None, "pwm1_enable not restored within 3 s of kill -9"
    assert wait_for(lambda: _exited(watchdog_pid), timeout=3.0) is not None
    assert not daemon.paths.fans_lease.exists()


def test_sigterm_restores_the_fans_and_the_watchdog_exits(start, hwmon):
    daemon = start("max")
    watchdog_pid = _fans(daemon)["holder"]["watchdog_pid"]
    assert daemon.stop(signal.SIGTERM) == 0
    assert hwmon.attr("pwm1_enable") == "2"  # restored before the daemon exited
    assert not daemon.paths.fans_lease.exists()
    assert wait_for(lambda: _exited(watchdog_pid), timeout=3.0) is not None
    log = daemon.paths.log_file.read_text()
    assert "fans returned to automatic control (daemon stopping)" in log


def test_mtplxctl_stop_restores_the_fans(start, hwmon):
    daemon = start("max")
    watchdog_pid = _fans(daemon)["holder"]["watchdog_pid"]
    assert run_ctl("stop").returncode == 0
    daemon.process.wait(10)
    assert hwmon.attr("pwm1_enable") == "2"
    assert wait_for(lambda: _exited(watchdog_pid), timeout=3.0) is not None


def test_a_stale_lease_from_a_dead_daemon_is_restored_at_startup(start, hwmon):
    hwmon.write("pwm1_enable", "1")
    hwmon.write("pwm1", "255")
    record = {"backend": "hwmon", "channels": [{"device": str(hwmon.device), "device_name": "nct6775",
                                                "index": "1", "enable": "2", "pwm": "128"}]}
    lease_path = Paths.from_env().fans_lease
    write_lease(lease_path, Lease(daemon_pid=999_999_999, daemon_started=1.0, mode="max",
                                  record=record))
    daemon = start("auto")
    # The control socket answers only after the restore: it happens before anything binds.
    assert hwmon.attr("pwm1_enable") == "2"
    assert not lease_path.exists()
    fans = _fans(daemon)
    assert "pid 999999999" in fans["stale_lease_restored"] and not fans["manual"]


def test_a_failing_write_at_start_is_reported_and_the_daemon_is_fully_up(start, hwmon, make_unwritable):
    make_unwritable(hwmon.device / "pwm1_enable")
    daemon = start("max")
    status = daemon.client.call("daemon.status")
    fans = status["fans"]
    assert fans["mode"] == "max" and not fans["manual"]
    assert "cannot write" in fans["error"] and "pwm1_enable" in fans["error"]
    assert fans["holder"] is None and not daemon.paths.fans_lease.exists()
    assert hwmon.attr("pwm1_enable") == "2"
    # Fully started: the HTTP API answers too (it binds just after the control socket).
    assert wait_for(lambda: daemon.client.call("daemon.status")["http"]["binds"], 10) is not None
    port = daemon.client.call("daemon.status")["http"]["port"]
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    assert "fan take failed" in daemon.paths.log_file.read_text()
    failed = run_ctl("fans", "max")
    assert failed.returncode == 1 and "pwm1_enable" in failed.stderr


def test_mtplxctl_fans_switches_modes_and_shows_status(start, hwmon):
    start("auto")
    shown = json.loads(run_ctl("fans", "status", "--json").stdout)
    assert shown["mode"] == "auto" and shown["control"] == "system (automatic)"
    assert shown["temperatures"] == [{"name": "nct6775 CPUTIN", "celsius": 45.0}]

    taken = run_ctl("fans", "max", "--json")
    assert taken.returncode == 0, taken.stderr
    answer = json.loads(taken.stdout)
    assert answer["fans"]["manual"] and hwmon.attr("pwm1_enable") == "1"
    # max, smart, auto and restore answer in one shape
    shape = {"action", "ok", "error", "message", "mode", "control", "saved", "running", "fans"}
    assert set(answer) == shape and (answer["action"], answer["mode"], answer["ok"]) == ("max", "max", True)
    human = run_ctl("fans", "status")
    assert "mtplxd (pid" in human.stdout and "1200 rpm" in human.stdout

    smart = run_ctl("fans", "smart", "--save", "--json")
    assert smart.returncode == 0 and set(json.loads(smart.stdout)) == shape
    assert json.loads(smart.stdout)["saved"] is True
    assert hwmon.attr("pwm1_enable") == "2"  # smart with no request running: automatic
    config = tomllib.loads(Paths.from_env().config_file.read_text())
    assert config["fan_mode"] == "smart"
    assert run_ctl("fans", "auto").returncode == 0


def test_mtplxctl_fans_restore_gives_back_a_stale_lease_while_no_daemon_runs(hwmon):
    hwmon.write("pwm1_enable", "1")
    record = {"backend": "hwmon", "channels": [{"device": str(hwmon.device), "device_name": "nct6775",
                                                "index": "1", "enable": "2", "pwm": "128"}]}
    write_lease(Paths.from_env().fans_lease, Lease(daemon_pid=999_999_999, daemon_started=1.0,
                                                   mode="max", record=record))
    done = run_ctl("fans", "restore")
    assert done.returncode == 0 and done.stdout.startswith("fans restore: restored fans")
    assert hwmon.attr("pwm1_enable") == "2"
    again = json.loads(run_ctl("fans", "restore", "--json").stdout)
    assert set(again) == {"action", "ok", "error", "message", "mode", "control", "saved", "running", "fans"}
    assert (again["action"], again["ok"], again["running"]) == ("restore", True, False)
    saved = json.loads(run_ctl("fans", "max", "--save", "--json").stdout)  # no daemon: saved only
    assert set(saved) == set(again) and (saved["mode"], saved["saved"], saved["running"]) == ("max", True, False)


def test_the_status_summary_line_names_mode_holder_and_readings():
    from mtplxctl.commands.fans import summary_line

    line = summary_line({"mode": "max", "control": "mtplxd (pid 7)", "controllable": True,
                         "fans": [{"rpm": 1200.0}, {"rpm": None}],
                         "temperatures": [{"celsius": 45.0}, {"celsius": 61.5}], "error": None})
    assert line == "max, mtplxd (pid 7), 1200 rpm, 61.5 °C"


def test_smart_mode_takes_the_fans_for_a_real_request_and_arms_the_idle_timer(hwmon):
    daemon = start_daemon(env={"MTPLX_HWMON_ROOT": str(hwmon.root), "MTPLX_FAN_MODE": "smart",
                               "MTPLX_FAN_IDLE_MINUTES": "1", "MTPLX_PORT": "0"}, timeout=60)
    try:
        assert wait_for(lambda: (daemon.client.call("daemon.status")["model"] or {}).get("state")
                         in ("loaded", "failed"), timeout=120) is not None
        status = daemon.client.call("daemon.status")
        assert status["model"]["state"] == "loaded", status["model"]
        assert not status["fans"]["manual"] and hwmon.attr("pwm1_enable") == "2"

        answer = httpx.post(status["http"]["base_url"] + "/chat/completions", timeout=120, json={
            "model": status["model"]["id"], "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200, answer.text

        # The take runs in the controller task (watchdog first), alongside the request.
        assert wait_for(lambda: _fans(daemon)["manual"], timeout=10) is not None
        fans = _fans(daemon)
        assert hwmon.attr("pwm1_enable") == "1" and fans["active_requests"] == 0
        assert 0 < fans["release_in_seconds"] <= 60  # back to automatic after fan_idle_minutes
        # The exit code is not this test's subject: with a model loaded the process has been
        # seen to abort at interpreter exit ("terminate called without an active exception")
        # after "mtplxd stopped"; the fans were already back by then, which is what we check.
        daemon.stop(signal.SIGTERM)
        assert hwmon.attr("pwm1_enable") == "2"
        assert "fans returned to automatic control (daemon stopping)" in daemon.paths.log_file.read_text()
    finally:
        if daemon.process.poll() is None:
            daemon.process.kill()
        daemon.process.wait(10)
