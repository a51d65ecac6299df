"""Engine fixtures: tiny checkpoints on disk, written once per session and per variant."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory):
    """The default dense qwen3 tiny model with its MTP head, loaded once per session.

    On CUDA its heads are 64 wide, so that the fused loop's attention runs through the
    buffer_attention kernel (which needs a head size 32 lanes split) in every exactness test
    that uses this model; elsewhere the tiny default (16) keeps the CPU tests quick.
    """
    from mtplxd.engine import load_model
    from mtplxd.engine.kv_cache import fixed_shapes_wanted

    overrides = {"head_dim": 64} if fixed_shapes_wanted() else {}
    return load_model(tiny_model_factory("qwen3", **overrides))
