"""The session bank with a quantized KV cache (kv_bits): a follow-up turn restored from RAM
or from the SSD (after a restart) decodes exactly what a cold prefill does, and an entry
stored at one kv_bits never resumes a cache at another."""

from __future__ import annotations

import pytest

from mtplxd.engine import load_model
from mtplxd.engine.session.bank import BankSettings

from .conftest import cold


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint):
    models = {}

    def get(family: str, bits: int):
        if (family, bits) not in models:
            models[family, bits] = load_model(tiny_checkpoint(family, head_dim=32), kv_bits=bits)
        return models[family, bits]

    return get


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("depth", [0, 3])
def test_ram_restore_of_a_quantized_cache_is_exact(quantized, gen, toks, family, depth):
    model = quantized(family, 8)
    first = toks(3, 120)
    model.enable_session_bank(BankSettings())
    try:
        warm1 = gen(model, first, depth=depth)
        follow = first + warm1.token_ids + toks(4, 30)
        warm2 = gen(model, follow, depth=depth)
    finally:
        model.bank = None
    cold2 = gen(model, follow, depth=depth)
    assert warm2.stats.cached_tokens >= len(first) and warm2.stats.restored_from == "ram"
    assert warm2.token_ids == cold2.token_ids


def first_turn_on_ssd(model, gen, prompt, settings):
    """Turn 1 with an SSD-backed bank, flushed and closed (the daemon stopped)."""
    bank = model.enable_session_bank(settings)
    result = gen(model, prompt)
    assert bank.store.flush()
    bank.close()
    model.bank = None
    return result


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_ssd_restore_of_a_quantized_cache_survives_a_restart(quantized, gen, toks, tmp_path, family):
    model = quantized(family, 4)
    settings = BankSettings(ssd_dir=tmp_path, ssd_min_tokens=64)
    first = toks(5, 120)
    r1 = first_turn_on_ssd(model, gen, first, settings)
    follow = first + r1.token_ids + toks(6, 20)
    model.enable_session_bank(settings)  # a new process: empty RAM, the same disk
    try:
        warm = gen(model, follow)
    finally:
        model.bank.close()
        model.bank = None
    assert warm.stats.restored_from == "ssd" and warm.stats.cached_tokens >= len(first)
    assert warm.token_ids == cold(model, gen, follow).token_ids


def test_an_entry_stored_at_8_bits_is_not_restored_at_4(quantized, gen, toks, tmp_path):
    settings = BankSettings(ssd_dir=tmp_path, ssd_min_tokens=64)
    first = toks(7, 120)
    r1 = first_turn_on_ssd(quantized("qwen3", 8), gen, first, settings)
    four = quantized("qwen3", 4)
    four.enable_session_bank(settings)
    try:
        other = gen(four, first + r1.token_ids)
    finally:
        four.bank.close()
        four.bank = None
    assert other.stats.cached_tokens == 0
