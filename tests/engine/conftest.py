"""Engine fixtures: tiny checkpoints on disk, written once per session and per variant."""

from __future__ import annotations

import pytest

@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory):
    """The default dense qwen3 tiny model with its MTP head, loaded once per session."""
    from mtplxd.engine import load_model

    return load_model(tiny_model_factory("qwen3"))


@pytest.fixture
def small_m_kernel_twin(monkeypatch):
    """The small-M kernel as if on CUDA (both probes passed), its products computed by its
    plain-ops twin (`small_m_qmm.reference`): the GPU is what this machine lacks. Returns the
    list of (rows, layout) each product was routed with."""
    from mtplxd.engine.model import small_m_qmm

    calls = []

    def kernel_twin(x, w, scales, biases, bits, layout=None):
        calls.append((x.size // x.shape[-1], layout))
        return small_m_qmm.reference(x, w, scales, biases, bits)

    monkeypatch.setattr(small_m_qmm, "_usable", True)
    monkeypatch.setattr(small_m_qmm, "_mma_usable", True)
    monkeypatch.setattr(small_m_qmm, "small_m_matmul", kernel_twin)
    return calls


@pytest.fixture
def qk_norm_rope_twin(monkeypatch):
    """The query and key norm and rope kernel as if on CUDA (its probe passed), computed by
    its plain-ops twin (`qk_norm_rope.reference`). Returns the list of (batch, tokens) of
    each call."""
    from mtplxd.engine.model import qk_norm_rope

    calls = []

    def kernel_twin(attention, queries, keys, offset):
        calls.append(queries.shape[:2])
        return qk_norm_rope.reference(attention, queries, keys, offset)

    monkeypatch.setattr(qk_norm_rope, "_usable", True)
    monkeypatch.setattr(qk_norm_rope, "qk_norm_rope", kernel_twin)
    return calls
