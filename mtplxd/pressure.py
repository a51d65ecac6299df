"""System memory pressure, and the loop that sheds the session bank before the OS has to.

On macOS the kernel's own verdict (kern.memorystatus_vm_pressure_level: 1 normal, 2 warn,
4 critical) is read when available; everywhere psutil's available memory decides.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from typing import Callable

import psutil
import trio

log = logging.getLogger(__name__)

GIB = 1024**3
CHECK_INTERVAL_SECONDS = 2.0


def _macos_pressure_level() -> int | None:
    if sys.platform != "darwin":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    value = ctypes.c_int(0)
    size = ctypes.c_size_t(ctypes.sizeof(value))
    if libc.sysctlbyname(b"kern.memorystatus_vm_pressure_level", ctypes.byref(value),
                         ctypes.byref(size), None, 0) != 0:
        return None
    return value.value


def pressure_from_available(available: int, total: int) -> str:
    """normal / warn / critical from free memory: warn under 10% (or 2 GiB), critical under 5% (or 1 GiB)."""
    if available < min(total * 0.05, 1 * GIB) or available < total * 0.03:
        return "critical"
    if available < min(total * 0.10, 2 * GIB) or available < total * 0.06:
        return "warn"
    return "normal"


def memory_pressure() -> str:
    """The system's memory pressure now: "normal", "warn" or "critical"."""
    level = _macos_pressure_level()
    if level is not None:
        return {1: "normal", 2: "warn", 4: "critical"}.get(level, "normal")
    vm = psutil.virtual_memory()
    return pressure_from_available(vm.available, vm.total)


async def watch_pressure(bank_bytes: Callable[[], int], release: Callable[[int], int],
                         read_pressure: Callable[[], str] = memory_pressure,
                         interval: float = CHECK_INTERVAL_SECONDS, what: str = "bytes of session bank") -> None:
    """Forever: under warn release half of what is held (`bank_bytes()`: the session bank's
    idle bytes, or another holder's count), under critical all of it. A reading the OS refuses
    (no descriptor left to open /proc/meminfo with, say) skips that round, said once a streak:
    the watcher must never take the daemon down."""
    failing = False
    while True:
        try:
            level = read_pressure()
            held = bank_bytes()
            if level != "normal" and held > 0:
                freed = release(held if level == "critical" else held // 2)
                log.warning("memory pressure %s: released %d %s", level, freed, what)
            failing = False
        except OSError as exc:
            if not failing:
                log.warning("memory pressure: cannot read it (%s); trying again every %.0f s", exc, interval)
            failing = True
        await trio.sleep(interval)
