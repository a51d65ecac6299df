"""Polling helpers for tests that wait on another process."""

from __future__ import annotations

import os
import time
from typing import Callable


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.02) -> float | None:
    """Seconds until `predicate()` held, or None when `timeout` passed first."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    return None


def pid_gone(pid: int) -> bool:
    """True once no process has `pid` (a zombie still counts as present)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_gone(pid: int, timeout: float = 20) -> bool:
    """Wait until process `pid` no longer exists; False when it outlived `timeout`."""
    return wait_for(lambda: pid_gone(pid), timeout, interval=0.05) is not None
