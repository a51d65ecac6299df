"""A row's decode cycles when its verify runs in a cohort (engine/cohort.py).

The same cycles as speculative.py (MTP) and autoregressive.py (AR), with one difference: the
target forward is not called here. Each cycle yields a VerifyCall and is sent back the
row's own (hidden, logits); everything else (drafting with the row's own head cache, the
accept rule, the rollback of its caches, its sampler and seed) is the solo code. Cycles are
not pipelined: the cohort's forward is one sync for all its rows.

Both generators yield VerifyCall, expect (hidden, logits) to be sent in, and then yield the
committed token list of the cycle; they run forever (the caller stops iterating).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Generator

import mlx.core as mx

from mtplxd.engine.decoding.autoregressive import ar_pick
from mtplxd.engine.decoding.sampling import TokenHistory
from mtplxd.engine.decoding.speculative import SpeculativeDecoder
from mtplxd.engine.decoding.split import evaluated_at
from mtplxd.engine.interface import SamplingParams
from mtplxd.engine.model.trunk import Trunk


@dataclass
class VerifyCall:
    """What a cohort row yields instead of running its verify: send it (hidden, logits)."""

    trunk: Trunk
    tokens: mx.array  # (1, L): the last committed token, then the drafts (AR: L = 1)
    cache: list[Any]  # the row's own trunk cache; the forward advances it by L
    # A timed cycle (split.py) asks the cohort to evaluate its forward at once and to put
    # its seconds here: the verify a cohort row waits for is the whole shared forward.
    timed: bool = False
    seconds: float | None = None

    @property
    def length(self) -> int:
        """The block's length L: depth + 1, or 1 in the AR lane."""
        return int(self.tokens.shape[1])


Answer = tuple[Any, mx.array]  # (hidden or None, logits (1, L, V))
CohortCycles = Generator["VerifyCall | list[int]", "Answer | None", None]


class CohortSpeculativeDecoder(SpeculativeDecoder):
    """A SpeculativeDecoder whose verify forward is answered by the cohort."""

    def cycles(self, prompt_hiddens: list[mx.array], prompt_ids: list[int],
               first_token: int, *, pending_from: int = 0) -> CohortCycles:
        """See SpeculativeDecoder.cycles; yields a VerifyCall before each committed list."""
        n, pending_h, pending_tokens = self._begin(prompt_hiddens, prompt_ids, first_token,
                                                   pending_from)
        token = first_token
        while True:
            timed, start = self.split.armed, time.perf_counter()
            drafted = self._prepare(n, token, pending_h, pending_tokens)
            drafted_at = evaluated_at(drafted.drafts, drafted.q_rows) if timed else 0.0
            call = VerifyCall(self.trunk, drafted.block, self.cache, timed=timed)
            hidden, logits = yield call
            answered = time.perf_counter()
            accepted, committed, hidden = self._settle(self._decide(n, drafted, hidden, logits))
            if timed:  # the shared forward, then this row's own accept decisions
                self.split.record(drafted_at - start,
                                  (call.seconds or 0.0) + time.perf_counter() - answered)
            pending_h, pending_tokens = self._commit(accepted, committed, hidden)
            n += len(committed)
            token = committed[-1]
            yield committed


def cohort_ar_cycles(trunk: Trunk, cache: list[Any], params: SamplingParams, history: TokenHistory,
                     seed: int, last_token: int, position: int) -> CohortCycles:
    """autoregressive.ar_cycles for the AR batch lane: one (1, 1) VerifyCall per token, picked
    by the same sampler (so a seeded row draws what it draws alone).

    `last_token` is the committed token at absolute `position`, in `history`, not yet fed."""
    pick_next = ar_pick(params, history, seed)
    token, following = last_token, mx.array([position + 1], mx.uint32)
    while True:
        _, logits = yield VerifyCall(trunk, mx.array([[token]], mx.uint32), cache)
        chosen, following = pick_next(logits[0], following)
        token = chosen.item()
        yield [token]
