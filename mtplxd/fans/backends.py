"""Choose the fan backend for this machine, and restore any backend from its record alone."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mtplxd.fans import hwmon, smc
from mtplxd.fans.base import FanBackend, FanError
from mtplxd.fans.hwmon import HwmonBackend
from mtplxd.fans.null import NullBackend
from mtplxd.fans.smc import SmcBackend

KINDS = ("auto", "hwmon", "smc", "none")


def make_backend(kind: str, hwmon_root: Path, smc_helper: Path,
                 platform: str = sys.platform) -> FanBackend:
    """The backend `kind` names; `auto` picks SMC on macOS and hwmon on Linux.

    A backend that cannot work here becomes a NullBackend carrying the reason, so status can
    always say why fans are not controlled.
    """
    if kind == "none":
        return NullBackend("fan control is off (config key fan_backend = none)")
    if kind == "hwmon" or (kind == "auto" and platform.startswith("linux")):
        backend: FanBackend = HwmonBackend(hwmon_root)
    elif kind == "smc" or (kind == "auto" and platform == "darwin"):
        backend = SmcBackend(smc_helper)
    else:
        return NullBackend(f"no fan backend for platform {platform}")
    if kind == "auto" and not backend.available:
        return NullBackend(backend.reason or "no controllable fans")
    return backend


def restore_record(record: dict[str, Any]) -> None:
    """Give back what `record` (a backend's snapshot) took. Raises FanError."""
    kind = record.get("backend")
    if kind == hwmon.BACKEND:
        hwmon.restore(record)
    elif kind == smc.BACKEND:
        smc.restore(record)
    else:
        raise FanError(f"unknown fan backend {kind!r} in the lease; nothing restored")
