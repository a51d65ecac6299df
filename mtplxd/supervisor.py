"""Which service manager started us, and the systemd readiness notification.

Detection, most reliable first:
- `MTPLX_SUPERVISOR=launchd|systemd`: set by the plist and the unit that `mtplxctl service
  install` writes (launchd/plist.py, launchd/unit.py).
- launchd sets `XPC_SERVICE_NAME` to the job's label. Only our label counts: a shell in
  Terminal has "0", and one inside an app (an IDE's terminal) inherits the app's own label.
- systemd (v248+) sets `SYSTEMD_EXEC_PID` to the pid it started; a daemon started by hand from a
  shell that systemd runs (GNOME terminals are systemd units) inherits a different pid.
  `NOTIFY_SOCKET` is set only for Type=notify services. `INVOCATION_ID` alone is not used: every
  process of a desktop session's terminal inherits it.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Mapping

LAUNCHD_LABEL = "com.mtplx.mtplxd"
SYSTEMD_UNIT = "mtplxd.service"
SUPERVISORS = ("launchd", "systemd")

log = logging.getLogger(__name__)


def detect_supervisor(environ: Mapping[str, str] | None = None, pid: int | None = None) -> str | None:
    """"launchd", "systemd" or None (started by hand) for the process `pid` (default: us)."""
    env = os.environ if environ is None else environ
    declared = env.get("MTPLX_SUPERVISOR", "").strip().lower()
    if declared in SUPERVISORS:
        return declared
    if env.get("XPC_SERVICE_NAME") == LAUNCHD_LABEL:
        return "launchd"
    own_pid = str(os.getpid() if pid is None else pid)
    if env.get("SYSTEMD_EXEC_PID") == own_pid or env.get("NOTIFY_SOCKET"):
        return "systemd"
    return None


def sd_notify(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send `message` (e.g. "READY=1") to systemd's NOTIFY_SOCKET.

    Returns False when there is no socket or it cannot be reached: a lost notification must
    never take the daemon down (systemd then times the start out and says so in its journal).
    """
    env = os.environ if environ is None else environ
    address = env.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # the Linux abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("cannot notify systemd (%s) of %r: %s", env.get("NOTIFY_SOCKET"), message, exc)
        return False
    return True
