"""API test fixtures: a tiny checkpoint, and a real daemon serving it per test module
(imports and model load take seconds). Helpers live in tests/support/api_daemon.py."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint
from support.api_daemon import MODEL_ID, ApiDaemon, start_api_daemon


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3 + MTP checkpoint whose folder name is the served model id."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("api-models") / MODEL_ID, "qwen3")


@pytest.fixture(scope="module")
def api(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    """A loopback daemon serving the tiny model (shared by one test module)."""
    daemon = start_api_daemon(tmp_path_factory.mktemp("api-home"), MTPLX_MODEL=str(tiny_checkpoint))
    try:
        yield daemon
    finally:
        daemon.stop()
