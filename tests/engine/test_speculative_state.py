"""The speculative loop's committed state: trunk and head caches hold exactly the history."""

import mlx.core as mx
import pytest

from mtplxd.engine import SamplingParams
from mtplxd.engine.decoding.fused import FusedSpeculativeDecoder
from mtplxd.engine.decoding.sampling import TokenHistory
from mtplxd.engine.decoding.speculative import SpeculativeDecoder
from support.cycles import run_cycles


@pytest.mark.parametrize("decoder_class", [SpeculativeDecoder, FusedSpeculativeDecoder],
                         ids=["stepwise", "fused"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("depth", [1, 3])
def test_caches_match_a_fresh_run_over_the_committed_history(tiny_qwen3, depth, temperature,
                                                             decoder_class):
    model = tiny_qwen3
    trunk, head = model.trunk, model.head
    prompt = model.tokenizer.encode("def add(a, b):\n    ret")
    params = SamplingParams(temperature=temperature, top_k=5)
    for n_cycles in (1, 2, 8):
        decoder, cache, committed = run_cycles(model, prompt, params, depth, n_cycles,
                                               decoder_class)
        n = len(prompt) + len(committed) - 1  # the last committed token is not fed yet
        assert all(entry.offset == n for entry in cache)
        pending = decoder.pending_hidden.shape[1]
        assert decoder.head_cache[0].offset + pending == n

    # A fresh trunk forward over everything fed so far, and a fresh head over its pairs.
    sequence = prompt + committed
    fed = mx.array(sequence[:n])[None]
    fresh_cache = trunk.make_cache()
    hidden, _ = trunk.forward(fed, fresh_cache, all_logits=False)
    assert len(cache) == len(fresh_cache) and len(decoder.head_cache) == 1
    for layer, fresh_layer in zip(cache, fresh_cache):
        assert mx.allclose(layer.keys[..., :n, :], fresh_layer.keys[..., :n, :], atol=1e-5)
        assert mx.allclose(layer.values[..., :n, :], fresh_layer.values[..., :n, :], atol=1e-5)
    m = decoder.head_cache[0].offset
    fresh_head = head.make_cache()
    head(hidden[:, :m], trunk.embed(mx.array(sequence[1:m + 1])[None]), fresh_head)
    ours, fresh = decoder.head_cache[0], fresh_head[0]
    assert mx.allclose(ours.keys[..., :m, :], fresh.keys[..., :m, :], atol=1e-4)
    assert mx.allclose(ours.values[..., :m, :], fresh.values[..., :m, :], atol=1e-4)
    assert mx.allclose(decoder.pending_hidden, hidden[:, m:n], atol=1e-4)


def test_decoder_refuses_untrimmable_caches(tiny_qwen3):
    class Untrimmable:
        def is_trimmable(self):
            return False

        def trim(self, n):
            return 0

    with pytest.raises(ValueError, match="trimmable"):
        SpeculativeDecoder(tiny_qwen3.trunk, tiny_qwen3.head, [Untrimmable()], SamplingParams(),
                           TokenHistory(10, []), seed=0, depth=2)
