"""What every service manager offers `mtplxctl`, and the file handling launchd and systemd share.

A manager owns exactly one file (the LaunchAgent plist or the systemd user unit) plus the state
the service manager itself keeps about it. `install` writes the file only when its content
changes, so a repeated install leaves a running daemon alone; `uninstall` stops the service and
removes that one file.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from mtplxd.atomic import write_atomic

from .runner import ServiceError, run_tool
from .spec import ServiceSpec

# The environment keys that say which daemon a service runs; two services (or a service and this
# shell) with the same values talk to the same control socket.
TARGET_KEYS = ("MTPLX_HOME", "MTPLX_SOCKET")


@dataclass
class ServiceStatus:
    """What the service manager knows about the mtplxd service, for `service status`."""

    manager: str
    target: str
    file: str
    installed: bool
    up_to_date: bool | None = None
    loaded: bool = False
    enabled: bool | None = None
    running: bool = False
    pid: int | None = None
    state: str | None = None
    last_exit: str | None = None
    last_exit_code: int | None = None
    last_signal: str | None = None
    runs: int | None = None
    program: list[str] = field(default_factory=list)
    program_exists: bool | None = None
    home: str | None = None
    serves_this_home: bool | None = None
    log_file: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A plain dict for `--json`."""
        return asdict(self)


@dataclass
class ChangeReport:
    """What install or uninstall did: whether the file changed and each command it ran."""

    changed: bool
    actions: list[str] = field(default_factory=list)


class ServiceManager(ABC):
    """One platform's service manager, bound to the service definition of this MTPLX_HOME."""

    name: str = ""

    def __init__(self, spec: ServiceSpec) -> None:
        self.spec = spec
        self.actions: list[str] = []

    # ------------------------------------------------------------ the interface mtplxctl uses

    @property
    @abstractmethod
    def service_file(self) -> Path:
        """The one file install writes."""

    @property
    @abstractmethod
    def target(self) -> str:
        """How the service manager names the service (`gui/501/com.mtplx.mtplxd`, `mtplxd.service`)."""

    @abstractmethod
    def render(self) -> bytes:
        """The service file's content for the current spec."""

    @abstractmethod
    def installed_environment(self) -> dict[str, str] | None:
        """The environment the installed file gives the daemon; None when it cannot be read."""

    @abstractmethod
    def installed_program(self) -> list[str]:
        """The daemon command line in the installed file (empty when there is none)."""

    def preflight(self) -> None:
        """Raise ServiceError, saying what is missing and how to fix it, when this manager
        cannot run a service for this user here; nothing is changed either way."""

    @abstractmethod
    def install(self) -> ChangeReport:
        """Write the service file if it changed and make the service run now and at login."""

    @abstractmethod
    def uninstall(self) -> ChangeReport:
        """Stop the service and remove exactly what install added; a no-op when not installed."""

    @abstractmethod
    def start(self) -> None:
        """Start the installed service now (it must already be installed)."""

    @abstractmethod
    def stop(self) -> None:
        """Stop the service without it counting as a crash, so it is not restarted."""

    @abstractmethod
    def status(self) -> ServiceStatus:
        """Installed? loaded? running, pid, last exit, and whether the file is current."""

    def is_installed(self) -> bool:
        """True when the service file exists and runs the daemon this MTPLX_HOME talks to.

        `mtplxctl start`/`stop` rely on this: a service installed for another MTPLX_HOME would
        start a daemon that this shell's control socket never sees.
        """
        return self.service_file.exists() and self.serves_this_home()

    def serves_this_home(self) -> bool:
        """True when the installed file points the daemon at the same home and socket as `spec`."""
        installed = self.installed_environment()
        if installed is None:
            return False
        return all(installed.get(key) == self.spec.environment.get(key) for key in TARGET_KEYS)

    # ------------------------------------------------------------ shared helpers

    def _read_installed(self) -> bytes | None:
        try:
            return self.service_file.read_bytes()
        except FileNotFoundError:
            return None

    def _write(self, content: bytes) -> None:
        # launchd and systemd read these as the user; 0644 as Homebrew writes them (no secrets).
        write_atomic(self.service_file, content, mode=0o644)
        self.actions.append(f"wrote {self.service_file}")

    @contextmanager
    def _removed_if_refused(self, first_install: bool) -> Iterator[None]:
        """Run the activation steps of install; when the manager refuses a first install,
        remove the file it just wrote (a failed first install leaves nothing behind)."""
        try:
            yield
        except ServiceError:
            if first_install:
                self._remove_file()
            raise

    def _remove_file(self) -> bool:
        try:
            self.service_file.unlink()
        except FileNotFoundError:
            return False
        self.actions.append(f"removed {self.service_file}")
        return True

    def _run(self, tool: str, *args: str, timeout: float = 60.0, check: bool = True,
             record: bool = True) -> Any:
        result = run_tool(tool, *args, timeout=timeout)
        if record:
            self.actions.append(" ".join([tool, *args]))
        if check and result.returncode != 0:
            raise ServiceError.from_result(result)
        return result

    def _base_status(self) -> ServiceStatus:
        installed_env = self.installed_environment()
        content = self._read_installed()
        program = self.installed_program()
        default_home = str(Path.home() / ".mtplx")
        return ServiceStatus(
            manager=self.name,
            target=self.target,
            file=str(self.service_file),
            installed=content is not None,
            up_to_date=None if content is None else content == self.render(),
            program=program,
            program_exists=None if not program else os.path.exists(program[0]),
            home=None if installed_env is None else installed_env.get("MTPLX_HOME", default_home),
            serves_this_home=None if content is None else self.serves_this_home(),
            log_file=str(self.spec.log_file),
        )

    def _take_actions(self, changed: bool) -> ChangeReport:
        report = ChangeReport(changed=changed, actions=list(self.actions))
        self.actions.clear()
        return report
