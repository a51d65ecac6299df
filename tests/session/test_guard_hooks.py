"""The memory guard frees idle bank entries through the bank's hooks before refusing."""

from __future__ import annotations

import json

from mtplxd.engine.session.bank import BankSettings
from mtplxd.guard import MemoryGuard, plan_for_config


def test_guard_releases_bank_entries_to_admit_a_request(loaded, gen, toks, tiny_checkpoint):
    model = loaded("qwen3")
    bank = model.enable_session_bank(BankSettings())
    try:
        for seed in range(3):
            gen(model, toks(seed, 120), session_id=f"s{seed}")
        held = bank.bytes_held()
        assert bank.stats()["entries"] == 3 and held > 0
        config = json.loads((tiny_checkpoint("qwen3") / "config.json").read_text())
        plan = plan_for_config(config, model.info.weights_bytes)
        needed = plan.request_bytes(100, 20, 512)
        # A limit where the request fits only once all but the newest entry are gone (the
        # entries' sizes differ by the tokens each turn's last cycle ended on).
        newest = max(bank.entries(), key=lambda e: e.last_used)
        limit = plan.weights_bytes + needed + newest.nbytes
        guard = MemoryGuard(plan, limit, bank_bytes=bank.bytes_held, release_bank=bank.release_idle)
        reservation = guard.admit(100, 20)
        reservation.release()
        assert guard.bank_releases == 1
        assert bank.bytes_held() == newest.nbytes < held
        assert [e.session_id for e in bank.entries()] == ["s2"]  # the most recently used survives
    finally:
        model.bank = None
