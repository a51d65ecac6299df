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
