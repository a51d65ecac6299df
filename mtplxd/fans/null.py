"""The backend for machines whose fans cannot be controlled: it says why, and still reads."""

from __future__ import annotations

from typing import Any

from mtplxd.fans.base import FanError, Readings
from mtplxd.fans.sensors import psutil_fans, psutil_temperatures

BACKEND = "none"


class NullBackend:
    """No fan control; readings come from psutil where the platform offers them."""

    name = BACKEND

    def __init__(self, why: str) -> None:
        self._why = why

    @property
    def available(self) -> bool:
        return False

    @property
    def reason(self) -> str | None:
        return self._why

    def read(self) -> Readings:
        temperatures = psutil_temperatures()
        return Readings(fans=psutil_fans(), temperatures=temperatures,
                        temperature_source="psutil" if temperatures else None)

    def snapshot(self) -> dict[str, Any]:
        raise FanError(f"fans cannot be controlled here: {self._why}")

    def apply_max(self) -> None:
        raise FanError(f"fans cannot be controlled here: {self._why}")

    def restore(self, record: dict[str, Any]) -> None:
        # Nothing was ever taken, so there is nothing to give back.
        return None
