"""The one interface every fan backend implements, and the readings it returns.

A backend does three things: read (fan speeds, temperatures), take manual control at full
speed, and restore automatic control. Taking control is split in two so the caller can write
the lease *before* touching hardware: `snapshot()` reads what must be restored (no writes),
`apply_max()` commands the fans. `restore(record)` writes the snapshot back; it must work from a
record alone (the watchdog restores in a fresh process, with no daemon and no config).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


class FanError(Exception):
    """Fans could not be read, commanded or restored; the message says what to do."""


@dataclass
class FanReading:
    """One fan as the backend sees it."""

    name: str
    rpm: float | None = None
    target_rpm: float | None = None
    max_rpm: float | None = None
    mode: str | None = None  # "auto" or "manual" (backend-specific detail in `detail`)
    detail: str | None = None


@dataclass
class TemperatureReading:
    """One temperature sensor, in degrees Celsius."""

    name: str
    celsius: float


@dataclass
class Readings:
    """Everything a backend can report at one moment."""

    fans: list[FanReading] = field(default_factory=list)
    temperatures: list[TemperatureReading] = field(default_factory=list)
    temperature_source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON for `fans.status` and `daemon.status`."""
        return {
            "fans": [asdict(fan) for fan in self.fans],
            "temperatures": [asdict(temp) for temp in self.temperatures],
            "temperature_source": self.temperature_source,
        }


class FanBackend(Protocol):
    """What the controller needs from a platform's fans."""

    name: str

    @property
    def available(self) -> bool:
        """True when this backend can command fans here."""

    @property
    def reason(self) -> str | None:
        """Why fans cannot be controlled (None when they can)."""

    def read(self) -> Readings:
        """Current fan speeds and temperatures; never writes. Raises FanError."""

    def snapshot(self) -> dict[str, Any]:
        """The JSON record `restore` needs to undo `apply_max`; never writes. Raises FanError."""

    def apply_max(self) -> None:
        """Take manual control at full speed. Raises FanError (partial writes stay possible:
        the caller restores from the snapshot)."""

    def restore(self, record: dict[str, Any]) -> None:
        """Return every fan in `record` to the mode it had. Raises FanError."""
