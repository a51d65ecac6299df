"""Which service manager this machine has: launchd on macOS, systemd --user on Linux.

`MTPLX_SERVICE_MANAGER=launchd|systemd|none` overrides the choice (the tests drive the launchd
logic on Linux through it, with a fake `launchctl` on PATH).
"""

from __future__ import annotations

import os
import shutil
import sys

from .base import ServiceManager
from .launchctl import LaunchdManager
from .runner import ServiceError
from .spec import build_spec
from .systemd import SystemdManager

OVERRIDE_ENV = "MTPLX_SERVICE_MANAGER"
MANAGERS = {"launchd": LaunchdManager, "systemd": SystemdManager}


def manager_name(environ: dict[str, str] | None = None, platform: str | None = None) -> str | None:
    """"launchd", "systemd" or None when this platform has no supported service manager.

    Raises ServiceError for an unknown `MTPLX_SERVICE_MANAGER` value.
    """
    env = os.environ if environ is None else environ
    override = env.get(OVERRIDE_ENV, "").strip().lower()
    if override:
        if override == "none":
            return None
        if override not in MANAGERS:
            raise ServiceError(f"{OVERRIDE_ENV}={override!r}: expected launchd, systemd or none")
        return override
    platform = sys.platform if platform is None else platform
    if platform == "darwin":
        return "launchd"
    if platform.startswith("linux") and shutil.which("systemctl"):
        return "systemd"
    return None


def service_manager(strict: bool = False) -> ServiceManager | None:
    """The manager for this platform, bound to the current MTPLX_HOME; None when unsupported.

    With `strict`, a broken config.toml raises ConfigError (what install wants); otherwise the
    default shutdown grace stands in (what start/stop/status want).
    """
    name = manager_name()
    if name is None:
        return None
    return MANAGERS[name](build_spec(strict=strict))
