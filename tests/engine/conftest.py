"""Engine fixtures: tiny checkpoints on disk, written once per session and per variant."""

from __future__ import annotations

import pytest

@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory):
    """The default dense qwen3 tiny model with its MTP head, loaded once per session."""
    from mtplxd.engine import load_model

    return load_model(tiny_model_factory("qwen3"))
