"""A real `python -m mtplxd` for the API tests: its own MTPLX_HOME, a free loopback port
read back from the control socket's `daemon.status`. Keyring is forced to its `fail` backend
in the daemons, so keys go to the 0600 file and the user's keychain is never touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from unittest import mock

import httpx

from mtplxd.paths import Paths
from mtplxctl.client import ControlClient

MODEL_ID = "tiny-qwen3"
NO_KEYRING = {"PYTHON_KEYRING_BACKEND": "keyring.backends.fail.Keyring"}


@dataclass
class ApiDaemon:
    """A running daemon and how to reach it."""

    process: subprocess.Popen
    home: Path
    port: int
    client: ControlClient

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60, **kwargs)

    def log(self) -> str:
        path = self.home / "daemon.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def daemon_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a test daemon: its own home, a free port, no stray MTPLX_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTPLX_")}
    env.update({"MTPLX_HOME": str(home), "MTPLX_PORT": "0", "HF_HUB_OFFLINE": "1", **NO_KEYRING})
    env.update(extra)
    return env


def ctl_in(home: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m mtplxctl ARGS` on the daemon home `home` (wide columns: no folded tables)."""
    return subprocess.run([sys.executable, "-m", "mtplxctl", *args], capture_output=True, text=True,
                          timeout=timeout, env={**daemon_env(home), "COLUMNS": "160"})


def paths_for(home: Path) -> Paths:
    with mock.patch.dict(os.environ, {"MTPLX_HOME": str(home)}):
        os.environ.pop("MTPLX_SOCKET", None)
        return Paths.from_env()


def start_api_daemon(home: Path, *args: str, wait_model: bool = True, timeout: float = 60,
                     **env: str) -> ApiDaemon:
    """Start `python -m mtplxd` in `home`; wait for HTTP (and the model, unless told not to)."""
    home.mkdir(parents=True, exist_ok=True)
    out = open(home / "daemon.out", "ab")
    process = subprocess.Popen([sys.executable, "-m", "mtplxd", *args], env=daemon_env(home, **env),
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    client = ControlClient(paths_for(home).socket, timeout=10)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mtplxd exited with {process.returncode}:\n"
                               + (home / "daemon.out").read_text(errors="replace"))
        if client.is_running():
            status = client.call("daemon.status")
            model = status.get("model") or {}
            if not wait_model or model.get("state") == "loaded":
                return ApiDaemon(process, home, int(status["http"]["port"]), client)
            if model.get("state") == "failed":
                raise RuntimeError(f"model failed to load: {model.get('error')}")
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("mtplxd did not come up:\n" + (home / "daemon.out").read_text(errors="replace"))


@contextmanager
def serving(checkpoint: Path, home: Path) -> Iterator[ApiDaemon]:
    """A loopback daemon in `home` serving `checkpoint`, stopped on exit."""
    daemon = start_api_daemon(home, MTPLX_MODEL=str(checkpoint))
    try:
        yield daemon
    finally:
        daemon.stop()


def start_scripted_daemon(tmp_path_factory, name: str, pieces: list[str],
                          loop_to: int | None = None) -> ApiDaemon:
    """A daemon serving a scripted checkpoint named `name` (the served id) that writes
    `pieces` (fixtures/scripted.py): what a random model never writes, on demand."""
    from mtplxd.engine.fixtures.scripted import write_scripted_checkpoint

    path = write_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / name, pieces, loop_to=loop_to)
    return start_api_daemon(tmp_path_factory.mktemp("api-home"), MTPLX_MODEL=str(path))
