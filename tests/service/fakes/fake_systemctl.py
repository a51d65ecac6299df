"""A recording fake of `systemctl --user` that really runs the unit.

daemon-reload snapshots the unit files (like systemd, `start` runs what was last reloaded, not
what is on disk). start runs ExecStart= with the Environment= lines applied on top of a user
manager's environment, output appended to StandardOutput=append:..., INVOCATION_ID set, and for
Type=notify a real NOTIFY_SOCKET (abstract namespace, as systemd uses for user managers when
asked) on which it waits for READY=1. stop sends SIGTERM and SIGKILL after TimeoutStopSec.
enable/disable manage the WantedBy= symlink as systemd does. Anything without --user fails.
"""

from __future__ import annotations

import os
import secrets
import shlex
import socket
import sys
import time
from pathlib import Path

import common

NOTIFY_TIMEOUT = 60.0


def _unit_dir() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.environ["HOME"], ".config")
    return Path(config) / "systemd" / "user"


def _unit_state(unit: str) -> Path:
    return common.state_dir() / "systemd" / unit


def _parse(text: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            values.setdefault(key.strip(), []).append(value.strip())
    return values


def _loaded(unit: str) -> dict[str, list[str]] | None:
    try:
        return _parse((_unit_state(unit) / "loaded.service").read_text())
    except FileNotFoundError:
        return None


def _words(value: str, dollar: bool) -> list[str]:
    words = [w.replace("%%", "%") for w in shlex.split(value)]
    return [w.replace("$$", "$") for w in words] if dollar else words


def _wants_link(unit: str, values: dict[str, list[str]]) -> Path | None:
    wanted = values.get("WantedBy", [None])[-1]
    return _unit_dir() / f"{wanted}.wants" / unit if wanted else None


def cmd_daemon_reload() -> int:
    unit_dir = _unit_dir()
    root = common.state_dir() / "systemd"
    root.mkdir(parents=True, exist_ok=True)
    for state in root.iterdir():
        if not (unit_dir / state.name).exists():
            (state / "loaded.service").unlink(missing_ok=True)
    if unit_dir.is_dir():
        for path in unit_dir.glob("*.service"):
            _unit_state(path.name).mkdir(parents=True, exist_ok=True)
            (_unit_state(path.name) / "loaded.service").write_text(path.read_text())
    return 0


def cmd_enable(unit: str, now: bool) -> int:
    values = _loaded(unit)
    if values is None:
        print(f"Failed to enable unit: Unit file {unit} does not exist.", file=sys.stderr)
        return 1
    link = _wants_link(unit, values)
    if link is not None and not link.is_symlink():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(_unit_dir() / unit)
        print(f"Created symlink {link} → {_unit_dir() / unit}.", file=sys.stderr)
    return cmd_start(unit) if now else 0


def cmd_disable(unit: str, now: bool) -> int:
    values = _loaded(unit) or _parse((_unit_dir() / unit).read_text())
    link = _wants_link(unit, values)
    if link is not None and link.is_symlink():
        link.unlink()
        print(f"Removed \"{link}\".", file=sys.stderr)
    return cmd_stop(unit) if now else 0


def cmd_start(unit: str) -> int:
    values = _loaded(unit)
    if values is None:
        print(f"Failed to start {unit}: Unit {unit} not found.", file=sys.stderr)
        return 5
    proc = _unit_state(unit) / "proc"
    if common.main_pid(proc) is not None:
        return 0
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "LANG": "C.UTF-8",
           "HF_HUB_OFFLINE": "1", "INVOCATION_ID": secrets.token_hex(16)}
    for value in values.get("Environment", []):
        for assignment in _words(value, dollar=False):
            key, _, item = assignment.partition("=")
            env[key] = item
    argv = _words(values["ExecStart"][-1], dollar=True)
    output = values.get("StandardOutput", [""])[-1]
    log_file = output[len("append:"):].replace("%%", "%") if output.startswith("append:") else None
    notify = values.get("Type", ["simple"])[-1] == "notify"
    if not notify:
        common.start(proc, argv, env, log_file)
        return 0
    name = f"mtplx-fake-notify-{secrets.token_hex(6)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind("\0" + name)
        listener.settimeout(0.2)
        env["NOTIFY_SOCKET"] = "@" + name
        common.start(proc, argv, env, log_file)
        return _wait_ready(listener, proc, unit)


def _wait_ready(listener: socket.socket, proc: Path, unit: str) -> int:
    deadline = time.monotonic() + NOTIFY_TIMEOUT
    while time.monotonic() < deadline:
        try:
            message = listener.recv(4096).decode()
        except socket.timeout:
            message = ""
        if "READY=1" in message.splitlines():
            (proc / "ready").write_text("1")
            return 0
        if common.main_pid(proc) is None and common.exit_status(proc) is not None:
            break
    print(f"Job for {unit} failed because the control process exited with error code.",
          file=sys.stderr)
    return 1


def cmd_stop(unit: str) -> int:
    values = _loaded(unit) or {}
    timeout = float(values.get("TimeoutStopSec", ["90"])[-1])
    common.stop(_unit_state(unit) / "proc", timeout)
    return 0


def cmd_show(unit: str, properties: list[str]) -> int:
    values = _loaded(unit)
    proc = _unit_state(unit) / "proc"
    pid = common.main_pid(proc)
    status = common.exit_status(proc)
    link = _wants_link(unit, values) if values else None
    if pid:
        active, sub = "active", "running"
    elif status not in (None, 0):
        active, sub = "failed", "failed"
    else:
        active, sub = "inactive", "dead"
    code = 0 if status is None or pid else (1 if status >= 0 else 2)
    shown = {
        "LoadState": "loaded" if values is not None else "not-found",
        "ActiveState": active, "SubState": sub, "MainPID": str(pid or 0),
        "ExecMainCode": str(code), "ExecMainStatus": str(abs(status) if status and not pid else 0),
        "UnitFileState": "enabled" if link is not None and link.is_symlink() else "disabled",
        "NRestarts": "0",
    }
    for key in properties or list(shown):
        print(f"{key}={shown.get(key, '')}")
    return 0


def main(argv: list[str]) -> int:
    common.record("systemctl", argv)
    if not argv or argv[0] != "--user":
        print("fake systemctl: only `systemctl --user ...` is allowed here", file=sys.stderr)
        return 1
    args = argv[1:]
    verb = args[0]
    failure = common.injected_failure("systemctl", verb)
    if failure is not None:
        print(failure[1], file=sys.stderr)
        return failure[0]
    now = "--now" in args
    units = [a for a in args[1:] if not a.startswith("--")]
    properties = [p for a in args if a.startswith("--property=") for p in a.split("=", 1)[1].split(",")]
    if verb == "daemon-reload":
        return cmd_daemon_reload()
    handlers = {"enable": lambda u: cmd_enable(u, now), "disable": lambda u: cmd_disable(u, now),
                "start": cmd_start, "stop": cmd_stop,
                "restart": lambda u: cmd_stop(u) or cmd_start(u),
                "show": lambda u: cmd_show(u, properties)}
    if verb in handlers and units:
        return handlers[verb](units[0])
    print(f"fake systemctl: unsupported {' '.join(args)}", file=sys.stderr)
    return 64
