"""Which service manager started us, and the systemd readiness notification.

launchd sets XPC_SERVICE_NAME to the job label for its jobs (a terminal gets "0" or nothing);
systemd sets INVOCATION_ID for every unit it starts and NOTIFY_SOCKET for Type=notify units.
"""

from __future__ import annotations

import os
import socket

LAUNCHD_LABEL = "com.mtplx.mtplxd"
SYSTEMD_UNIT = "mtplxd.service"


def detect_supervisor(environ: dict[str, str] | None = None) -> str | None:
    """"launchd", "systemd" or None (started by hand)."""
    env = os.environ if environ is None else environ
    xpc = env.get("XPC_SERVICE_NAME", "")
    if xpc and xpc != "0":
        return "launchd"
    if env.get("INVOCATION_ID") or env.get("NOTIFY_SOCKET"):
        return "systemd"
    return None


def sd_notify(message: str, environ: dict[str, str] | None = None) -> bool:
    """Send `message` (e.g. "READY=1") to systemd's NOTIFY_SOCKET; False when there is none."""
    env = os.environ if environ is None else environ
    address = env.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(message.encode())
    return True
