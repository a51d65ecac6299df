"""The bank's work after a turn stays off the next request's path.

After a turn's answer the model thread stores its state (a RAM entry) and queues the SSD
write; the next turn of an agent arrives right after the answer. Nothing of the SSD write
(host copies, serialising, hashing, fsync) may hold the model thread, and a resent turn
that a stored entry already covers must not copy the whole KV again. No timing here: the
SSD writer is blocked at the OS boundary (fsync) and the tests check what happened while it
was, and what was copied.
"""

from __future__ import annotations

import os
import threading

import mlx.core as mx
import numpy as np

from mtplxd.engine import GenerationRequest, GenerationResult, SamplingParams
from mtplxd.engine.scheduler import Row, Scheduler
from mtplxd.engine.session import bank as bank_module
from mtplxd.engine.session.bank import BankSettings, _copy_rows
from support.rows import Collector, run_until_idle

WRITER = "mtplx-session-ssd"  # the SSD writer thread's name


def _request(prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                             depth=3, prefill_chunk=32)


def test_the_next_request_is_admitted_and_served_while_the_ssd_write_is_blocked(
        loaded, toks, tmp_path, monkeypatch):
    model = loaded("qwen3")
    events: list[str] = []
    blocked, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if threading.current_thread().name == WRITER:
            events.append("ssd write blocked")
            blocked.set()
            release.wait(120)  # a liveness bound only: the test releases it itself
            events.append("ssd write released")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    bank = model.enable_session_bank(BankSettings(ssd_dir=tmp_path / "bank", ssd_min_tokens=16))
    first = toks(31, 90)
    scheduler = Scheduler(max_concurrent=1)
    try:
        # Turn 1: a one-token answer (as agents' probes are), then its state goes to the bank.
        one = Collector("turn1", [])
        scheduler.submit(Row(_request(first, 1), lambda stop: model.generate_steps(_request(first, 1), stop), one))
        run_until_idle(scheduler)
        assert isinstance(one.result, GenerationResult)
        assert blocked.wait(120), "the SSD writer never reached its fsync"
        # Turn 2 arrives while the blob is still being written: admitted, restored from RAM,
        # answered, all before the write is let go.
        follow = first + toks(32, 20)
        two = Collector("turn2", [])
        row = Row(_request(follow, 4), lambda stop: model.generate_steps(_request(follow, 4), stop), two)
        scheduler.submit(row)
        scheduler.turn()
        if row.admitted_at is not None:
            events.append("turn 2 admitted")
        run_until_idle(scheduler)
        events.append("turn 2 answered")
        assert bank.store.stats()["written"] == 0  # the write is still held at its fsync
    finally:
        release.set()
        assert bank.store.flush()
        model.bank = None
    # (turn 2's own entry is written after that: one writer, so it comes later in `events`)
    assert events[:4] == ["ssd write blocked", "turn 2 admitted", "turn 2 answered",
                          "ssd write released"]
    assert two.result.stats.cached_tokens == len(first)
    assert bank.store.stats()["written"] >= 1


def test_queued_ssd_writes_read_the_entry_arrays_without_copying_them(loaded, gen, toks, tmp_path,
                                                                      monkeypatch):
    """`put` runs on the model thread: it hands the writer views of the entry's own arrays,
    never host copies (for a long conversation, copying was most of a second there)."""
    model = loaded("qwen3")
    release = threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if threading.current_thread().name == WRITER:
            release.wait(120)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    bank = model.enable_session_bank(BankSettings(ssd_dir=tmp_path / "bank", ssd_min_tokens=16))
    queued = []
    real_put = bank.store._queue.put
    monkeypatch.setattr(bank.store._queue, "put", lambda item: (queued.append(item), real_put(item)))
    try:
        gen(model, toks(33, 70), depth=3, max_tokens=5)
        [entry] = bank.entries()
        [item] = queued
        arrays = {name: array for name, array in bank_module_tensors(entry)}
        for name, _, shape, data in item.tensors:
            assert isinstance(data, np.ndarray) and data.shape == tuple(shape)
            assert np.shares_memory(data, np.asarray(arrays[name])), name
    finally:
        release.set()
        assert bank.store.flush()
        model.bank = None
    # And the blob written from those views restores exactly after a restart (test_ssd.py
    # covers the whole round trip; here the bytes are checked against the entry).
    import mtplxd.engine.session.store as store_module

    [blob] = (tmp_path / "bank" / "blobs").glob("*/*.safetensors")
    decoded, _ = store_module.decode_safetensors(blob.read_bytes())
    for name, array in arrays.items():
        assert mx.array_equal(decoded[name], array).item(), name


def bank_module_tensors(entry):
    from mtplxd.engine.session.store import _tensor_names

    return _tensor_names(entry)


def test_a_resent_turn_that_an_entry_covers_copies_no_kv(loaded, gen, toks, monkeypatch):
    """The same request again (stop and resend, an agent's retry): the stored entry already
    covers what the turn would store, so nothing of the KV is copied, and the entry serves
    the next turn exactly as before."""
    model = loaded("qwen3")
    bank = model.enable_session_bank(BankSettings())
    prompt = toks(34, 80)
    copies = []
    real_copy = bank_module._copy_rows
    try:
        gen(model, prompt, depth=3, max_tokens=1)
        [entry] = bank.entries()
        monkeypatch.setattr(bank_module, "_copy_rows",
                            lambda x, axis, n: (copies.append(n), real_copy(x, axis, n))[1])
        again = gen(model, prompt, depth=3, max_tokens=1)
        assert again.stats.cached_tokens == len(prompt) - 1
        assert copies == [] and bank.entries() == [entry] and bank.stats()["stored"] == 1
        follow = prompt + toks(35, 12)
        warm = gen(model, follow, depth=3)
    finally:
        model.bank = None
    cold = gen(model, follow, depth=3)
    assert warm.stats.cached_tokens == len(prompt)
    assert warm.token_ids == cold.token_ids
    assert warm.stats.accepted_by_depth == cold.stats.accepted_by_depth


def test_copy_rows_is_exact_and_never_shares_the_source_buffer():
    for shape, axis, n in [((1, 2, 300, 8), 2, 257), ((1, 1, 300, 8), 2, 257),
                           ((1, 2, 300, 8), 2, 300), ((1, 70, 16), 1, 64)]:
        x = mx.random.normal(shape)
        mx.eval(x)
        y = _copy_rows(x, axis, n)
        mx.eval(y)
        index = (slice(None),) * axis + (slice(0, n),)
        assert y.shape == x[index].shape
        assert mx.array_equal(y, x[index]).item()
        assert not np.shares_memory(np.asarray(y), np.asarray(x)), (shape, n)
