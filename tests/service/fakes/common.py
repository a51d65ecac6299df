"""What the fake launchctl and systemctl share: the call log and a supervised daemon process.

A real service manager is the parent of the daemon: it reaps it and remembers its exit status.
The fakes get the same by starting `supervise.py` detached, which runs the daemon as its child
and writes `main.pid` while it runs and appends its exit status to `exits` when it ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent


def state_dir() -> Path:
    """The fake's state root (FAKE_SERVICE_STATE, set by the test fixture)."""
    path = Path(os.environ["FAKE_SERVICE_STATE"])
    path.mkdir(parents=True, exist_ok=True)
    return path


def record(tool: str, argv: list[str]) -> None:
    """Append this call to calls.jsonl, the log the tests compare against."""
    with open(state_dir() / "calls.jsonl", "a") as log:
        log.write(json.dumps([tool, *argv]) + "\n")


def injected_failure(tool: str, verb: str) -> tuple[int, str] | None:
    """FAKE_FAIL="<tool> <verb>=<code>:<message>" makes one verb fail, as the real tool would."""
    spec = os.environ.get("FAKE_FAIL", "")
    head, sep, rest = spec.partition("=")
    if sep and head == f"{tool} {verb}":
        code, _, message = rest.partition(":")
        return int(code), message
    return None


def command_for(argv: list[str]) -> list[str]:
    """The command to run: the service's own, or the stand-in when FAKE_STANDIN is set."""
    if os.environ.get("FAKE_STANDIN"):
        return [sys.executable, str(HERE / "standin_daemon.py")]
    return argv


def start(proc_dir: Path, argv: list[str], env: dict[str, str], log_file: str | None) -> None:
    """Start `argv` under a detached supervisor; return once its pid is known."""
    proc_dir.mkdir(parents=True, exist_ok=True)
    (proc_dir / "main.pid").unlink(missing_ok=True)
    exits_before = len(_exits(proc_dir))
    runs = proc_dir / "runs"
    runs.write_text(str(int(runs.read_text()) + 1 if runs.exists() else 1))
    subprocess.Popen([sys.executable, str(HERE / "supervise.py"), str(proc_dir), log_file or "",
                      "--", *command_for(argv)],
                     env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    deadline = time.monotonic() + 10
    while not (proc_dir / "main.pid").exists() and len(_exits(proc_dir)) == exits_before:
        if time.monotonic() > deadline:
            raise SystemExit("fake: the supervised process did not start")
        time.sleep(0.02)


def main_pid(proc_dir: Path) -> int | None:
    """The pid of the running service process, or None."""
    try:
        pid = int((proc_dir / "main.pid").read_text())
    except (FileNotFoundError, ValueError):
        return None
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.NoSuchProcess:
        return None
    return pid


def _exits(proc_dir: Path) -> list[int]:
    try:
        return [int(line) for line in (proc_dir / "exits").read_text().split()]
    except FileNotFoundError:
        return []


def exit_status(proc_dir: Path) -> int | None:
    """The last exit status (negative: killed by that signal), or None before a first exit."""
    exits = _exits(proc_dir)
    return exits[-1] if exits else None


def stop(proc_dir: Path, timeout: float) -> None:
    """SIGTERM the service process, SIGKILL after `timeout`, and wait until the supervisor saw it end."""
    pid = main_pid(proc_dir)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while (proc_dir / "main.pid").exists():
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
        time.sleep(0.02)
