"""Temperatures and fan speeds from psutil, where the platform has them.

`psutil.sensors_temperatures()` exists on Linux and FreeBSD and `sensors_fans()` on Linux only;
elsewhere the attributes are missing, so both readers return nothing rather than fail.
"""

from __future__ import annotations

import psutil

from mtplxd.fans.base import FanReading, TemperatureReading


def psutil_temperatures() -> list[TemperatureReading]:
    """Every temperature psutil reports (empty where it reports none)."""
    reader = getattr(psutil, "sensors_temperatures", None)
    if reader is None:
        return []
    try:
        groups = reader()
    except (OSError, RuntimeError):
        return []
    return [TemperatureReading(f"{chip} {entry.label or index}".strip(), float(entry.current))
            for chip, entries in groups.items() for index, entry in enumerate(entries)]


def psutil_fans() -> list[FanReading]:
    """Every fan speed psutil reports (Linux only; empty elsewhere)."""
    reader = getattr(psutil, "sensors_fans", None)
    if reader is None:
        return []
    try:
        groups = reader()
    except (OSError, RuntimeError):
        return []
    return [FanReading(f"{chip} {entry.label or index}".strip(), rpm=float(entry.current))
            for chip, entries in groups.items() for index, entry in enumerate(entries)]
