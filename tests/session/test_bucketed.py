"""On CUDA the trunk uses bucketed KV caches (fixed verify shapes); the bank serves them too."""

from __future__ import annotations

from mtplxd.engine.model.kv_cache import BucketedKVCache
from mtplxd.engine.session.bank import BankSettings


def test_bank_restores_bucketed_caches_exactly(loaded, gen, toks):
    model = loaded("qwen3")
    model.trunk.fixed_shapes = True  # what Trunk chooses on CUDA
    try:
        assert any(isinstance(c, BucketedKVCache) for c in model.trunk.make_cache())
        first = toks(11, 120)
        model.enable_session_bank(BankSettings())
        try:
            warm1 = gen(model, first, depth=3)
            follow = first + warm1.token_ids + toks(12, 30)
            warm2 = gen(model, follow, depth=3)
        finally:
            model.bank = None
        cold2 = gen(model, follow, depth=3)
    finally:
        model.trunk.fixed_shapes = False
    assert warm2.stats.cached_tokens >= len(first)
    assert warm2.token_ids == cold2.token_ids
    assert warm2.stats.accepted_by_depth == cold2.stats.accepted_by_depth
