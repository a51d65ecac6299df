"""The fan watchdog: a detached process that gives the fans back when the daemon dies.

    python -m mtplxd.fans.watchdog --lease PATH --pid PID [--token T] [--log FILE]

The daemon starts one (in its own session) right after writing the lease, and commands the
fans only once the watchdog has said "ready" on its stdout, which it does once the daemon's exit
can no longer escape it; then its stdio is all /dev/null. It waits for the daemon's exit without polling where the kernel
can tell it (a pidfd on Linux, kqueue NOTE_EXIT on macOS), so `kill -9`, an OOM kill or a closed
terminal are all seen at once. Then it restores from the lease, removes it and exits. When the
daemon gives the fans back itself, it removes the lease (or replaces it with one whose token
differs) and the watchdog exits within POLL_SECONDS.

It ignores SIGHUP, SIGINT and SIGTERM: a terminal closing or a service manager signalling the
whole group must not stop it before its work is done; it always exits on its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from mtplxd.fans.base import FanError
from mtplxd.fans.backends import restore_record
from mtplxd.fans.lease import LeaseError, clear_lease, process_alive, read_lease

log = logging.getLogger("mtplxd.fans.watchdog")

POLL_SECONDS = 0.25
READY = b"ready\n"
READY_TIMEOUT = 15.0
# Retries for a restore that fails (a helper that is busy, sudo momentarily unhappy). After the
# last one the lease stays on disk and the next daemon start restores it.
RETRY_DELAYS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)


class ExitWatch:
    """Tells when process `pid` (started at `started`, if given) has exited."""

    def __init__(self, pid: int, started: float | None = None) -> None:
        self.pid = pid
        self.started = started
        self.gone = False
        self._poll: select.poll | None = None
        self._kqueue = None
        self._fd: int | None = None
        try:
            self._open()
        except ProcessLookupError:
            self.gone = True
        except OSError as exc:
            log.info("no kernel exit notification for pid %s (%s); polling", pid, exc)
        # Opened after a pid reuse, the handle would watch the wrong process. Our parent is the
        # daemon itself while it lives (it spawned us), which proves identity without comparing
        # start times that a wall-clock step could skew.
        if not self.gone and os.getppid() != pid and not process_alive(pid, started):
            self.gone = True

    def _open(self) -> None:
        if hasattr(os, "pidfd_open"):
            self._fd = os.pidfd_open(self.pid)
            self._poll = select.poll()
            self._poll.register(self._fd, select.POLLIN)
        elif hasattr(select, "kqueue"):
            self._kqueue = select.kqueue()
            event = select.kevent(self.pid, filter=select.KQ_FILTER_PROC,
                                  flags=select.KQ_EV_ADD | select.KQ_EV_ENABLE,
                                  fflags=select.KQ_NOTE_EXIT)
            self._kqueue.control([event], 0, 0)

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds; True once the process has exited."""
        if self.gone:
            return True
        if self._poll is not None:
            self.gone = bool(self._poll.poll(timeout * 1000))
        elif self._kqueue is not None:
            self.gone = bool(self._kqueue.control(None, 1, timeout))
        else:
            time.sleep(timeout)
            self.gone = not process_alive(self.pid, self.started)
        return self.gone

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        if self._kqueue is not None:
            self._kqueue.close()


def watch(lease_path: Path, pid: int, token: str | None = None,
          ready: Callable[[], None] = lambda: None) -> int:
    """Wait for daemon `pid` to exit, then restore its lease. Returns the exit code.

    `ready()` is called once the exit of `pid` cannot be missed any more.
    """
    try:
        lease = read_lease(lease_path)
    except LeaseError as exc:
        log.error("%s; nothing to watch", exc)
        return 1
    if lease is None or not _ours(lease, pid, token):
        log.info("no lease of pid %s at %s; nothing to watch", pid, lease_path)
        return 0
    watcher = ExitWatch(pid, lease.daemon_started or None)
    ready()
    try:
        while not watcher.wait(POLL_SECONDS):
            if not _still_held(lease_path, pid, token):
                log.info("pid %s gave the fans back itself; exiting", pid)
                return 0
    finally:
        watcher.close()
    log.warning("mtplxd pid %s is gone while holding the fans; restoring", pid)
    return restore_after_death(lease_path, pid, token)


