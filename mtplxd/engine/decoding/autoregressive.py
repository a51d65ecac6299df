"""Plain autoregressive decoding: one target forward per token, pipelined.

Like mlx-lm's generate_step, the graph for token t+1 is built and handed to the device
(`mx.async_eval`) before token t is read back, so the host never leaves the device idle.
The arithmetic is the same as an unpipelined loop; only the scheduling differs.

Per token the host builds the forward and one call of the compiled sampler chain
(`sampling.row_sampler`): the random key is derived on the device from the position, which
advances inside that graph, and the penalty history is only recorded when a penalty reads
it. A seeded sampled request therefore draws with other keys than `pick` would (equally
distributed, and reproducible).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import mlx.core as mx

from mtplxd.engine.decoding.sampling import TokenHistory, row_sampler, seed_words
from mtplxd.engine.interface import SamplingParams
from mtplxd.engine.model.trunk import Trunk


def ar_pick(params: SamplingParams, history: TokenHistory,
            seed: int) -> Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]:
    """pick(logits (1, V), position) -> (chosen, position + 1): the token at absolute
    `position` ((1,) uint32 on the device), recorded in `history` when penalties are on. The
    AR step and the AR batch lane (cohort_rows.py) pick with it alike."""
    sample = row_sampler(params)
    words = seed_words(seed)
    counts, seen = history.rows(None, 1)  # without penalties the sampler never reads them

    def pick_next(logits: mx.array, position: mx.array) -> tuple[mx.array, mx.array]:
        nonlocal counts, seen
        chosen, following = sample(logits, counts, seen, words, position)
        if params.has_penalties:
            history.append(chosen)  # lazily: the next step's penalties see this token
            counts, seen = history.rows(None, 1)
        return chosen, following

    return pick_next


def ar_step(trunk: Trunk, cache: list[Any], params: SamplingParams, history: TokenHistory,
            seed: int) -> Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]:
    """step(token, position) -> (chosen, position + 1): the lazy graph that feeds `token`
    (shape (1,)) and picks the token at absolute `position` ((1,) uint32 on the device),
    recorded in `history` when penalties are on."""
    pick_next = ar_pick(params, history, seed)

    def step(token: mx.array, position: mx.array) -> tuple[mx.array, mx.array]:
        _, logits = trunk.forward(token.reshape(1, 1), cache, all_logits=True)
        # A slice, not logits[0]: MLX turns an integer index into a gather, a copy of the
        # whole vocabulary row every token (generate_step slices too).
        return pick_next(logits[:, -1, :], position)

    return step


def ar_cycles(trunk: Trunk, cache: list[Any], params: SamplingParams, history: TokenHistory,
              seed: int, last_token: int, position: int) -> Iterator[list[int]]:
    """Yield one committed token per step, forever (the caller stops iterating).

    `last_token` is the committed token at absolute `position`, already in `history` but not
    yet fed to the trunk.
    """
    step = ar_step(trunk, cache, params, history, seed)
    pending, following = step(mx.array([last_token], mx.uint32), mx.array([position + 1], mx.uint32))
    mx.async_eval(pending)
    while True:
        current = pending
        pending, following = step(current, following)
        mx.async_eval(pending)
        yield [current.item()]
