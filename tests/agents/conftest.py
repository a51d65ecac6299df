"""Fixtures of the agents tests: a temp HOME and MTPLX_HOME per test, and daemon targets."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from mtplxctl.agents.target import AgentTarget

STATUS = {
    "http": {"base_url": "http://127.0.0.1:8000/v1", "key_required": False, "key_env": "MTPLX_API_KEY"},
    "model": {"id": "mtplx-tiny-coder", "state": "loaded", "context_length": 32768,
              "max_output_tokens": 8192, "reasoning": True},
}


@pytest.fixture(autouse=True)
def user_home(isolated_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's own HOME (tests/conftest.py makes it), with no agent location override left."""
    for name in ("XDG_CONFIG_HOME", "OPENCODE_CONFIG", "PI_CODING_AGENT_DIR", "HERMES_HOME", "CODEX_HOME",
                 "CLAUDE_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    return Path(os.environ["HOME"])


@pytest.fixture
def env(user_home: Path) -> dict[str, str]:
    """The environment mapping the writers resolve locations from."""
    return {"HOME": str(user_home), "PATH": ""}


@pytest.fixture
def mtplx_home(isolated_home: Path) -> Path:
    """The test's own MTPLX_HOME, where the install record lives."""
    return Path(os.environ["MTPLX_HOME"])


@pytest.fixture
def status() -> dict:
    """A fresh copy of a keyless daemon's `daemon.status` (the parts agents read)."""
    return copy.deepcopy(STATUS)


@pytest.fixture
def target() -> AgentTarget:
    return AgentTarget.from_status(STATUS)


@pytest.fixture
def keyed_target() -> AgentTarget:
    status = {**STATUS, "http": {**STATUS["http"], "key_required": True}}
    return AgentTarget.from_status(status)
