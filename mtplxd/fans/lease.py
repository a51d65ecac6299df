"""`fans.lease`: the record of manual fan control that someone still owes a restore for.

The daemon writes it (atomically) *before* it commands any fan and removes it only after a
successful restore. Whoever finds a lease whose daemon is gone, the watchdog or the next daemon
at startup, restores from it. The daemon is identified by pid and process start time, so a
reused pid never passes for the daemon that took the fans.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from mtplxd.atomic import write_atomic
from mtplxd.fans.backends import restore_record

log = logging.getLogger(__name__)

LEASE_VERSION = 1
# create_time is derived from boot time and clock ticks; allow for rounding between readers.
_START_TOLERANCE = 1.0


class LeaseError(Exception):
    """The lease file exists but cannot be understood."""


@dataclass
class Lease:
    """Who took the fans, when, and what restores them."""

    daemon_pid: int
    daemon_started: float
    mode: str
    record: dict[str, Any]
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    taken_at: float = field(default_factory=time.time)
    version: int = LEASE_VERSION

    @classmethod
    def for_this_process(cls, mode: str, record: dict[str, Any]) -> "Lease":
        """A lease held by the calling process."""
        return cls(daemon_pid=os.getpid(), daemon_started=process_start_time(os.getpid()) or 0.0,
                   mode=mode, record=record)


def process_start_time(pid: int) -> float | None:
    """When `pid` started (seconds since the epoch), or None when no such process runs."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return None


def process_alive(pid: int, started: float | None = None) -> bool:
    """True when `pid` runs, is not a zombie, and (given `started`) is the same process."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        if started:
            return abs(process.create_time() - started) < _START_TOLERANCE
        return True
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # someone else's live process


def write_lease(path: Path, lease: Lease) -> None:
    """Persist `lease` atomically (0600: it names a privileged helper)."""
    write_atomic(path, json.dumps(asdict(lease), indent=2).encode(), mode=0o600)


def read_lease(path: Path) -> Lease | None:
    """The lease at `path`, None when there is none. Raises LeaseError when it is unreadable."""
    try:
        data = json.loads(Path(path).read_text())
        return Lease(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise LeaseError(f"{path} is not a valid fan lease: {exc}") from None


def clear_lease(path: Path, token: str | None = None) -> bool:
    """Remove the lease (only when its token is `token`, if given); True when removed."""
    if token is not None:
        try:
            current = read_lease(path)
        except LeaseError:
            current = None
        if current is None or current.token != token:
            return False
    try:
        Path(path).unlink()
        return True
    except FileNotFoundError:
        return False


def restore_stale_lease(path: Path) -> str | None:
    """At startup: restore a lease whose daemon is gone. Returns what was done, None if nothing.

    Raises FanError when the restore fails (the lease stays, so the next start tries again).
    The caller holds the instance lock, so no live daemon of this home can own the lease.
    """
    try:
        lease = read_lease(path)
    except LeaseError as exc:
        log.error("%s; removing it (fans may need `mtplxctl fans auto` or a reboot)", exc)
        clear_lease(path)
        return f"removed an unreadable lease: {exc}"
    if lease is None:
        return None
    if lease.daemon_pid != os.getpid() and process_alive(lease.daemon_pid, lease.daemon_started):
        log.warning("fan lease of pid %s which still runs; restoring anyway (this daemon holds "
                    "the instance lock)", lease.daemon_pid)
    restore_record(lease.record)
    clear_lease(path, lease.token)
    done = (f"restored fans left in {lease.mode} mode by mtplxd pid {lease.daemon_pid} "
            f"(taken {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(lease.taken_at))})")
    log.warning("%s", done)
    return done
