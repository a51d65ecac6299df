"""A blocking client of the daemon's control socket (newline-delimited JSON-RPC 2.0)."""

from __future__ import annotations

import itertools
import json
import socket
from pathlib import Path
from typing import Any, Callable

from mtplxd.control.protocol import INTERNAL_ERROR, RpcError, encode
from mtplxd.paths import Paths

Notification = Callable[[str, dict[str, Any]], None]

# How long a question waits by default (status, config, stop's request): the daemon answers
# them on its event loop from what it holds, never behind the engine, so a daemon silent this
# long is stopped or hung, and a person should hear so promptly. Long operations (a model
# load, a pull) pass their own limit, or none.
QUICK_TIMEOUT = 10.0


class DaemonNotRunning(Exception):
    """Nothing answers on the control socket."""


class DaemonNotAnswering(Exception):
    """A daemon holds the control socket but did not answer in time (stopped, or hung)."""

    def __init__(self, socket_path: Path, timeout: float) -> None:
        super().__init__(f"no answer on {socket_path} within {timeout:g}s")
        self.socket_path = socket_path
        self.timeout = timeout


class ControlError(RpcError):
    """The daemon answered with a JSON-RPC error (the wire shape the server's RpcError
    sends); `reason` is the stable name."""


class ControlClient:
    """One connection per call keeps the client simple and the daemon's state per call."""

    def __init__(self, socket_path: Path, timeout: float | None = QUICK_TIMEOUT) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._ids = itertools.count(1)

    @classmethod
    def from_env(cls, timeout: float | None = QUICK_TIMEOUT) -> "ControlClient":
        """A client of the daemon that `MTPLX_HOME` / `MTPLX_SOCKET` point at."""
        return cls(Paths.from_env().socket, timeout)

    def call(self, method: str, params: dict[str, Any] | None = None,
             on_notification: Notification | None = None, timeout: float | None = -1) -> Any:
        """Call `method`; notifications before the result go to `on_notification`.

        Raises DaemonNotRunning when nothing listens, DaemonNotAnswering when the daemon does
        not answer within `timeout` (seconds, None for no limit; defaults to the client's),
        ControlError for an error answer.
        """
        limit = self.timeout if timeout == -1 else timeout
        try:
            return self._exchange(method, params, on_notification, limit)
        except TimeoutError:  # socket.timeout: the socket is there, the daemon does not answer
            raise DaemonNotAnswering(self.socket_path, limit) from None

    def _exchange(self, method: str, params: dict[str, Any] | None,
                  on_notification: Notification | None, timeout: float | None) -> Any:
        request_id = next(self._ids)
        payload = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params or {}}
        with self._connect(timeout) as sock:
            sock.sendall(encode(payload))
            reader = sock.makefile("rb")
            for line in reader:
                message = json.loads(line)
                if "id" not in message and "method" in message:
                    if on_notification is not None:
                        on_notification(message["method"], message.get("params", {}))
                    continue
                if "error" in message:
                    error = message["error"]
                    data = error.get("data") or {}
                    raise ControlError(error.get("code", 0), error.get("message", "error"),
                                       data.get("reason", "error"), data)
                if message.get("id") == request_id:
                    return message.get("result")
        raise ControlError(INTERNAL_ERROR, "the daemon closed the connection without answering", "no_answer")

    def _connect(self, timeout: float | None) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(self.socket_path))
        except (FileNotFoundError, NotADirectoryError, ConnectionRefusedError) as exc:
            sock.close()
            raise DaemonNotRunning(f"mtplxd is not running (no answer on {self.socket_path})") from exc
        except OSError:
            sock.close()
            raise
        return sock

    def is_running(self) -> bool:
        """True when a daemon answers `daemon.status`."""
        try:
            self.call("daemon.status", timeout=5)
            return True
        except DaemonNotRunning:
            return False
