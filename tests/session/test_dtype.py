"""A stored state carries its dtype: one of another dtype than the run's is a miss, never cast."""

from __future__ import annotations

import sys
from dataclasses import replace

import mlx.core as mx
import pytest

from mtplxd.engine.session.bank import BankSettings
from mtplxd.engine.session.types import BankEntry

from .conftest import cold


def cast(entry: BankEntry, dtype: mx.Dtype) -> BankEntry:
    """A copy of `entry` whose float state is `dtype` (what a bfloat16 run would have stored)."""
    def c(a):
        return None if a is None else a.astype(dtype)

    # replace() keeps the entry's session and last use: a copy must not look idle-expired.
    copy = replace(
        entry,
        kv=[None if p is None else (c(p[0]), c(p[1])) for p in entry.kv],
        boundaries={b: [(c(conv), rec) for conv, rec in state] for b, state in entry.boundaries.items()},
        head_kv=None if entry.head_kv is None else (c(entry.head_kv[0]), c(entry.head_kv[1])),
        tail_hidden=c(entry.tail_hidden))
    copy.compute_nbytes()
    return copy


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU upcast is Linux's")
def test_linux_cpu_model_computes_and_stores_float32(loaded, gen, toks):
    model = loaded("qwen3_5")
    bank = model.enable_session_bank(BankSettings())
    try:
        gen(model, toks(1, 100))
        (entry,) = bank.entries()
    finally:
        model.bank = None
    assert model.info.dtype == "float32" and bank.identity.cache_dtype == "float32"
    assert entry.dtype == "float32"


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_bfloat16_entry_is_refused_in_a_float32_run(loaded, gen, toks, family):
    model = loaded(family)
    bank = model.enable_session_bank(BankSettings())
    try:
        first = toks(1, 120)
        r1 = gen(model, first)
        (entry,) = bank.entries()
        bank.clear()
        bank.insert(cast(entry, mx.bfloat16))
        follow = first + r1.token_ids + toks(2, 30)
        refused = gen(model, follow)
        bank.clear()
        bank.insert(cast(entry, mx.float32))
        restored = gen(model, toks(1, 120) + r1.token_ids + toks(3, 30))
    finally:
        model.bank = None
    assert bank.identity.cache_dtype == model.info.dtype == "float32"
    assert refused.stats.cached_tokens == 0
    assert refused.token_ids == cold(model, gen, follow).token_ids
    assert restored.stats.cached_tokens >= len(first)


def test_bfloat16_blob_on_ssd_is_refused(loaded, gen, toks, tmp_path):
    model = loaded("qwen3")
    bank = model.enable_session_bank(BankSettings())
    first = toks(1, 120)
    r1 = gen(model, first)
    (entry,) = bank.entries()
    model.bank = None
    bank = model.enable_session_bank(BankSettings(ssd_dir=tmp_path, ssd_min_tokens=64))
    try:  # a new process whose SSD tier holds the bfloat16 state of the same prefix
        assert bank.store.put(bank.identity.key, cast(entry, mx.bfloat16))
        assert bank.store.flush()
        follow = first + r1.token_ids + toks(2, 30)
        result = gen(model, follow)
        stats = bank.stats()
    finally:
        bank.close()
        model.bank = None
    assert stats["ssd_entries"] >= 1
    assert result.stats.cached_tokens == 0 and stats["ssd_hits"] == 0
    assert result.token_ids == cold(model, gen, follow).token_ids
