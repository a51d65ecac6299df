"""Shared test helpers: a real mtplxd subprocess in the test's own MTPLX_HOME, and mtplxctl.

Import as `from support.daemon import start_daemon, run_ctl` (tests/ is on pytest's pythonpath).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mtplxd.paths import Paths
from mtplxctl.client import ControlClient


@dataclass
class RunningDaemon:
    process: subprocess.Popen
    paths: Paths
    client: ControlClient

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)


def start_daemon(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> RunningDaemon:
    """Start `python -m mtplxd` and wait until its control socket answers."""
    environ = {**os.environ, "MTPLX_PORT": "0", **(env or {})}
    home = Path(os.environ["MTPLX_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / "daemon.out", "ab")
    process = subprocess.Popen([sys.executable, "-m", "mtplxd", *args], env=environ,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    paths = Paths.from_env()
    client = ControlClient(paths.socket, timeout=10)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mtplxd exited with {process.returncode} at start")
        if client.is_running():
            return RunningDaemon(process, paths, client)
        time.sleep(0.05)
    process.kill()
    raise RuntimeError("mtplxd did not come up")


def run_ctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `mtplxctl` as a subprocess, the way a user does."""
    return subprocess.run([sys.executable, "-m", "mtplxctl", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "COLUMNS": "200"})


def greedy_completion(base_url: str, model: str, prompt: str, max_tokens: int) -> str:
    """The text of one temperature-0 completion through the OpenAI SDK (`base_url`: .../v1)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0).choices[0].text


def single_process_text(model_path: Path, prompt: str, max_tokens: int) -> str:
    """What one process (`load_model`, greedy) answers to `prompt`: a group's reference."""
    from mtplxd.engine import GenerationRequest, SamplingParams, load_model

    single = load_model(model_path)
    return single.complete(GenerationRequest(
        single.tokenizer.encode(prompt), SamplingParams(max_tokens=max_tokens))).text
