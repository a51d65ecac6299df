"""Single-instance guard: an exclusive flock on run/mtplxd.lock, and the pid file.

The kernel drops a flock when its holder dies, `kill -9` included, so a dead daemon's lock never
blocks the next start; whatever socket file it left is removed only by the next lock holder.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from mtplxd.atomic import write_atomic


class AlreadyRunning(Exception):
    """Another live daemon holds the lock; `pid` is its pid when known."""

    def __init__(self, pid: int | None):
        super().__init__(f"mtplxd is already running (pid {pid if pid else 'unknown'})")
        self.pid = pid


class InstanceLock:
    """Holds the lock for the daemon's lifetime; release() also removes the pid file."""

    def __init__(self, lock_file: Path, pid_file: Path) -> None:
        self.lock_file = lock_file
        self.pid_file = pid_file
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and write our pid, or raise AlreadyRunning naming the holder's pid."""
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(read_pid(self.pid_file)) from None
        self._fd = fd
        # The lock file carries the pid too, so a reader never sees a pid file from a dead run.
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        write_atomic(self.pid_file, f"{os.getpid()}\n".encode(), mode=0o600)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if read_pid(self.pid_file) == os.getpid():
                self.pid_file.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)  # closing drops the flock
        self._fd = None


def read_pid(pid_file: Path) -> int | None:
    """The pid recorded in `pid_file`, or None."""
    try:
        return int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def lock_is_held(lock_file: Path) -> bool:
    """True when a live process holds the daemon lock (probe without keeping it)."""
    try:
        fd = os.open(lock_file, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
