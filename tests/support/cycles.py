"""Run a speculative decoder by hand: the committed-state tests of both loops share it."""

from __future__ import annotations

from mtplxd.engine import SamplingParams
from mtplxd.engine.decoding.sampling import TokenHistory, pick
from mtplxd.engine.decoding.speculative import SpeculativeDecoder


def run_cycles(model, prompt, params, depth, n_cycles, decoder_class=SpeculativeDecoder):
    """Prefill, run n_cycles speculative cycles, stop; return (decoder, cache, committed)."""
    trunk, head = model.trunk, model.head
    cache = trunk.make_cache()
    history = TokenHistory(model.info.vocab_size, prompt)
    hiddens, logits = trunk.prefill(prompt, cache)
    first = pick(logits[None], SamplingParams(), None, None, None).item()
    history.append([first])
    decoder = decoder_class(trunk, head, cache, params, history, seed=3, depth=depth)
    committed = [first]
    cycles = decoder.cycles(hiddens, prompt, first)
    for _ in range(n_cycles):
        committed += next(cycles)
    cycles.close()  # the next cycle was already launched: closing must retract it
    return decoder, cache, committed


def assert_cache_holds(model, cache, tokens) -> None:
    """`cache` (a loop's handed-back trunk cache) holds `tokens` as a fresh forward over
    them leaves its caches: attention KV at their length, each Gated DeltaNet layer's conv
    and recurrent state after exactly them."""
    import mlx.core as mx

    from mtplxd.engine.model.rollback import RollbackArraysCache

    n = len(tokens)
    fresh = model.trunk.make_cache()
    model.trunk.forward(mx.array(tokens)[None], fresh, all_logits=False)
    assert [type(e).__name__ for e in cache] == [type(e).__name__ for e in fresh]
    for ours, want in zip(cache, fresh):
        if isinstance(want, RollbackArraysCache):
            assert mx.allclose(ours[0], want[0], atol=1e-5) and mx.allclose(ours[1], want[1], atol=1e-4)
        else:
            assert ours.offset == n
            assert mx.allclose(ours.keys[..., :n, :], want.keys[..., :n, :], atol=1e-5)
