"""The retrieval model pool on real tiny checkpoints: lazy loads, at most `limit` resident
(default 2, least recently used dropped first), everything dropped under memory pressure and
reloaded on next use, and `auto_map` checkpoints refused unless trusted."""

from __future__ import annotations

import pytest
import trio

from mtplxd.engine.fixtures.retrieval import write_tiny_embedding_checkpoint
from mtplxd.engine.retrieval import EMBEDDING, RetrievalError, RetrievalPool, RetrievalSpec
from mtplxd.pressure import watch_pressure


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> list[RetrievalSpec]:
    root = tmp_path_factory.mktemp("retrieval-pool")
    return [RetrievalSpec(name, write_tiny_embedding_checkpoint(root / name, seed=seed), EMBEDDING)
            for seed, name in enumerate(("a", "b", "c"))]


def test_two_stay_resident_by_default_and_the_least_recently_used_goes(specs):
    pool = RetrievalPool(specs)
    assert pool.resident() == []  # nothing loads before its first request
    first = pool.get("a")
    pool.get("b")
    assert pool.get("a") is first  # a resident model is reused, not reloaded
    pool.get("c")
    assert sorted(pool.resident()) == ["a", "c"]  # b was the least recently used


def test_memory_pressure_releases_every_resident_model_and_it_reloads_alike(specs):
    pool = RetrievalPool(specs)
    before = pool.get("a").embed([[5, 6, 7]])
    pool.get("b")
    levels = iter(["critical"])

    async def watch() -> None:
        with trio.move_on_after(0.5):
            await watch_pressure(lambda: len(pool.resident()), lambda needed: pool.release(),
                                 lambda: next(levels, "normal"), 0.01, "resident retrieval models")

    trio.run(watch)
    assert pool.resident() == []
    assert pool.get("a").embed([[5, 6, 7]]) == before


def test_a_checkpoint_with_its_own_python_is_refused_unless_trusted(specs, tmp_path):
    custom = RetrievalSpec("custom", write_tiny_embedding_checkpoint(tmp_path / "custom", auto_map=True), EMBEDDING)
    with pytest.raises(RetrievalError) as refused:
        RetrievalPool([custom]).get("custom")
    assert refused.value.code == "remote_code" and "--retrieval-trust-remote-code" in str(refused.value)
    vector = RetrievalPool([custom], trust_remote_code=True).get("custom").embed([[5, 6, 7]])[0]
    assert abs(sum(x * x for x in vector) - 1) < 1e-5
