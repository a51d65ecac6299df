"""Budgets: byte cap, LRU by session, idle TTL, per-session cap, supersession, the guard hooks."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtplxd.engine.session.bank import BankIdentity, BankSettings, SessionBank, bank_settings
from mtplxd.engine.session.types import KV, BankEntry

IDENTITY = BankIdentity(model_path="/m", weights_fingerprint="w", template_hash="t",
                        quantization=None, dtype="float32", mlx_version="x", mlx_lm_version="y",
                        device="cpu")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(tokens: list[int], session: str = "", clock: Clock | None = None) -> BankEntry:
    n = len(tokens)
    kv = [(mx.ones((1, 2, n, 8)), mx.ones((1, 2, n, 8)))]
    e = BankEntry(tokens=tuple(tokens), kinds=(KV,), kv=kv, boundaries={}, session_id=session,
                  last_used=clock() if clock else 0.0)
    e.compute_nbytes()
    return e


SIZE = entry(list(range(100))).nbytes  # bytes of one 100-token test entry


def bank(clock: Clock, **settings) -> SessionBank:
    return SessionBank(IDENTITY, BankSettings(**settings), clock=clock)


def test_byte_cap_evicts_the_session_used_longest_ago():
    clock = Clock()
    b = bank(clock, ram_bytes=int(2.5 * SIZE))
    for i, session in enumerate("ABC"):
        clock.now += 1
        b.insert(entry([i] * 100, session, clock))
    assert [e.session_id for e in b.entries()] == ["C", "B"]
    assert b.bytes_held() <= 2.5 * SIZE
    assert b.stats()["evicted"] == 1


def test_lru_is_by_session_use(loaded, gen, toks):
    model = loaded("qwen3")
    probe = model.enable_session_bank(BankSettings())
    gen(model, toks(1, 100))
    size = probe.entries()[0].nbytes
    clock = Clock()
    model.bank = SessionBank(probe.identity, BankSettings(ram_bytes=int(2.5 * size)), clock=clock)
    try:
        a, b, c = toks(1, 100), toks(2, 100), toks(3, 100)
        ra = gen(model, a, session_id="A")
        clock.now += 1
        gen(model, b, session_id="B")
        clock.now += 1
        r = gen(model, a + ra.token_ids[:4], session_id="A")  # A is used again (a hit)
        assert r.stats.cached_tokens > 0
        clock.now += 1
        gen(model, c, session_id="C")
        assert sorted({e.session_id for e in model.bank.entries()}) == ["A", "C"]
    finally:
        model.bank = None


def test_idle_ttl_expires_entries():
    clock = Clock()
    b = bank(clock, idle_ttl_s=60)
    b.insert(entry([1] * 100, "A", clock))
    clock.now += 30
    b.insert(entry([2] * 100, "B", clock))
    clock.now += 45
    stats = b.stats()
    assert stats["entries"] == 1 and stats["expired"] == 1
    assert b.entries()[0].session_id == "B"


def test_per_session_entry_cap_keeps_the_newest():
    clock = Clock()
    b = bank(clock, per_session_entries=2)
    for i in range(5):
        clock.now += 1
        b.insert(entry([i] * 50, "S", clock))
    assert [e.tokens[0] for e in b.entries()] == [4, 3]


def test_an_extension_supersedes_its_prefix_and_a_prefix_is_covered():
    clock = Clock()
    b = bank(clock)
    b.insert(entry([1, 2, 3] * 20, "S", clock))
    b.insert(entry([1, 2, 3] * 30, "S", clock))
    assert [e.length for e in b.entries()] == [90]
    assert b.stats()["superseded"] == 1
    b.insert(entry([1, 2, 3] * 10, "S", clock))  # already covered by the longer entry
    assert [e.length for e in b.entries()] == [90]


def test_release_idle_frees_oldest_first_and_reports_bytes():
    clock = Clock()
    b = bank(clock)
    for i in range(4):
        clock.now += 1
        b.insert(entry([i] * 100, f"S{i}", clock))
    held = b.bytes_held()
    freed = b.release_idle(SIZE + 1)
    assert freed == 2 * SIZE
    assert b.bytes_held() == held - freed
    assert [e.session_id for e in b.entries()] == ["S3", "S2"]
    assert b.release_idle(0) == 0
    assert b.clear() == 2 * SIZE and b.bytes_held() == 0


def test_oversized_entry_is_skipped():
    b = bank(Clock(), ram_bytes=SIZE // 2)
    b.insert(entry([1] * 100))
    assert b.stats()["entries"] == 0 and b.stats()["oversized_skipped"] == 1


def test_stats_shape(loaded, gen, toks):
    model = loaded("qwen3")
    bank_ = model.enable_session_bank(BankSettings())
    try:
        p = toks(7, 80)
        gen(model, p)
        gen(model, p)
        stats = bank_.stats()
    finally:
        model.bank = None
    assert stats["entries"] == 1 and stats["hits"] == 1 and stats["misses"] == 1
    assert stats["hit_rate"] == pytest.approx(0.5)
    assert stats["cached_tokens"] == 79 and stats["prompt_tokens"] == 160
    assert stats["bytes"] == bank_.bytes_held() > 0
    assert stats["ssd_enabled"] is False and stats["ssd_entries"] == 0


def test_bank_settings_from_config(tmp_path):
    gib = 1024**3
    assert bank_settings("auto", True, tmp_path).ram_bytes == 2 * gib
    auto = bank_settings("auto", True, tmp_path, limit_bytes=40 * gib, weights_bytes=8 * gib)
    assert auto.ram_bytes == 8 * gib and auto.ssd_dir == tmp_path
    assert bank_settings(0, True, tmp_path) is None
    # A limit that leaves little after the weights: the bank never takes more than half of it
    # (the 1 GiB floor held 23 MiB of a 13 MiB room), and none when nothing is left.
    small = bank_settings("auto", True, tmp_path, limit_bytes=1 * gib, weights_bytes=1 * gib - 13 * 2**20)
    assert small.ram_bytes == 13 * 2**20 // 2
    assert bank_settings("auto", True, tmp_path, limit_bytes=gib, weights_bytes=2 * gib) is None
    assert bank_settings(1.5, False, tmp_path).ssd_dir is None
    assert bank_settings("auto", True, tmp_path, 0).ssd_dir is None
