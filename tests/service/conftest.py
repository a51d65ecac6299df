"""Fixtures of the service tests: recording fakes of launchctl and systemctl first on PATH.

The fakes (tests/service/fakes/) really run the service's command, so a test can start a real
mtplxd through them; every process they started is killed when the test ends.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

FAKES = Path(__file__).resolve().parent / "fakes"
DATA = Path(__file__).resolve().parent / "data"


@dataclass
class FakeTools:
    """The fake launchctl/systemctl of one test: their call log and their state."""

    state: Path

    def calls(self, clear: bool = True) -> list[list[str]]:
        """Every recorded call since the last `calls()`, as argv lists starting with the tool."""
        log = self.state / "calls.jsonl"
        if not log.exists():
            return []
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        if clear:
            log.unlink()
        return calls

    def proc_dir(self, manager: str, name: str) -> Path:
        """Where the fake keeps the pid and exit status of a service's process."""
        root = "launchd" if manager == "launchd" else "systemd"
        return self.state / root / name / "proc"

    def exit_status(self, manager: str, name: str) -> int | None:
        """The service process's last exit status (negative: the signal), None before one."""
        try:
            exits = (self.proc_dir(manager, name) / "exits").read_text().split()
        except FileNotFoundError:
            return None
        return int(exits[-1]) if exits else None

    def main_pid(self, manager: str, name: str) -> int | None:
        try:
            return int((self.proc_dir(manager, name) / "main.pid").read_text())
        except FileNotFoundError:
            return None


def _write_wrapper(bin_dir: Path, tool: str) -> None:
    wrapper = bin_dir / tool
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path.insert(0, {str(FAKES)!r})\n"
        f"from fake_{tool} import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    wrapper.chmod(0o755)


@pytest.fixture
def fake_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTools]:
    """Fake `launchctl` and `systemctl` first on PATH, the daemon stand-in by default."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    for tool in ("launchctl", "systemctl"):
        _write_wrapper(bin_dir, tool)
    state = tmp_path / "fake-state"
    state.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SERVICE_STATE", str(state))
    monkeypatch.setenv("FAKE_STANDIN", "1")
    tools = FakeTools(state)
    try:
        yield tools
    finally:
        _kill_leftovers(state)


def _kill_leftovers(state: Path) -> None:
    for pid_file in state.glob("*/*/proc/main.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError, FileNotFoundError):
            pass


@pytest.fixture
def launchd_tools(fake_tools: FakeTools, monkeypatch: pytest.MonkeyPatch) -> FakeTools:
    """The launchd manager selected (on Linux too), with the fake launchctl."""
    monkeypatch.setenv("MTPLX_SERVICE_MANAGER", "launchd")
    return fake_tools


@pytest.fixture
def systemd_tools(fake_tools: FakeTools, monkeypatch: pytest.MonkeyPatch) -> FakeTools:
    """The systemd manager selected, with the fake systemctl."""
    monkeypatch.setenv("MTPLX_SERVICE_MANAGER", "systemd")
    return fake_tools


@pytest.fixture
def daemon_config(isolated_home: Path) -> Path:
    """A config.toml for a real daemon under a fake manager: free port, quick stop, no model."""
    isolated_home.mkdir(parents=True, exist_ok=True)
    config = isolated_home / "config.toml"
    config.write_text('port = 0\nmodel = "/nonexistent/model"\nshutdown_grace_seconds = 2\n')
    return config
