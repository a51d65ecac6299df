"""Fixtures of the control-plane tests."""

from __future__ import annotations

from typing import Iterator

import pytest

from support.daemon import RunningDaemon, start_daemon


@pytest.fixture
def daemon() -> Iterator[RunningDaemon]:
    """A daemon with no model (the control plane and HTTP up), stopped after the test."""
    running = start_daemon("--no-model")
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait(10)
