"""Plain autoregressive decoding: one target forward per token."""

from __future__ import annotations

from typing import Any, Iterator

import mlx.core as mx

from mtplxd.engine.interface import SamplingParams
from mtplxd.engine.sampling import TARGET, TokenHistory, pick, position_key
from mtplxd.engine.trunk import Trunk


def ar_cycles(trunk: Trunk, cache: list[Any], params: SamplingParams, history: TokenHistory,
              seed: int, last_token: int, position: int) -> Iterator[list[int]]:
    """Yield one committed token per step, forever (the caller stops iterating).

    `last_token` is the committed token at absolute `position`, not yet fed to the trunk.
    """
    token = last_token
    while True:
        _, logits = trunk.forward(mx.array([[token]]), cache, all_logits=True)
        position += 1
        counts, seen = history.rows(None, 1)
        keys = None if params.greedy else [position_key(seed, position, TARGET)]
        token = pick(logits[0], params, counts, seen, keys).item()
        history.append([token])
        yield [token]
