"""Linux fans through hwmon sysfs: `pwmN_enable` (the mode) and `pwmN` (the duty, 0-255).

`pwmN_enable` is 0 (no control, full speed), 1 (manual, `pwmN` applies) or 2+ (automatic, with
driver-specific meanings), so the original value is saved and written back, never assumed to be
2. The `hwmonN` index is not stable across boots, so the restore record names each device too
and a device whose `name` changed is left alone. The root is configurable (`hwmon_root`) so
tests point it at a fake tree; real writes need root or a udev rule (docs/fans.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtplxd.fans.base import FanError, FanReading, Readings, TemperatureReading

BACKEND = "hwmon"
MANUAL = "1"
FULL_DUTY = "255"
_PWM = re.compile(r"pwm(\d+)")
_FAN = re.compile(r"fan(\d+)_input")
_TEMP = re.compile(r"temp(\d+)_input")
# sysfs attributes are one short line; a bounded read never hangs on an odd file.
_MAX_ATTR = 4096


@dataclass(frozen=True)
class Channel:
    """One PWM output: `device/pwmN` and its `pwmN_enable`."""

    device: Path
    index: str

    @property
    def pwm(self) -> Path:
        return self.device / f"pwm{self.index}"

    @property
    def enable(self) -> Path:
        return self.device / f"pwm{self.index}_enable"


def read_attr(path: Path) -> str:
    """The stripped text of one sysfs attribute. Raises FanError."""
    try:
        with open(path, "r", encoding="ascii", errors="replace") as fh:
            return fh.read(_MAX_ATTR).strip()
    except OSError as exc:
        raise FanError(f"cannot read {path}: {exc.strerror or exc}") from None


def write_attr(path: Path, value: str) -> None:
    """Write `value` to one sysfs attribute. Raises FanError saying what access is needed."""
    try:
        with open(path, "w", encoding="ascii") as fh:
            fh.write(value)
    except OSError as exc:
        raise FanError(f"cannot write {path}: {exc.strerror or exc}; fan control on Linux needs "
                       "write access to the hwmon pwm files (root or a udev rule, see "
                       "docs/fans.md)") from None


def _devices(root: Path) -> list[Path]:
    try:
        return sorted(p for p in root.iterdir() if p.name.startswith("hwmon") and p.is_dir())
    except OSError:
        return []


def _device_name(device: Path) -> str | None:
    try:
        return read_attr(device / "name")
    except FanError:
        return None


def find_channels(root: Path) -> list[Channel]:
    """Every PWM output under `root` that has a `pwmN_enable` (so its mode can be restored)."""
    channels = []
    for device in _devices(root):
        for entry in sorted(device.iterdir()):
            match = _PWM.fullmatch(entry.name)
            if match and (device / f"pwm{match.group(1)}_enable").exists():
                channels.append(Channel(device, match.group(1)))
    return channels


def _label(device: Path, kind: str, index: str) -> str:
    prefix = _device_name(device) or device.name
    try:
        return f"{prefix} {read_attr(device / f'{kind}{index}_label')}"
    except FanError:
        return f"{prefix} {kind}{index}"


def _mode_text(enable: str) -> str:
    if enable == MANUAL:
        return "manual"
    if enable == "0":
        return "full (no control)"
    return "auto"


class HwmonBackend:
    """Fans under one hwmon root."""

    name = BACKEND

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def channels(self) -> list[Channel]:
        """The controllable PWM outputs, found afresh (the tree can change under us)."""
        return find_channels(self.root)

    @property
    def available(self) -> bool:
        return bool(self.channels())

    @property
    def reason(self) -> str | None:
        if not self.root.exists():
            return (f"{self.root} does not exist: no hwmon fans here (a VM, a container or a "
                    "passively cooled machine)")
        if not self.channels():
            return f"no fan with PWM control under {self.root} (no hwmonN/pwmN with pwmN_enable)"
        return None

    def read(self) -> Readings:
        """Speeds from `fanN_input`, modes from `pwmN_enable`, temperatures from `tempN_input`."""
        readings = Readings(temperature_source=BACKEND)
        for device in _devices(self.root):
            for entry in sorted(device.iterdir()):
                if match := _FAN.fullmatch(entry.name):
                    readings.fans.append(FanReading(
                        name=_label(device, "fan", match.group(1)), rpm=_number(entry)))
                elif match := _TEMP.fullmatch(entry.name):
                    millidegrees = _number(entry)
                    if millidegrees is not None:
                        readings.temperatures.append(TemperatureReading(
                            _label(device, "temp", match.group(1)), millidegrees / 1000.0))
        for channel in self.channels():
            try:
                enable, duty = read_attr(channel.enable), read_attr(channel.pwm)
            except FanError:
                continue
            readings.fans.append(FanReading(
                name=f"{_device_name(channel.device) or channel.device.name} pwm{channel.index}",
                mode=_mode_text(enable), detail=f"pwm{channel.index}_enable={enable}, duty {duty}/255"))
        return readings

    def snapshot(self) -> dict[str, Any]:
        """The original mode and duty of every channel."""
        channels = self.channels()
        if not channels:
            raise FanError(self.reason or "no controllable fans")
        saved = []
        for channel in channels:
            saved.append({
                "device": str(channel.device),
                "device_name": _device_name(channel.device),
                "index": channel.index,
                "enable": read_attr(channel.enable),
                "pwm": read_attr(channel.pwm),
            })
        return {"backend": BACKEND, "channels": saved}

    def apply_max(self) -> None:
        """Manual mode, full duty, on every channel."""
        for channel in self.channels():
            write_attr(channel.enable, MANUAL)
            write_attr(channel.pwm, FULL_DUTY)

    def restore(self, record: dict[str, Any]) -> None:
        restore(record)


def restore(record: dict[str, Any]) -> None:
    """Write back each channel's saved mode (and its duty when that mode was manual).

    Only values that differ are written, so restoring a channel that was never changed needs no
    write access. Every channel is attempted; a FanError lists the ones that failed.
    """
    errors = []
    for saved in record.get("channels", []):
        channel = Channel(Path(saved["device"]), str(saved["index"]))
        try:
            _restore_channel(channel, saved)
        except FanError as exc:
            errors.append(str(exc))
    if errors:
        raise FanError("; ".join(errors))


def _restore_channel(channel: Channel, saved: dict[str, Any]) -> None:
    expected_name = saved.get("device_name")
    if expected_name is not None and _device_name(channel.device) != expected_name:
        # hwmonN was renumbered (a reboot): the fans came back under automatic control anyway.
        return
    original_enable, original_duty = str(saved["enable"]), str(saved["pwm"])
    if original_enable == MANUAL and _current(channel.pwm) != original_duty:
        # Still in manual mode here, so the duty write takes effect before the mode is restored.
        write_attr(channel.pwm, original_duty)
    if _current(channel.enable) != original_enable:
        write_attr(channel.enable, original_enable)


def _current(path: Path) -> str | None:
    try:
        return read_attr(path)
    except FanError:
        return None


def _number(path: Path) -> float | None:
    try:
        return float(read_attr(path))
    except (FanError, ValueError):
        return None
