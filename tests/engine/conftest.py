"""Engine fixtures: tiny checkpoints on disk, written once per session and per variant."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from mtplxd.engine.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory) -> Callable[..., Path]:
    """factory(family="qwen3", **kwargs) -> Path of a tiny checkpoint (cached per session).

    kwargs are those of `write_tiny_checkpoint` (seed, with_mtp, quantize_bits, overrides).
    Tests must not modify the returned folder; copy it first.
    """
    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[str, Path] = {}

    def factory(family: str = "qwen3", **kwargs: Any) -> Path:
        key = json.dumps([family, kwargs], sort_keys=True, default=str)
        if key not in cache:
            dest = root / f"{family}-{len(cache)}"
            cache[key] = write_tiny_checkpoint(dest, family, **kwargs)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory):
    """The default dense qwen3 tiny model with its MTP head, loaded once per session."""
    from mtplxd.engine import load_model

    return load_model(tiny_model_factory("qwen3"))
