"""The Linux manager: a systemd user unit, driven by `systemctl --user`.

install   = show (was it active?) + write (when changed) + daemon-reload + enable --now
            + restart (only when it was active and the unit changed, to apply the new unit)
uninstall = disable --now + remove the unit + daemon-reload
start     = start; stop = stop (a stop is not a failure, so Restart=on-failure leaves it down)
status    = show --property=..., one `Key=value` per line (systemctl's stable format)

A user unit runs while the user has a session; `loginctl enable-linger $USER` starts the user
manager at boot and keeps it after logout (docs/service.md).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from .base import ChangeReport, ServiceManager, ServiceStatus
from .runner import NO_USER_MANAGER_HINT, ServiceError
from .spec import ServiceSpec
from .unit import parse_unit, render_unit, unit_environment, unit_words

SHOW_PROPERTIES = ("LoadState", "ActiveState", "SubState", "MainPID", "ExecMainCode",
                   "ExecMainStatus", "UnitFileState", "NRestarts")
_ACTIVE = {"active", "activating", "reloading"}
# ExecMainCode is a CLD_* code from waitid(2).
_CLD_EXITED = 1
# Seconds systemd may take to start the unit (Type=notify waits for READY=1).
START_TIMEOUT_SECONDS = 120


def user_unit_dir(environ: dict[str, str] | None = None) -> Path:
    """`$XDG_CONFIG_HOME/systemd/user` (default `~/.config/systemd/user`)."""
    env = os.environ if environ is None else environ
    config_home = env.get("XDG_CONFIG_HOME", "")
    # The XDG spec says a relative value is invalid and must be ignored.
    base = Path(config_home) if os.path.isabs(config_home) else Path.home() / ".config"
    return base / "systemd" / "user"


class SystemdManager(ServiceManager):
    """The mtplxd user unit of the current user."""

    name = "systemd"

    def __init__(self, spec: ServiceSpec, unit_dir: Path | None = None) -> None:
        super().__init__(spec)
        self.unit_dir = unit_dir or user_unit_dir()

    @property
    def service_file(self) -> Path:
        return self.unit_dir / self.spec.unit_name

    @property
    def target(self) -> str:
        return self.spec.unit_name

    def render(self) -> bytes:
        return render_unit(self.spec).encode()

    def _installed_unit(self) -> dict[str, list[str]] | None:
        content = self._read_installed()
        if content is None:
            return None
        return parse_unit(content.decode(errors="replace"))

    def installed_environment(self) -> dict[str, str] | None:
        unit = self._installed_unit()
        if unit is None:
            return None
        try:
            return unit_environment(unit)
        except ValueError:
            return None

    def installed_program(self) -> list[str]:
        unit = self._installed_unit() or {}
        try:
            return unit_words(unit["ExecStart"][-1], dollar=True) if unit.get("ExecStart") else []
        except ValueError:
            return []

    # ------------------------------------------------------------ lifecycle

    def preflight(self) -> None:
        """`systemctl --user` must reach this user's systemd (a container, or an SSH login
        without lingering, has none)."""
        try:
            self._show()
        except ServiceError as exc:
            if exc.hint != NO_USER_MANAGER_HINT:
                raise
            raise ServiceError("there is no systemd user session for you here, so the login "
                               "service cannot run", NO_USER_MANAGER_HINT) from None

    def install(self) -> ChangeReport:
        new = self.render()
        old = self._read_installed()
        changed = old != new
        was_active = self._show().get("ActiveState") in _ACTIVE
        if changed:
            self.spec.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._write(new)
        with self._removed_if_refused(first_install=old is None):
            self._systemctl("daemon-reload")
            self._systemctl("enable", "--now", self.target, timeout=START_TIMEOUT_SECONDS)
            if was_active and changed:
                self._systemctl("restart", self.target, timeout=self._stop_start_timeout())
        return self._take_actions(changed)

    def uninstall(self) -> ChangeReport:
        if not self.service_file.exists():
            return self._take_actions(False)
        self._systemctl("disable", "--now", self.target, timeout=self._stop_start_timeout())
        self._remove_file()
        self._systemctl("daemon-reload")
        return self._take_actions(True)

    def start(self) -> None:
        self.spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        self._systemctl("start", self.target, timeout=START_TIMEOUT_SECONDS)
        self.actions.clear()

    def stop(self) -> None:
        self._systemctl("stop", self.target, timeout=self._stop_start_timeout())
        self.actions.clear()

    def status(self) -> ServiceStatus:
        status = self._base_status()
        shown = self._show()
        load_state = shown.get("LoadState")
        status.loaded = load_state == "loaded"
        if not status.loaded:
            status.state = load_state or "unknown"
            return status
        active = shown.get("ActiveState")
        status.state = f"{active} ({shown.get('SubState')})" if shown.get("SubState") else active
        main_pid = _int(shown.get("MainPID"))
        status.running = active in _ACTIVE and bool(main_pid)
        status.pid = main_pid if status.running else None
        status.enabled = shown.get("UnitFileState") == "enabled"
        status.runs = _int(shown.get("NRestarts"))
        _fill_last_exit(status, _int(shown.get("ExecMainCode")), _int(shown.get("ExecMainStatus")))
        return status

    # ------------------------------------------------------------ systemctl

    def _systemctl(self, *args: str, timeout: float = 60.0) -> None:
        self._run("systemctl", "--user", *args, timeout=timeout)

    def _show(self) -> dict[str, str]:
        result = self._run("systemctl", "--user", "show", self.target,
                           "--property=" + ",".join(SHOW_PROPERTIES), check=False, record=False)
        if result.returncode != 0:
            raise ServiceError.from_result(result)
        shown: dict[str, str] = {}
        for line in result.stdout.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                shown[key.strip()] = value.strip()
        return shown

    def _stop_start_timeout(self) -> float:
        return self.spec.stop_timeout_seconds + START_TIMEOUT_SECONDS


def _fill_last_exit(status: ServiceStatus, code: int | None, value: int | None) -> None:
    """ExecMainCode/ExecMainStatus -> last exit code or last signal (nothing before a first exit)."""
    if not code or value is None:
        return
    if code == _CLD_EXITED:
        status.last_exit_code = value
        status.last_exit = str(value)
        return
    try:
        name = signal.Signals(value).name
    except ValueError:
        name = f"signal {value}"
    status.last_signal = f"{name}: {value}"
    status.last_exit = f"killed by {name}"


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None
