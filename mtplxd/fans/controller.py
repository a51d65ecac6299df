"""The fan controller: one trio task that decides when the daemon holds the fans.

Modes: `auto` never touches fans; `max` holds them at full speed while the daemon serves;
`smart` holds them while requests run and for `idle_seconds` after the last one ends. Taking
control always goes: snapshot (what to restore) -> lease on disk -> watchdog started -> fans
commanded; giving back goes: restore -> lease removed -> watchdog exits. A failed take is rolled
back and reported, never raised into the daemon's nursery, so a bad backend cannot leave the
daemon half-started. When the task is cancelled (daemon shutdown) it restores before it ends.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import trio

from mtplxd.fans import watchdog
from mtplxd.fans.base import FanBackend, FanError, Readings
from mtplxd.fans.lease import Lease, clear_lease, restore_stale_lease, write_lease

log = logging.getLogger(__name__)

MODES = ("auto", "max", "smart")
REFRESH_SECONDS = 10.0
RESTORE_TIMEOUT = 30.0
# A failed restore is retried (fans must not stay pinned). A failed take is retried only when
# asked again (fans.set), or in smart mode by a request after TAKE_BACKOFF, so a backend without
# permissions does not spawn a watchdog per request.
RESTORE_RETRY_DELAYS = (5.0, 15.0, 30.0, 60.0)
TAKE_BACKOFF = 60.0
WATCHDOG_EXIT_WAIT = 3.0


class FanController:
    """Holds or releases the fans as the mode and request activity say."""

    def __init__(self, backend: FanBackend, lease_path: Path, mode: str = "auto",
                 idle_seconds: float = 300.0, watchdog_log: Path | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"fan mode must be one of {', '.join(MODES)}")
        self.backend = backend
        self.lease_path = Path(lease_path)
        self.mode = mode
        self.idle_seconds = idle_seconds
        self.watchdog_log = watchdog_log
        self.lease: Lease | None = None  # set while a restore is owed
        self.manual = False  # the fans are at full speed under our control
        self.active_requests = 0
        self.last_request_end: float | None = None
        self.last_error: str | None = None
        self.stale_restored: str | None = None
        self.readings: Readings | None = None
        self.readings_at: float | None = None
        self.watchdog: subprocess.Popen | None = None
        self._lock = trio.Lock()
        self._wake = trio.Event()
        self._restore_failures = 0
        self._retry_at: float | None = None
        self._take_blocked_until = -math.inf

    # ------------------------------------------------------------ signals from the daemon

    def on_activity(self, active_requests: int) -> None:
        """The runtime's hook: called with the in-flight count when a request starts or ends."""
        if active_requests == 0 and self.active_requests > 0:
            self.last_request_end = time.monotonic()
        self.active_requests = active_requests
        self._wake.set()

    def wants_manual(self, now: float | None = None) -> bool:
        """Whether the fans should be under our control at `now` (monotonic)."""
        now = time.monotonic() if now is None else now
        if self.mode == "max":
            return True
        if self.mode == "smart":
            return self.active_requests > 0 or (
                self.last_request_end is not None and now - self.last_request_end < self.idle_seconds)
        return False

    # ------------------------------------------------------------ the task

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Restore a stale lease, apply the mode, then follow activity until cancelled."""
        try:
            await self._restore_stale()
            await self.reconcile()
            await self.refresh()
            task_status.started()
            # On trio's clock, like _next_deadline(): move_on_at takes trio time, and trio's
            # clock is offset from time.monotonic(), so a monotonic deadline is always past
            # and the loop would spin a core.
            next_refresh = trio.current_time() + REFRESH_SECONDS
            while True:
                with trio.move_on_at(min(self._next_deadline(), next_refresh)):
                    await self._wake.wait()
                self._wake = trio.Event()
                await self.reconcile()
                if trio.current_time() >= next_refresh:
                    next_refresh = trio.current_time() + REFRESH_SECONDS
                    await self._check_watchdog()
                    if self.manual:
                        await self.refresh()
        finally:
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + RESTORE_TIMEOUT
                await self.give_back("daemon stopping")

    def _next_deadline(self) -> float:
        """The trio clock time when the decision may change without a wake-up."""
        deadlines = [math.inf]
        if self.mode == "smart" and self.active_requests == 0 and self.last_request_end is not None:
            deadlines.append(self.last_request_end + self.idle_seconds)
        if self._retry_at is not None:
            deadlines.append(self._retry_at)
        # Both clocks are monotonic; convert from time.monotonic() to trio's clock.
        return min(deadlines) - time.monotonic() + trio.current_time()

    async def _restore_stale(self) -> None:
        try:
            self.stale_restored = await trio.to_thread.run_sync(restore_stale_lease, self.lease_path)
        except FanError as exc:
            self.last_error = f"could not restore the fans a previous mtplxd left: {exc}"
            log.error("%s", self.last_error)

    # ------------------------------------------------------------ decisions

    async def set_mode(self, mode: str) -> None:
        """Switch mode now. Raises FanError when the fans could not follow (state stays safe)."""
        if mode not in MODES:
            raise ValueError(f"fan mode must be one of {', '.join(MODES)}")
        self.mode = mode
        self._take_blocked_until = -math.inf
        error = await self.reconcile()
        self._wake.set()
        if error is not None:
            raise FanError(error)

    async def reconcile(self) -> str | None:
        """Take or give back the fans to match the mode; returns the error, None on success."""
        async with self._lock:
            self._retry_at = None  # set again by _failed when a restore is still owed
            want = self.wants_manual()
            try:
                if want and not self.manual:
                    if time.monotonic() < self._take_blocked_until:
                        return self.last_error
                    await self._take()
                elif not want and self.lease is not None:
                    await self._give_back()
                else:
                    return None
            except FanError as exc:
                return self._failed(want, str(exc))
            self.last_error, self._retry_at, self._restore_failures = None, None, 0
            return None

    def _failed(self, taking: bool, message: str) -> str:
        self.last_error = message
        log.error("fan %s failed: %s", "take" if taking else "restore", message)
        if taking:
            # max: wait for the user (`mtplxctl fans max` after fixing the cause); smart: a later
            # request may try again, but not before TAKE_BACKOFF.
            self._take_blocked_until = (time.monotonic() + TAKE_BACKOFF if self.mode == "smart"
                                        else math.inf)
        if self.lease is not None:
            delay = RESTORE_RETRY_DELAYS[min(self._restore_failures, len(RESTORE_RETRY_DELAYS) - 1)]
            self._restore_failures += 1
            self._retry_at = time.monotonic() + delay
        return message

    async def give_back(self, why: str) -> None:
        """Restore automatic control if we hold it (shutdown path); errors are logged."""
        async with self._lock:
            if self.lease is None:
                return
            try:
                await self._give_back()
                log.info("fans returned to automatic control (%s)", why)
            except FanError as exc:
                self.last_error = str(exc)
                log.error("could not restore fans (%s): %s; the watchdog restores them when "
                          "mtplxd exits", why, exc)

    async def _take(self) -> None:
        if not self.backend.available:
            raise FanError(f"fans cannot be controlled here: {self.backend.reason}")
        if self.lease is None:
            record = await trio.to_thread.run_sync(self.backend.snapshot)
            lease = Lease.for_this_process(self.mode, record)
            try:
                write_lease(self.lease_path, lease)
            except OSError as exc:
                raise FanError(f"cannot write the fan lease {self.lease_path}: {exc}") from None
            self.lease = lease
            try:
                await self._start_watchdog()
            except FanError:
                # Never command fans that nothing would give back if we died.
                clear_lease(self.lease_path, lease.token)
                self.lease = None
                raise
        try:
            await trio.to_thread.run_sync(self.backend.apply_max)
        except FanError as exc:
            try:
                await self._give_back()
            except FanError as undo:
                raise FanError(f"{exc}; undoing it failed too: {undo}") from None
            raise
        self.manual = True
        log.info("fans at full speed (%s mode, lease %s)", self.mode, self.lease_path)
        await self.refresh()

    async def _give_back(self) -> None:
        assert self.lease is not None
        await trio.to_thread.run_sync(self.backend.restore, self.lease.record)
        clear_lease(self.lease_path, self.lease.token)
        self.lease, self.manual = None, False
        await self._stop_watchdog()
        await self.refresh()

    # ------------------------------------------------------------ the watchdog process

    async def _start_watchdog(self) -> None:
        """Spawn the watchdog and wait until it watches us. Raises FanError."""
        assert self.lease is not None
        try:
            process = watchdog.spawn(self.lease_path, os.getpid(), self.lease.token,
                                     self.watchdog_log)
        except OSError as exc:
            raise FanError(f"cannot start the fan watchdog: {exc}") from None
        problem = await trio.to_thread.run_sync(watchdog.wait_ready, process)
        if problem is not None:
            if process.poll() is None:
                process.kill()
            await trio.to_thread.run_sync(process.wait)
            raise FanError(problem)
        self.watchdog = process
        log.info("fan watchdog started (pid %s)", process.pid)

    async def _stop_watchdog(self) -> None:
        """The lease is gone, so the watchdog exits by itself; wait for it (and reap it)."""
        process, self.watchdog = self.watchdog, None
        if process is None:
            return
        try:
            await trio.to_thread.run_sync(process.wait, WATCHDOG_EXIT_WAIT)
        except subprocess.TimeoutExpired:
            log.warning("fan watchdog %s did not exit; killing it", process.pid)
            process.kill()
            await trio.to_thread.run_sync(process.wait)

    async def _check_watchdog(self) -> None:
        """Start a new watchdog if ours died while a restore is still owed."""
        async with self._lock:
            if self.lease is None or self.watchdog is None or self.watchdog.poll() is None:
                return
            log.warning("fan watchdog %s exited early (code %s); starting another",
                        self.watchdog.pid, self.watchdog.returncode)
            self.watchdog = None
            try:
                await self._start_watchdog()
            except FanError as exc:
                self.last_error = str(exc)
                log.error("%s", exc)

    # ------------------------------------------------------------ reporting

    async def refresh(self) -> None:
        """Read speeds and temperatures again (a failed read is reported, not raised)."""
        try:
            self.readings = await trio.to_thread.run_sync(self.backend.read)
            self.readings_at = time.time()
        except (FanError, OSError) as exc:
            log.warning("cannot read fans: %s", exc)
            self.readings, self.readings_at = None, time.time()

    def snapshot(self) -> dict[str, Any]:
        """The `fans` section of status: mode, backend, who holds control, last readings."""
        holder: dict[str, Any] | None = None
        if self.lease is not None:
            holder = {"pid": self.lease.daemon_pid, "mode": self.lease.mode,
                      "since": self.lease.taken_at, "lease": str(self.lease_path),
                      "watchdog_pid": self.watchdog.pid if self.watchdog else None}
        snapshot: dict[str, Any] = {
            "mode": self.mode,
            "backend": self.backend.name,
            "controllable": self.backend.available,
            "manual": self.manual,
            "control": f"mtplxd (pid {os.getpid()})" if self.manual else "system (automatic)",
            "holder": holder,
            "reason": self.backend.reason,
            "error": self.last_error,
            "active_requests": self.active_requests,
            "idle_seconds": self.idle_seconds,
            "release_in_seconds": self._release_in(),
            "stale_lease_restored": self.stale_restored,
            "readings_at": self.readings_at,
        }
        snapshot.update(self.readings.to_dict() if self.readings else
                        {"fans": [], "temperatures": [], "temperature_source": None})
        return snapshot

    def _release_in(self) -> float | None:
        if (self.mode != "smart" or not self.manual or self.active_requests
                or self.last_request_end is None):
            return None
        return round(max(0.0, self.last_request_end + self.idle_seconds - time.monotonic()), 1)


def build_controller(config: Any, paths: Any) -> FanController:
    """The controller the daemon runs, from its config and paths."""
    from mtplxd.fans.backends import make_backend

    backend = make_backend(config.fan_backend, Path(config.hwmon_root).expanduser(),
                           Path(config.smc_helper).expanduser())
    return FanController(backend, paths.fans_lease, config.fan_mode,
                         idle_seconds=config.fan_idle_minutes * 60.0,
                         watchdog_log=paths.logs_dir / "fans-watchdog.log")
