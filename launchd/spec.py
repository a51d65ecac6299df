"""What the login service runs: one description both the plist and the systemd unit are built from.

The daemon command is `[sys.executable, "-m", "mtplxd"]`, the interpreter running mtplxctl now
(symlinks kept: a venv's python is a symlink whose *path* selects the venv). It is the exact
command `mtplxctl start` spawns, and it works wherever pip put the console scripts (a `--user`
install puts `mtplxd` in ~/.local/bin, far from sys.executable).

Only non-secret keys reach the service environment: the home and socket that select the
daemon, the supervisor marker, and on macOS a PATH (launchd's default is minimal). API keys are
read by the daemon from the keyring or its secrets store, never from the service file.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from mtplxd.config import SETTINGS, ConfigError, load_config
from mtplxd.paths import Paths
from mtplxd.supervisor import LAUNCHD_LABEL, SYSTEMD_UNIT

from .runner import ServiceError

# Seconds the service manager waits after SIGTERM beyond the daemon's own drain
# (`shutdown_grace_seconds`): the model-owner thread finishing its step, fan restore, socket
# cleanup. Only then does launchd/systemd send SIGKILL.
STOP_MARGIN_SECONDS = 20

# launchd's respawn throttle: a crashing daemon is restarted at most every 10 s.
THROTTLE_SECONDS = 10

# What launchd gives a job when the plist sets no PATH.
LAUNCHD_DEFAULT_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


@dataclass(frozen=True)
class ServiceSpec:
    """The daemon command, its environment, its logs and how long a clean stop may take."""

    label: str
    unit_name: str
    program: list[str]
    environment: dict[str, str]
    home: Path
    log_file: Path
    stop_timeout_seconds: int
    throttle_seconds: int = THROTTLE_SECONDS
    launchd_path: str = field(default=LAUNCHD_DEFAULT_PATH)

    def environment_for(self, supervisor: str) -> dict[str, str]:
        """The service environment, with `MTPLX_SUPERVISOR` naming the manager."""
        return {**self.environment, "MTPLX_SUPERVISOR": supervisor}


def daemon_program(executable: str | None = None) -> list[str]:
    """`[python, "-m", "mtplxd"]` with the absolute (not symlink-resolved) interpreter path."""
    python = executable if executable is not None else sys.executable
    if not python:
        raise ServiceError("cannot tell which Python runs mtplxctl (sys.executable is empty)")
    return [os.path.abspath(python), "-m", "mtplxd"]


def target_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """MTPLX_HOME (when not the default) and MTPLX_SOCKET (when set), as absolute paths.

    The service starts in `/` with none of the shell's variables, so a relative or `~` path
    would point somewhere else; both are made absolute here.
    """
    env: dict[str, str] = {}
    home = environ.get("MTPLX_HOME")
    if home:
        absolute = os.path.abspath(os.path.expanduser(home))
        if Path(absolute) != Path.home() / ".mtplx":
            env["MTPLX_HOME"] = absolute
    socket = environ.get("MTPLX_SOCKET")
    if socket:
        env["MTPLX_SOCKET"] = os.path.abspath(os.path.expanduser(socket))
    return env


def shutdown_grace(paths: Paths) -> int:
    """The configured `shutdown_grace_seconds` (config.toml only: the service never sees the
    shell's MTPLX_* overrides). Raises ConfigError for a broken config file."""
    config = load_config(paths.config_file, environ={})
    return int(config.shutdown_grace_seconds)


def build_spec(environ: Mapping[str, str] | None = None, strict: bool = True) -> ServiceSpec:
    """The service description for this MTPLX_HOME.

    With `strict`, a broken config.toml raises ConfigError (install must not write a service
    that fails at start); otherwise the default grace is used (start/stop/status still work).
    """
    environ = os.environ if environ is None else environ
    paths = Paths.from_env()
    try:
        grace = shutdown_grace(paths)
    except ConfigError:
        if strict:
            raise
        grace = int(SETTINGS["shutdown_grace_seconds"].default)
    environment = target_environment(environ)
    home = Path(environment.get("MTPLX_HOME") or Path.home() / ".mtplx")
    program = daemon_program()
    for value in [*program, *environment.values()]:
        if "\n" in value or "\0" in value:
            raise ServiceError(f"cannot write a service for a path containing a newline: {value!r}")
    return ServiceSpec(
        label=LAUNCHD_LABEL,
        unit_name=SYSTEMD_UNIT,
        program=program,
        environment=environment,
        home=home,
        log_file=home / "logs" / "mtplxd.out",
        stop_timeout_seconds=grace + STOP_MARGIN_SECONDS,
        launchd_path=f"{os.path.dirname(program[0])}:{LAUNCHD_DEFAULT_PATH}",
    )
