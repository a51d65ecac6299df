"""Test isolation shared by every area: each test gets its own MTPLX_HOME and HOME.

A daemon started by a test (see the `daemon` fixture in tests/control/conftest.py) therefore
never touches the user's ~/.mtplx, and agent configs are written under a throwaway HOME.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest

from mtplxd import blas

# Before any test module imports MLX: the suite runs on the BLAS the daemon would use.
blas.activate()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HOME and MTPLX_HOME for each test, with no stray MTPLX_* settings."""
    root = tmp_path_factory.mktemp("home")
    home = root / "user"
    mtplx_home = root / "mtplx"
    home.mkdir()
    for name in list(os.environ):
        if name.startswith("MTPLX_") or name in {"XDG_CONFIG_HOME", "CODEX_HOME", "HERMES_HOME",
                                                 "PI_CODING_AGENT_DIR", "OPENCODE_CONFIG",
                                                 "NOTIFY_SOCKET", "INVOCATION_ID", "XPC_SERVICE_NAME"}:
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MTPLX_HOME", str(mtplx_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # A daemon a test starts binds a free port, never a real daemon's 8000.
    monkeypatch.setenv("MTPLX_PORT", "0")
    return mtplx_home


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """factory(family="qwen3", **kwargs) -> Path of a tiny checkpoint (cached per session).

    kwargs are those of `write_tiny_checkpoint` (seed, with_mtp, quantize_bits, overrides).
    Tests must not modify the returned folder; copy it first.
    """
    from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[str, Path] = {}

    def factory(family: str = "qwen3", **kwargs: Any) -> Path:
        key = json.dumps([family, kwargs], sort_keys=True, default=str)
        if key not in cache:
            dest = root / f"{family}-{len(cache)}"
            cache[key] = write_tiny_checkpoint(dest, family, **kwargs)
        return cache[key]

    return factory
