"""Every file the daemon owns, under one root: `MTPLX_HOME` (default `~/.mtplx`).

The control socket is the one path that may live elsewhere: `MTPLX_SOCKET` overrides it, and a
socket path too long for `sun_path` (104 bytes on macOS, 108 on Linux) falls back to a short
per-user directory under /tmp so a deep `MTPLX_HOME` never stops the daemon from starting.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# sun_path holds the path plus a terminating NUL.
SUN_PATH_MAX = 104 if sys.platform == "darwin" else 108


def default_home() -> Path:
    """The state root: `$MTPLX_HOME`, else `~/.mtplx`."""
    env = os.environ.get("MTPLX_HOME")
    return Path(env).expanduser() if env else Path.home() / ".mtplx"


def short_socket_dir() -> Path:
    """The per-user fallback directory for a socket whose natural path is too long."""
    return Path(f"/tmp/mtplx-{os.getuid()}")


def fits_sun_path(path: Path) -> bool:
    """True when `path` fits in a `sockaddr_un` on this platform."""
    return len(os.fsencode(str(path))) < SUN_PATH_MAX


class HomeUnusable(Exception):
    """MTPLX_HOME (or a folder under it) cannot be created or written; the message is one
    sentence naming the path, the reason and the fix."""


def unusable_home(home: Path, exc: OSError) -> HomeUnusable:
    """The HomeUnusable for an OSError met while creating or writing under `home`."""
    where = exc.filename or home
    reason = (exc.strerror or str(exc)).lower()
    return HomeUnusable(f"the mtplx home {home} cannot be created or written ({reason}: "
                        f"{where}); set MTPLX_HOME to a folder you can write, or fix its "
                        f"permissions")


@dataclass(frozen=True)
class Paths:
    """The layout of one MTPLX_HOME (see docs/architecture.md)."""

    home: Path
    socket: Path
    socket_is_fallback: bool = False

    @classmethod
    def from_env(cls) -> "Paths":
        """Resolve the layout from `MTPLX_HOME` and `MTPLX_SOCKET`."""
        home = default_home()
        override = os.environ.get("MTPLX_SOCKET")
        if override:
            return cls(home=home, socket=Path(override).expanduser())
        natural = home / "run" / "mtplxd.sock"
        if fits_sun_path(natural):
            return cls(home=home, socket=natural)
        # A distinct name per home keeps two long homes from sharing one fallback socket.
        digest = _short_digest(str(home.resolve()))
        return cls(home=home, socket=short_socket_dir() / f"{digest}.sock", socket_is_fallback=True)

    @property
    def config_file(self) -> Path:
        return self.home / "config.toml"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def lock_file(self) -> Path:
        return self.run_dir / "mtplxd.lock"

    @property
    def pid_file(self) -> Path:
        return self.run_dir / "mtplxd.pid"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def log_file(self) -> Path:
        return self.logs_dir / "mtplxd.log"

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def session_bank_dir(self) -> Path:
        return self.home / "session-bank"

    @property
    def metrics_dir(self) -> Path:
        return self.home / "metrics"

    @property
    def fans_lease(self) -> Path:
        return self.home / "fans.lease"

    @property
    def secrets_dir(self) -> Path:
        return self.home / "secrets"

    def ensure(self) -> None:
        """Create the directories the daemon writes to; run/, logs/ and the socket dir are 0700
        (logs name models, paths and clients). Raises HomeUnusable when that fails."""
        try:
            self._ensure()
        except OSError as exc:
            raise unusable_home(self.home, exc) from None
        if not os.access(self.home, os.W_OK | os.X_OK):
            raise unusable_home(self.home, PermissionError(13, "Permission denied", str(self.home)))

    def _ensure(self) -> None:
        for directory in (self.home, self.models_dir, self.metrics_dir):
            directory.mkdir(parents=True, exist_ok=True)
        private = [self.run_dir, self.logs_dir]
        if self.socket_is_fallback:
            private.append(self.socket.parent)
        for directory in private:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(directory, 0o700)
        # An MTPLX_SOCKET override may point into a shared directory: create it when missing,
        # never change the mode of a directory that is not ours.
        if not self.socket.parent.exists():
            self.socket.parent.mkdir(parents=True, mode=0o700)


def _short_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]