def restore_after_death(lease_path: Path, pid: int, token: str | None = None) -> int:
    """Restore the dead daemon's lease, retrying; 0 once restored (or no longer owed)."""
    for delay in RETRY_DELAYS:
        time.sleep(delay)
        try:
            lease = read_lease(lease_path)
        except LeaseError as exc:
            log.error("%s; cannot restore", exc)
            return 1
        if lease is None or not _ours(lease, pid, token):
            log.info("the lease was handled by someone else")
            return 0
        try:
            restore_record(lease.record)
        except FanError as exc:
            log.error("restore failed: %s", exc)
            continue
        clear_lease(lease_path, lease.token)
        log.warning("fans restored to automatic control after pid %s died", pid)
        return 0
    log.error("giving up; the lease stays at %s and the next mtplxd start restores it", lease_path)
    return 1


def _ours(lease, pid: int, token: str | None) -> bool:
    return lease.daemon_pid == pid and (token is None or lease.token == token)


def _still_held(lease_path: Path, pid: int, token: str | None) -> bool:
    try:
        lease = read_lease(lease_path)
    except LeaseError:
        return True  # keep watching; a broken lease is reported when it matters
    return lease is not None and _ours(lease, pid, token)


def spawn(lease_path: Path, pid: int, token: str | None = None,
          log_file: Path | None = None) -> subprocess.Popen:
    """Start a detached watchdog for daemon `pid` (its own session, stdio on /dev/null)."""
    argv = [sys.executable, "-m", "mtplxd.fans.watchdog", "--lease", str(lease_path), "--pid", str(pid)]
    if token:
        argv += ["--token", token]
    if log_file is not None:
        argv += ["--log", str(log_file)]
    # The watchdog must import mtplxd even when the daemon runs from a source tree.
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                            env=env, cwd="/")


def wait_ready(process: subprocess.Popen, timeout: float = READY_TIMEOUT) -> str | None:
    """Wait for a spawned watchdog's "ready"; None once it is, else what went wrong."""
    assert process.stdout is not None
    try:
        readable, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if readable else b""
    finally:
        process.stdout.close()
    if line == READY:
        return None
    if not readable:
        return f"the fan watchdog did not report ready within {timeout:.0f}s"
    code = process.wait(5)
    return f"the fan watchdog exited at start (code {code}); see logs/fans-watchdog.log"


def _say_ready() -> None:
    """Tell the daemon we are watching, then let go of the pipe (the daemon may die any time)."""
    try:
        os.write(1, READY)
    except OSError:
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def _detach() -> None:
    for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    if os.getsid(0) != os.getpid():
        try:
            os.setsid()
        except OSError:
            pass  # already a process-group leader started by hand: keep going


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtplxd.fans.watchdog",
                                     description="Restore fans when the mtplx daemon dies.")
    parser.add_argument("--lease", required=True, type=Path, help="the fans.lease to restore from")
    parser.add_argument("--pid", required=True, type=int, help="the daemon pid to watch")
    parser.add_argument("--token", help="watch only the lease with this token")
    parser.add_argument("--log", type=Path, help="append log lines to this file")
    args = parser.parse_args(argv)
    _detach()
    handler: logging.Handler = (logging.FileHandler(args.log) if args.log
                                else logging.StreamHandler(sys.stderr))
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s fan-watchdog[{os.getpid()}]: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.info("watching mtplxd pid %s (lease %s)", args.pid, args.lease)
    return watch(args.lease, args.pid, args.token, ready=_say_ready)


if __name__ == "__main__":
    sys.exit(main())
