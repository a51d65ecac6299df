"""Where the HTTP API listens: whether a bind address is loopback (keyless allowed) and the
base URL a client on this machine uses to reach it.
"""

from __future__ import annotations

import ipaddress

import psutil
from typing import Any

from mtplxd.api.auth import ENV_KEY


def is_loopback(host: str) -> bool:
    """True for loopback bind addresses (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def http_status(host: str, port: int, binds: list[str]) -> dict[str, Any]:
    """The HTTP part of `daemon.status`: the configured bind, what hypercorn bound (`binds`),
    the base URL for clients on this machine and whether requests need the API key."""
    if binds:
        # hypercorn reports what it bound, with the real port when port 0 was asked for.
        port = int(binds[0].rsplit(":", 1)[1])
    # A wildcard bind serves every interface; clients on this machine reach it on loopback.
    shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)
    return {
        "host": host,
        "port": port,
        "url": f"http://{shown}:{port}",  # the root: Anthropic clients and curl examples
        "base_url": f"http://{shown}:{port}/v1",
        "binds": binds,
        "key_required": not is_loopback(host),
        "key_env": ENV_KEY,
    }


def port_owner(port: int) -> tuple[int, str] | None:
    """(pid, process name) of whoever listens on TCP `port`, when the OS lets us see it."""
    try:
        connections = psutil.net_connections(kind="inet")
    except (psutil.Error, OSError):
        return None
    for conn in connections:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            try:
                return conn.pid, psutil.Process(conn.pid).name()
            except psutil.Error:
                return conn.pid, "unknown"
    return None
