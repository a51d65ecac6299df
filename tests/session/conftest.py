"""Session-bank fixtures: tiny checkpoints per family (written once per session) and helpers
that run a request to its result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from mtplxd.engine import GenerationRequest, GenerationResult, SamplingParams
from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint

FAMILIES = ("qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """factory(family="qwen3", **kwargs) -> Path of a tiny checkpoint (cached per session)."""
    root = tmp_path_factory.mktemp("session-tiny-models")
    cache: dict[str, Path] = {}

    def factory(family: str = "qwen3", **kwargs: Any) -> Path:
        key = json.dumps([family, kwargs], sort_keys=True, default=str)
        if key not in cache:
            cache[key] = write_tiny_checkpoint(root / f"{family}-{len(cache)}", family, **kwargs)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def loaded(tiny_checkpoint) -> Callable[[str], Any]:
    """loaded(family) -> a LoadedModel without a bank (one per family per session).
    Tests that give it a bank must take it away again (`model.bank = None`)."""
    from mtplxd.engine import load_model

    models: dict[str, Any] = {}

    def get(family: str) -> Any:
        if family not in models:
            models[family] = load_model(tiny_checkpoint(family))
        return models[family]

    return get


def run(model: Any, prompt: list[int], *, depth: int | None = None, max_tokens: int = 12,
        session_id: str | None = None, prefill_chunk: int | None = 32,
        temperature: float = 0.0, seed: int | None = None) -> GenerationResult:
    """Run one request to its GenerationResult (greedy unless a temperature is given)."""
    request = GenerationRequest(
        prompt_ids=list(prompt), depth=depth, prefill_chunk=prefill_chunk, session_id=session_id,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature,
                                seed=seed))
    return model.complete(request)


def cold(model: Any, gen: Callable[..., GenerationResult], prompt: list[int]) -> GenerationResult:
    """`gen(model, prompt)` with the model's bank taken away for the call: the cold reference."""
    bank, model.bank = model.bank, None
    try:
        return gen(model, prompt)
    finally:
        model.bank = bank


def tokens(seed: int, n: int, low: int = 5, high: int = 300) -> list[int]:
    """n pseudo-random ordinary token ids (no special tokens)."""
    import numpy as np

    return np.random.default_rng(seed).integers(low, high, size=n).tolist()


@pytest.fixture
def gen() -> Callable[..., GenerationResult]:
    """The `run` helper: gen(model, prompt, depth=..., max_tokens=..., session_id=...)."""
    return run


@pytest.fixture
def toks() -> Callable[[int, int], list[int]]:
    """The `tokens` helper: toks(seed, n) -> n random ordinary token ids."""
    return tokens
