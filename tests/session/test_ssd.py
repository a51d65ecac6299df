"""The SSD tier: survives a restart, never serves a corrupt blob, stays within its caps."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplxd.engine.session.bank import BankSettings
from mtplxd.engine.session.store import SessionStore, decode_safetensors, encode_safetensors, host_view
from mtplxd.engine.session.types import KV, BankEntry

from .conftest import cold


def settings(root, **kw) -> BankSettings:
    return BankSettings(ssd_dir=root, ssd_min_tokens=64, **kw)


def first_turn(model, gen, toks, root, seed=1):
    """Turn 1 with an SSD-backed bank, flushed and closed (the daemon stopped)."""
    bank = model.enable_session_bank(settings(root))
    prompt = toks(seed, 120)
    result = gen(model, prompt)
    assert bank.store.flush()
    bank.close()
    model.bank = None
    return prompt, result


def blobs(root):
    return sorted((root / "blobs").glob("*/*.safetensors"))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_conversation_survives_a_restart(loaded, gen, toks, tmp_path, family):
    model = loaded(family)
    prompt, r1 = first_turn(model, gen, toks, tmp_path)
    assert len(blobs(tmp_path)) == 1
    bank = model.enable_session_bank(settings(tmp_path))  # a new process: empty RAM
    try:
        assert bank.stats()["entries"] == 0 and bank.stats()["ssd_entries"] == 1
        follow = prompt + r1.token_ids + toks(2, 30)
        r2 = gen(model, follow)
        stats = bank.stats()
    finally:
        bank.close()
        model.bank = None
    assert r2.stats.cached_tokens >= len(prompt)
    assert stats["ssd_hits"] == 1
    assert r2.token_ids == cold(model, gen, follow).token_ids


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_or_truncated_blob_is_ignored(loaded, gen, toks, tmp_path, damage):
    model = loaded("qwen3")
    prompt, r1 = first_turn(model, gen, toks, tmp_path)
    [blob] = blobs(tmp_path)
    data = bytearray(blob.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        blob.write_bytes(bytes(data))
    elif damage == "truncate":
        blob.write_bytes(bytes(data[: len(data) - 100]))
    else:
        blob.unlink()
    bank = model.enable_session_bank(settings(tmp_path))
    try:
        follow = prompt + r1.token_ids + toks(2, 30)
        r2 = gen(model, follow)
        stats = bank.stats()
    finally:
        bank.close()
        model.bank = None
    assert r2.stats.cached_tokens == 0
    assert stats["ssd_corrupt_dropped"] == 1
    assert not blob.exists()
    assert r2.token_ids == cold(model, gen, follow).token_ids


def test_new_turn_supersedes_the_stored_prefix(loaded, gen, toks, tmp_path):
    model = loaded("qwen3")
    bank = model.enable_session_bank(settings(tmp_path))
    try:
        prompt = toks(3, 100)
        r1 = gen(model, prompt)
        gen(model, prompt + r1.token_ids + toks(4, 20))
        assert bank.store.flush()
        assert bank.stats()["ssd_entries"] == 1
        assert len(blobs(tmp_path)) == 1
    finally:
        bank.close()
        model.bank = None


def _entry(n: int, value: float) -> BankEntry:
    kv = [(mx.full((1, 2, n, 8), value), mx.full((1, 2, n, 8), -value))]
    e = BankEntry(tokens=tuple(range(int(value), int(value) + n)), kinds=(KV,), kv=kv, boundaries={})
    e.compute_nbytes()
    return e


def test_byte_cap_evicts_least_recently_used(tmp_path):
    one = _entry(100, 1.0)
    store = SessionStore(tmp_path, max_bytes=int(one.nbytes * 1.9))
    try:
        for value in (1000.0, 2000.0, 3000.0):
            store.put("id", _entry(100, value))
            assert store.flush()
        stats = store.stats()
        assert stats["entries"] == 1 and stats["bytes"] <= store.max_bytes
        row = store.best_match("id", list(range(3000, 3100)) + [7], False, 0)
        assert row is not None and row["tokens"][0] == 3000
    finally:
        store.close()


def test_blob_format_is_safetensors_readable_by_mlx(tmp_path):
    arrays = {"a": mx.arange(12, dtype=mx.float32).reshape(3, 4),
              "b": (mx.arange(6).reshape(2, 3) / 7).astype(mx.bfloat16),
              "c": mx.array([1, 2, 3], dtype=mx.int32)}
    data = encode_safetensors([host_view(k, v) for k, v in arrays.items()], {"format": "t"})
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    for loaded_arrays in (mx.load(str(path)), decode_safetensors(data)[0]):
        for k, v in arrays.items():
            assert loaded_arrays[k].dtype == v.dtype
            assert np.array_equal(np.array(loaded_arrays[k].astype(mx.float32)), np.array(v.astype(mx.float32)))
    with pytest.raises(ValueError):
        decode_safetensors(data[:20])


def _fill(root) -> int:
    """A store at `root` with three entries, closed; returns the manifest's size in bytes."""
    store = SessionStore(root, max_bytes=1 << 30)
    for value in (1000.0, 2000.0, 3000.0):
        store.put("id", _entry(100, value))
    assert store.flush()
    store.close()
    return (root / "manifest.sqlite").stat().st_size


@pytest.mark.parametrize("damage", ["header", "page", "garbage-file"])
def test_a_damaged_manifest_is_moved_aside_and_the_store_starts_empty(tmp_path, damage):
    root = tmp_path / "session-bank"
    size = _fill(root)
    manifest = root / "manifest.sqlite"
    with open(manifest, "r+b") as f:
        if damage == "header":
            f.write(b"\xff" * 100)
        elif damage == "page":  # every page after the first: the table and its index
            f.seek(4096)
            f.write(bytes(range(256)) * ((size - 4096) // 256))
        else:
            f.truncate(0)
            f.write(b"not a database at all" * 300)

    store = SessionStore(root, max_bytes=1 << 30)
    try:
        assert store.quarantined is not None
        aside = tmp_path / "session-bank.damaged"
        assert store.quarantined["path"] == str(aside) and (aside / "manifest.sqlite").exists()
        assert store.stats()["entries"] == 0 and store.stats()["quarantined"] == store.quarantined
        store.put("id", _entry(100, 4000.0))  # the new store works
        assert store.flush()
        assert store.best_match("id", list(range(4000, 4100)) + [1], False, 0) is not None
    finally:
        store.close()
    again = SessionStore(root, max_bytes=1 << 30)  # and is healthy next time
    try:
        assert again.quarantined is None and again.stats()["entries"] == 1
    finally:
        again.close()


def test_an_unusable_ssd_folder_leaves_the_bank_in_ram_with_the_reason(loaded, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the bank's folder should be")
    model = loaded("qwen3")
    bank = model.enable_session_bank(settings(blocker / "session-bank"))
    try:
        assert bank.store is None and bank.ssd_error
        stats = bank.stats()
        assert stats["ssd_enabled"] is False and "SSD tier is off" in stats["note"]
    finally:
        bank.close()
        model.bank = None
