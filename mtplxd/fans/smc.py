"""macOS fans through the SMC, by way of a small privileged helper run with `sudo -n`.

Writing SMC keys needs root, so the daemon never does it in-process. It runs one helper binary
(config key `smc_helper`) that a narrow sudoers rule lets the user run without a password, and
speaks this contract with it (ThermalForge's CLI implements it):

    HELPER status   JSON on stdout: {"fans": [{"actual_rpm", "target_rpm", "min_rpm",
                    "max_rpm", "mode"}, ...], "temperatures": {name: celsius} or [...]}
    HELPER max      every fan to manual at its maximum; exit 0 on success
    HELPER auto     every fan back to the system's automatic control; exit 0 on success

What the helper does in the SMC (docs/fans.md has the detail): Apple Silicon writes `Ftst=1`,
retries `F<n>Md=1` every 100 ms until thermalmonitord lets go (3-6 s), then writes `F<n>Tg` =
`F<n>Mx` (little-endian float); `auto` writes `F<n>Md=0` and `Ftst=0`. Intel Macs use `F<n>Md`
or the `FS! ` bitmask and raise `F<n>Mn`. Because a helper's "ok" has been seen while fans stayed
pinned (MTPLX issue #201), every command is verified by reading `status` until the fans'
modes agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from mtplxd.fans.base import FanError, FanReading, Readings, TemperatureReading

BACKEND = "smc"
STATUS_TIMEOUT = 10.0
COMMAND_TIMEOUT = 30.0
VERIFY_TIMEOUT = 12.0
_AUTO_MODES = {"auto", "automatic", "system", "0", "3"}
_MANUAL_MODES = {"manual", "forced", "max", "1"}


def normalize_mode(value: Any) -> str | None:
    """`auto` or `manual` for the helper's mode spellings (SMC F<n>Md: 0 auto, 1 manual, 3 system)."""
    text = str(value).strip().lower()
    if text in _AUTO_MODES:
        return "auto"
    if text in _MANUAL_MODES:
        return "manual"
    return None


def use_sudo() -> bool:
    """True when the helper must go through `sudo -n` (we are not root)."""
    return os.geteuid() != 0


class SmcBackend:
    """Fans commanded by the privileged SMC helper at `helper`."""

    name = BACKEND

    def __init__(self, helper: Path, sudo: bool | None = None,
                 verify_timeout: float = VERIFY_TIMEOUT) -> None:
        self.helper = Path(helper).expanduser()
        self.sudo = use_sudo() if sudo is None else sudo
        self.verify_timeout = verify_timeout

    @property
    def available(self) -> bool:
        return self.reason is None

    @property
    def reason(self) -> str | None:
        if not self.helper.is_file():
            return (f"the SMC fan helper {self.helper} is not installed (config key smc_helper; "
                    "see docs/fans.md)")
        if not os.access(self.helper, os.X_OK):
            return f"the SMC fan helper {self.helper} is not executable"
        return None

    def read(self) -> Readings:
        return parse_status(_status(self.helper, self.sudo))

    def snapshot(self) -> dict[str, Any]:
        """The helper's `auto` is the restore; the record names the helper so any process can."""
        if self.reason is not None:
            raise FanError(self.reason)
        return {"backend": BACKEND, "helper": str(self.helper), "sudo": self.sudo}

    def apply_max(self) -> None:
        _command(self.helper, self.sudo, "max")
        _verify(self.helper, self.sudo, "manual", self.verify_timeout)

    def restore(self, record: dict[str, Any]) -> None:
        restore(record, self.verify_timeout)


def restore(record: dict[str, Any], verify_timeout: float = VERIFY_TIMEOUT) -> None:
    """Run the recorded helper's `auto` and wait until every fan reads automatic."""
    helper, sudo = Path(record["helper"]), bool(record.get("sudo", use_sudo()))
    _command(helper, sudo, "auto")
    _verify(helper, sudo, "auto", verify_timeout)


def parse_status(status: dict[str, Any]) -> Readings:
    """Readings from the helper's `status` JSON."""
    readings = Readings()
    for index, fan in enumerate(status.get("fans") or []):
        readings.fans.append(FanReading(
            name=str(fan.get("name") or f"fan {index}"), rpm=_float(fan.get("actual_rpm")),
            target_rpm=_float(fan.get("target_rpm")), max_rpm=_float(fan.get("max_rpm")),
            mode=normalize_mode(fan.get("mode")), detail=f"SMC mode {fan.get('mode')}"))
    temperatures = status.get("temperatures") or {}
    if isinstance(temperatures, dict):
        pairs = list(temperatures.items())
    else:
        pairs = [(item.get("name") or item.get("key"), item.get("celsius", item.get("value")))
                 for item in temperatures if isinstance(item, dict)]
    for name, value in pairs:
        if _float(value) is not None:
            readings.temperatures.append(TemperatureReading(str(name), float(value)))
    readings.temperature_source = "smc" if readings.temperatures else None
    return readings


def _argv(helper: Path, sudo: bool, verb: str) -> list[str]:
    # -n: never prompt; a missing sudoers rule fails at once instead of hanging the daemon.
    return (["sudo", "-n"] if sudo else []) + [str(helper), verb]


def _run(helper: Path, sudo: bool, verb: str, timeout: float) -> str:
    argv = _argv(helper, sudo, verb)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FanError(f"`{' '.join(argv)}` failed: {exc}") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        hint = " (is the sudoers rule installed? see docs/fans.md)" if sudo else ""
        raise FanError(f"`{' '.join(argv)}` exited {done.returncode}: "
                       f"{said[-1] if said else 'no output'}{hint}")
    return done.stdout


def _status(helper: Path, sudo: bool) -> dict[str, Any]:
    text = _run(helper, sudo, "status", STATUS_TIMEOUT)
    try:
        status = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FanError(f"{helper} status did not print JSON: {exc}") from None
    if not isinstance(status, dict):
        raise FanError(f"{helper} status printed {type(status).__name__}, not an object")
    return status


def _command(helper: Path, sudo: bool, verb: str) -> None:
    _run(helper, sudo, verb, COMMAND_TIMEOUT)


def _verify(helper: Path, sudo: bool, mode: str, timeout: float) -> None:
    """Poll `status` until every fan reports `mode`; raise FanError when time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        fans = parse_status(_status(helper, sudo)).fans
        if fans and all(fan.mode == mode for fan in fans):
            return
        if time.monotonic() >= deadline:
            seen = ", ".join(f"{fan.name}: {fan.mode}" for fan in fans) or "no fans"
            raise FanError(f"{helper} {'max' if mode == 'manual' else 'auto'} reported success "
                           f"but the fans did not reach {mode} within {timeout:.0f}s ({seen})")
        time.sleep(0.25)


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
