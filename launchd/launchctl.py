"""The macOS manager: a LaunchAgent in the `gui/$UID` domain, driven by launchctl's modern verbs.

install   = [bootout + wait, when loaded and the plist changed] + write
            + [enable, when print-disabled lists the label as disabled] + bootstrap
uninstall = bootout + wait (when loaded) + remove the plist
start     = bootstrap when not loaded, else kickstart (never `-k`: it SIGKILLs and skips the
            daemon's drain and fan restore)
stop      = bootout: SIGTERM, then SIGKILL after ExitTimeOut. It unloads the job, so KeepAlive
            cannot bring it back; launchd loads it again at the next login (or `mtplxctl start`).
status    = print, parsed defensively (print_parser)
"""

from __future__ import annotations

import os
import plistlib
import time
from pathlib import Path
from typing import Any

from .base import ChangeReport, ServiceManager, ServiceStatus
from .plist import render_plist
from .print_parser import LaunchdJob, parse_disabled, parse_print
from .runner import ServiceError
from .spec import ServiceSpec

# launchctl exit statuses that mean "the service is not loaded" for bootout.
_NOT_LOADED = {3, 113}
# EINPROGRESS: bootout has sent SIGTERM and the job is still draining.
_IN_PROGRESS = 36
# EIO from bootstrap: the label is still registered (a bootout still draining).
_BOOTSTRAP_BUSY = 5
POLL_SECONDS = 0.2


def launch_agents_dir() -> Path:
    """`~/Library/LaunchAgents`, where per-user agents live and load from at login."""
    return Path.home() / "Library" / "LaunchAgents"


class LaunchdManager(ServiceManager):
    """The mtplxd LaunchAgent of the current user."""

    name = "launchd"

    def __init__(self, spec: ServiceSpec, agents_dir: Path | None = None, uid: int | None = None) -> None:
        super().__init__(spec)
        self.agents_dir = agents_dir or launch_agents_dir()
        self.domain = f"gui/{os.getuid() if uid is None else uid}"

    @property
    def service_file(self) -> Path:
        return self.agents_dir / f"{self.spec.label}.plist"

    @property
    def target(self) -> str:
        return f"{self.domain}/{self.spec.label}"

    def render(self) -> bytes:
        return render_plist(self.spec)

    def _installed_plist(self) -> dict[str, Any] | None:
        content = self._read_installed()
        if content is None:
            return None
        try:
            loaded = plistlib.loads(content)
        except (plistlib.InvalidFileException, ValueError):
            return None
        return loaded if isinstance(loaded, dict) else None

    def installed_environment(self) -> dict[str, str] | None:
        plist = self._installed_plist()
        if plist is None:
            return None
        env = plist.get("EnvironmentVariables") or {}
        return {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}

    def installed_program(self) -> list[str]:
        plist = self._installed_plist() or {}
        program = plist.get("ProgramArguments") or []
        return [str(a) for a in program] if isinstance(program, list) else []

    # ------------------------------------------------------------ lifecycle

    def install(self) -> ChangeReport:
        new = self.render()
        old = self._read_installed()
        changed = old != new
        job = self._job()
        if job is not None and changed:
            # launchd pins the job definition (and the binary's identity) at bootstrap: a
            # changed plist needs bootout + bootstrap, never a kickstart.
            self._bootout()
        if changed:
            self.agents_dir.mkdir(parents=True, exist_ok=True)
            self.spec.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._write(new)
        with self._removed_if_refused(first_install=old is None):
            if job is None or changed:
                self._load()
            elif not job.running:
                self._run("launchctl", "kickstart", self.target)
        return self._take_actions(changed)

    def uninstall(self) -> ChangeReport:
        if self._job() is not None:
            self._bootout()
        removed = self._remove_file()
        return self._take_actions(removed)

    def start(self) -> None:
        job = self._job()
        if job is None:
            self.spec.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._load()
        elif not job.running:
            self._run("launchctl", "kickstart", self.target)
        self.actions.clear()

    def stop(self) -> None:
        if self._job() is not None:
            self._bootout()
        self.actions.clear()

    def status(self) -> ServiceStatus:
        status = self._base_status()
        job = self._job()
        if job is None:
            status.state = "not loaded"
            return status
        status.loaded = True
        status.running = job.running
        status.pid = job.pid if job.running else None
        status.state = job.state
        status.runs = job.runs
        status.last_exit = job.last_exit
        status.last_exit_code = job.last_exit_code
        status.last_signal = job.last_signal
        status.enabled = not self._disabled()
        return status

    # ------------------------------------------------------------ launchctl verbs

    def _job(self) -> LaunchdJob | None:
        """The parsed `launchctl print` of the service; None when it is not loaded."""
        result = self._run("launchctl", "print", self.target, check=False, record=False)
        if result.returncode != 0:
            return None
        return parse_print(result.stdout)

    def _disabled(self) -> bool:
        result = self._run("launchctl", "print-disabled", self.domain, check=False, record=False)
        return result.returncode == 0 and parse_disabled(result.stdout).get(self.spec.label, False)

    def _load(self) -> None:
        """enable (only when the label is disabled) + bootstrap, retrying once while busy."""
        if self._disabled():
            # Without this, bootstrap fails with "119: Service is disabled".
            self._run("launchctl", "enable", self.target)
        result = self._run("launchctl", "bootstrap", self.domain, str(self.service_file), check=False)
        if result.returncode == _BOOTSTRAP_BUSY:
            self._wait_unloaded(self.spec.stop_timeout_seconds)
            result = self._run("launchctl", "bootstrap", self.domain, str(self.service_file),
                               check=False)
        if result.returncode != 0:
            raise ServiceError.from_result(result)

    def _bootout(self) -> None:
        """bootout, then wait until launchd has let go of the job (SIGTERM, drain, exit)."""
        timeout = self.spec.stop_timeout_seconds + 10
        result = self._run("launchctl", "bootout", self.target, check=False, timeout=timeout)
        if result.returncode not in (0, _IN_PROGRESS, *_NOT_LOADED):
            raise ServiceError.from_result(result)
        if not self._wait_unloaded(timeout):
            raise ServiceError(f"{self.target} is still loaded {timeout}s after bootout",
                               "see `mtplxctl logs`; `launchctl print " + self.target + "`")

    def _wait_unloaded(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if self._job() is None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)
