"""Plain autoregressive decoding: one target forward per token, pipelined.

Like mlx-lm's generate_step, the graph for token t+1 is built and handed to the device
(`mx.async_eval`) before token t is read back, so the host never leaves the device idle.
The arithmetic is the same as an unpipelined loop; only the scheduling differs.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import mlx.core as mx

from mtplxd.engine.decoding.sampling import TARGET, TokenHistory, pick, position_key
from mtplxd.engine.interface import SamplingParams
from mtplxd.engine.model.trunk import Trunk


def ar_step(trunk: Trunk, cache: list[Any], params: SamplingParams, history: TokenHistory,
            seed: int) -> Callable[[mx.array, int], mx.array]:
    """step(token, position): the lazy graph that feeds `token` (shape (1,)) and picks the
    token at absolute `position`, recorded in `history`."""

    def step(token: mx.array, position: int) -> mx.array:
        _, logits = trunk.forward(token.reshape(1, 1), cache, all_logits=True)
        counts, seen = history.rows(None, 1)
        keys = None if params.greedy else [position_key(seed, position, TARGET)]
        chosen = pick(logits[0], params, counts, seen, keys)
        history.append(chosen)  # lazily: the next step's penalties see this token
        return chosen

    return step


def ar_cycles(trunk: Trunk, cache: list[Any], params: SamplingParams, history: TokenHistory,
              seed: int, last_token: int, position: int) -> Iterator[list[int]]:
    """Yield one committed token per step, forever (the caller stops iterating).

    `last_token` is the committed token at absolute `position`, already in `history` but not
    yet fed to the trunk.
    """
    step = ar_step(trunk, cache, params, history, seed)
    position += 1
    pending = step(mx.array([last_token]), position)
    mx.async_eval(pending)
    while True:
        current = pending
        position += 1
        pending = step(current, position)
        mx.async_eval(pending)
        yield [current.item()]
