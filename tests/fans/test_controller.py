"""The fan controller's decisions, driven directly (trio.run) against a fake hwmon tree."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import trio

from mtplxd.fans.base import FanError
from mtplxd.fans.controller import FanController
from mtplxd.fans.hwmon import HwmonBackend
from mtplxd.fans.lease import Lease, read_lease, write_lease


def _controller(hwmon, tmp_path: Path, mode: str, idle: float = 300.0) -> FanController:
    return FanController(HwmonBackend(hwmon.root), tmp_path / "fans.lease", mode,
                         idle_seconds=idle, watchdog_log=tmp_path / "watchdog.log")


def _gone(process) -> bool:
    return process is None or process.poll() is not None


def test_max_mode_takes_manual_with_lease_and_watchdog_and_gives_back_when_cancelled(hwmon, tmp_path):
    controller = _controller(hwmon, tmp_path, "max")
    seen = {}

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            seen["enable"], seen["pwm"] = hwmon.attr("pwm1_enable"), hwmon.attr("pwm1")
            seen["lease"] = read_lease(controller.lease_path)
            seen["watchdog"] = controller.watchdog
            seen["watchdog_running"] = controller.watchdog.poll() is None
            seen["status"] = controller.snapshot()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert (seen["enable"], seen["pwm"]) == ("1", "255")
    lease = seen["lease"]
    assert lease.daemon_pid == os.getpid() and lease.record["channels"][0]["enable"] == "2"
    assert seen["watchdog_running"]
    status = seen["status"]
    assert status["manual"] and status["holder"]["watchdog_pid"] == seen["watchdog"].pid
    assert status["control"] == f"mtplxd (pid {os.getpid()})"
    # Cancelled = daemon shutdown: restored, lease gone, watchdog exited and reaped.
    assert hwmon.attr("pwm1_enable") == "2"
    assert not controller.lease_path.exists()
    assert seen["watchdog"].poll() is not None and controller.watchdog is None


def test_auto_mode_never_touches_the_fans(hwmon, tmp_path):
    controller = _controller(hwmon, tmp_path, "auto")

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            assert controller.snapshot()["control"] == "system (automatic)"
            nursery.cancel_scope.cancel()

    before = (hwmon.device / "pwm1_enable").stat().st_mtime_ns
    trio.run(main)
    assert (hwmon.device / "pwm1_enable").stat().st_mtime_ns == before
    assert not controller.lease_path.exists() and controller.watchdog is None


def test_smart_mode_holds_while_requests_run_and_restores_after_the_idle_period(hwmon, tmp_path):
    controller = _controller(hwmon, tmp_path, "smart", idle=0.4)
    timeline = {}

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            timeline["at_start"] = hwmon.attr("pwm1_enable")
            controller.on_activity(1)
            await _until(lambda: controller.manual)
            timeline["busy"] = hwmon.attr("pwm1_enable")
            await trio.sleep(0.6)  # longer than idle, but a request is still running
            timeline["still_busy"] = hwmon.attr("pwm1_enable")
            controller.on_activity(0)
            ended = time.monotonic()
            timeline["release_in"] = controller.snapshot()["release_in_seconds"]
            await _until(lambda: not controller.manual, timeout=3)
            timeline["idle_after"] = time.monotonic() - ended
            timeline["idle"] = hwmon.attr("pwm1_enable")
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert timeline["at_start"] == "2"
    assert timeline["busy"] == timeline["still_busy"] == "1"
    assert 0 < timeline["release_in"] <= 0.4
    assert timeline["idle"] == "2" and 0.35 <= timeline["idle_after"] < 2.0
    assert not controller.lease_path.exists()


def test_a_failing_write_is_reported_and_rolled_back_without_raising(hwmon, tmp_path, make_unwritable):
    make_unwritable(hwmon.device / "pwm1_enable")
    controller = _controller(hwmon, tmp_path, "max")
    seen = {}

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)  # starts despite the failure
            seen["status"] = controller.snapshot()
            with pytest.raises(FanError, match="pwm1_enable"):
                await controller.set_mode("max")
            nursery.cancel_scope.cancel()

    trio.run(main)
    status = seen["status"]
    assert not status["manual"] and status["control"] == "system (automatic)"
    assert "cannot write" in status["error"] and "pwm1_enable" in status["error"]
    assert status["holder"] is None and not controller.lease_path.exists()
    assert hwmon.attr("pwm1_enable") == "2"


def test_switching_modes_at_runtime(hwmon, tmp_path):
    controller = _controller(hwmon, tmp_path, "auto")
    seen = []

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            await controller.set_mode("max")
            seen.append(hwmon.attr("pwm1_enable"))
            await controller.set_mode("smart")  # no request running: give back at once
            seen.append(hwmon.attr("pwm1_enable"))
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert seen == ["1", "2"]


def test_a_stale_lease_is_restored_before_the_mode_applies(hwmon, tmp_path):
    hwmon.write("pwm1_enable", "1")
    hwmon.write("pwm1", "255")
    record = {"backend": "hwmon", "channels": [{"device": str(hwmon.device), "device_name": "nct6775",
                                                "index": "1", "enable": "2", "pwm": "128"}]}
    write_lease(tmp_path / "fans.lease", Lease(daemon_pid=999_999_999, daemon_started=1.0,
                                               mode="max", record=record))
    controller = _controller(hwmon, tmp_path, "auto")

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert hwmon.attr("pwm1_enable") == "2"
    assert not controller.lease_path.exists()
    assert "pid 999999999" in controller.stale_restored


def test_the_runtime_reports_request_start_and_end_to_its_activity_hooks(tmp_path):
    from mtplxd.runtime import Runtime

    runtime = Runtime(tmp_path, 3)
    counts: list[int] = []
    runtime.activity.append(counts.append)

    async def main():
        runtime._begin()
        runtime._begin()
        runtime._end()
        runtime._end()

    trio.run(main)
    assert counts == [1, 2, 1, 0]


async def _until(predicate, timeout: float = 3.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.02)


def test_an_unwritable_lease_means_the_fans_are_never_touched(hwmon, tmp_path, make_unwritable):
    lease_dir = tmp_path / "state"
    lease_dir.mkdir()
    make_unwritable(lease_dir)
    controller = FanController(HwmonBackend(hwmon.root), lease_dir / "fans.lease", "auto")

    async def main():
        with pytest.raises(FanError, match="cannot write the fan lease"):
            await controller.set_mode("max")

    trio.run(main)
    assert hwmon.attr("pwm1_enable") == "2" and controller.watchdog is None


def test_no_watchdog_means_no_manual_control(hwmon, tmp_path, monkeypatch):
    from mtplxd.fans import watchdog

    def cannot_spawn(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(watchdog, "spawn", cannot_spawn)
    controller = _controller(hwmon, tmp_path, "auto")

    async def main():
        with pytest.raises(FanError, match="cannot start the fan watchdog"):
            await controller.set_mode("max")

    trio.run(main)
    assert hwmon.attr("pwm1_enable") == "2" and not controller.lease_path.exists()


def test_a_failed_restore_keeps_lease_and_watchdog_and_is_retried(hwmon, tmp_path, make_unwritable,
                                                                  monkeypatch):
    from mtplxd.fans import controller as controller_module

    monkeypatch.setattr(controller_module, "RESTORE_RETRY_DELAYS", (0.2,))
    controller = _controller(hwmon, tmp_path, "max")
    seen = {}

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            make_unwritable(hwmon.device / "pwm1_enable")
            with pytest.raises(FanError, match="pwm1_enable"):
                await controller.set_mode("auto")
            seen["lease_kept"] = controller.lease_path.exists()
            seen["watchdog_alive"] = controller.watchdog.poll() is None
            make_unwritable.thaw(hwmon.device / "pwm1_enable")
            await _until(lambda: controller.lease is None and controller.last_error is None)
            seen["error_after"] = controller.last_error
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert seen["lease_kept"] and seen["watchdog_alive"]
    assert seen["error_after"] is None
    assert hwmon.attr("pwm1_enable") == "2" and not controller.lease_path.exists()
