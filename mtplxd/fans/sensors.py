"""Temperatures and fan speeds from psutil, where the platform has them.

`psutil.sensors_temperatures()` exists on Linux and FreeBSD and `sensors_fans()` on Linux only;
elsewhere the attributes are missing, so both readers return nothing rather than fail.
"""

from __future__ import annotations

import psutil

from mtplxd.fans.base import FanReading, TemperatureReading


def _psutil_sensors(name: str) -> list[tuple[str, float]]:
    """(label, current) of every entry psutil's `sensors_<name>()` reports; empty when it has none."""
    reader = getattr(psutil, f"sensors_{name}", None)
    if reader is None:
        return []
    try:
        groups = reader()
    except (OSError, RuntimeError):
        return []
    return [(f"{chip} {entry.label or index}".strip(), float(entry.current))
            for chip, entries in groups.items() for index, entry in enumerate(entries)]


def psutil_temperatures() -> list[TemperatureReading]:
    """Every temperature psutil reports (empty where it reports none)."""
    return [TemperatureReading(label, value) for label, value in _psutil_sensors("temperatures")]


def psutil_fans() -> list[FanReading]:
    """Every fan speed psutil reports (Linux only; empty elsewhere)."""
    return [FanReading(label, rpm=value) for label, value in _psutil_sensors("fans")]
