"""A real `python -m mtplxd` for the API tests: its own MTPLX_HOME, a free loopback port
read back from the control socket's `daemon.status`, and the openai and anthropic SDK clients
that reach it. Keyring is forced to its `fail` backend in the daemons, so keys go to the 0600
file and the user's keychain is never touched.

A test module that needs its own daemon declares it with `daemon_fixture`:

    api = daemon_fixture(lambda folder: write_tiny_lfm2_checkpoint(folder / "tiny-lfm2"))

    def test_something(api):
        api.openai.chat.completions.create(...)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping
from unittest import mock

import anthropic as anthropic_sdk
import httpx
import openai as openai_sdk
import pytest

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

    # No retries in the SDK clients: a failed request shows as itself, not as a slow timeout.
    @cached_property
    def openai(self) -> openai_sdk.OpenAI:
        """An OpenAI SDK client of this daemon (closed by `stop`)."""
        return openai_sdk.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0)

    @cached_property
    def anthropic(self) -> anthropic_sdk.Anthropic:
        """An Anthropic SDK client of this daemon (closed by `stop`)."""
        return anthropic_sdk.Anthropic(base_url=self.base_url, api_key="unused", max_retries=0)

    def log(self) -> str:
        path = self.home / "daemon.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for sdk_client in ("openai", "anthropic"):
            if sdk_client in self.__dict__:  # only the clients a test used were made
                self.__dict__.pop(sdk_client).close()
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


def ctl_in(home: Path, *args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`python -m mtplxctl ARGS` on the daemon home `home` (wide columns: no folded tables)."""
    return subprocess.run([sys.executable, "-m", "mtplxctl", *args], capture_output=True, text=True,
                          timeout=timeout, env={**daemon_env(home, **env), "COLUMNS": "160"})


def installed_codex_config(daemon: ApiDaemon, codex_home: Path) -> dict[str, Any]:
    """What `mtplxctl agents install codex` writes for `daemon` into `codex_home`, parsed."""
    done = ctl_in(daemon.home, "agents", "install", "codex", timeout=120, CODEX_HOME=str(codex_home))
    assert done.returncode == 0, done.stdout + done.stderr
    return tomllib.loads((codex_home / "config.toml").read_text())


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


@dataclass(frozen=True)
class Launch:
    """What a test daemon serves: a checkpoint, extra `mtplxd` arguments and environment."""

    checkpoint: Path
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@contextmanager
def serving(checkpoint: Path, home: Path, *args: str, **env: str) -> Iterator[ApiDaemon]:
    """A loopback daemon in `home` serving `checkpoint` (with `args` and `env`), stopped on exit."""
    daemon = start_api_daemon(home, *args, MTPLX_MODEL=str(checkpoint), **env)
    try:
        yield daemon
    finally:
        daemon.stop()


def daemon_fixture(launch: Callable[[Path], Path | Launch]) -> Any:
    """A module-scoped fixture: a daemon serving what `launch` writes into a fresh folder (a
    checkpoint, or a Launch with options), reached through its `.openai` and `.anthropic`."""

    @pytest.fixture(scope="module")
    def running_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
        spec = launch(tmp_path_factory.mktemp("models"))
        spec = spec if isinstance(spec, Launch) else Launch(spec)
        with serving(spec.checkpoint, tmp_path_factory.mktemp("api-home"), *spec.args, **spec.env) as daemon:
            yield daemon

    return running_daemon


def scripted(name: str, pieces: list[str], loop_to: int | None = None) -> Callable[[Path], Path]:
    """A `daemon_fixture` launch: the scripted checkpoint `name` (the served id) that writes
    `pieces` (fixtures/scripted.py), what a random model never writes, on demand."""
    from mtplxd.engine.fixtures.scripted import write_scripted_checkpoint

    return lambda folder: write_scripted_checkpoint(folder / name, pieces, loop_to=loop_to)
