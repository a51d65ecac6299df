"""A row's decode cycles when it runs in cohorts (engine/cohort.py).

The same cycles as speculative.py (MTP) and autoregressive.py (AR), except that the steps a
cohort shares are not run here: the row yields a call for each and is sent its own answer.
An MTP cycle yields
  DraftCall   -> sent its Drafted (the cohort's MTP heads run together: cohort.run_drafts);
  VerifyCall  -> sent its (hidden, logits) (one target forward for the cohort: run_cohort);
  SettleCall  -> sent None once its accept decisions are evaluated (one host sync for every
                 row of the turn, not one per row);
then the committed token list. An AR row (the AR batch lane) yields VerifyCall and
SettleCall. Everything else (the row's head cache, the accept rule, the rollback of its
caches, its sampler and seed) is the solo code, and stays the row's own.

The generators run forever (the caller stops iterating).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Generator

import mlx.core as mx

from mtplxd.engine.decoding.autoregressive import ar_pick
from mtplxd.engine.decoding.sampling import TokenHistory
from mtplxd.engine.decoding.speculative import Drafted, SpeculativeDecoder
from mtplxd.engine.decoding.split import evaluated_at
from mtplxd.engine.interface import SamplingParams
from mtplxd.engine.model.trunk import Trunk


def width_for(rows: int, widths: tuple[int, ...]) -> int:
    """The cohort width `rows` rows run at: the narrowest of `widths` (sorted) that holds
    them (phased cohorts: engine/cohort.seal; fused cohorts: fused_cohort.py)."""
    return next((w for w in widths if w >= rows), rows)


class CohortCall:
    """What a cohort row yields instead of running a step that its cohort shares."""


@dataclass
class DraftCall(CohortCall):
    """Draft this row's cycle: send back `decoder.prepare`'s Drafted (or the same, computed
    with other rows' heads batched)."""

    decoder: "CohortSpeculativeDecoder"
    n: int  # tokens in the trunk cache: the cycle's drafts sit at n+1..n+K
    token: int  # the last committed token, not yet fed
    pending_h: mx.array  # (1, P, H): hiddens of the PENDING pairs
    pending_tokens: list[int]  # their tokens


@dataclass
class VerifyCall(CohortCall):
    """Verify this row's block: send back (hidden, logits)."""

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


@dataclass
class SettleCall(CohortCall):
    """The row reads `arrays` next: evaluate them (with every other row's), then send None."""

    arrays: list[mx.array]


Answer = tuple[Any, mx.array]  # (hidden or None, logits (1, L, V))
CohortCycles = Generator["CohortCall | list[int]", Any, None]


class CohortSpeculativeDecoder(SpeculativeDecoder):
    """A SpeculativeDecoder whose drafting, verify forward and sync are the cohort's."""

    def cycles(self, prompt_hiddens: list[mx.array], prompt_ids: list[int],
               first_token: int, *, pending_from: int = 0) -> CohortCycles:
        """See SpeculativeDecoder.cycles; yields a DraftCall, a VerifyCall and a SettleCall
        before each committed list."""
        n, pending_h, pending_tokens = self._begin(prompt_hiddens, prompt_ids, first_token,
                                                   pending_from)
        token = first_token
        while True:
            timed, start = self.split.armed, time.perf_counter()
            drafted = yield DraftCall(self, n, token, pending_h, pending_tokens)
            drafted_at = evaluated_at(drafted.drafts, drafted.q_rows) if timed else 0.0
            call = VerifyCall(self.trunk, drafted.block, self.cache, timed=timed)
            hidden, logits = yield call
            answered = time.perf_counter()
            launched = self._decide(n, drafted, hidden, logits)
            yield SettleCall([launched.decisions, launched.drafts, launched.hidden])
            accepted, committed, hidden = self._settle(launched)
            if timed:  # the cohort's shared drafting and forward, then its shared settle
                self.split.record(drafted_at - start,
                                  (call.seconds or 0.0) + time.perf_counter() - answered)
            pending_h, pending_tokens = self._commit(accepted, committed, hidden)
            n += len(committed)
            token = committed[-1]
            yield committed

    def prepare(self, call: DraftCall) -> Drafted:
        """The call's drafts from this row's head alone (the solo code)."""
        return self._prepare(call.n, call.token, call.pending_h, call.pending_tokens)

    def first_draft_hidden(self, call: DraftCall) -> mx.array:
        """The head over the call's PENDING pairs, alone: the last g, (1, 1, H)."""
        return self._first_draft_hidden(call.pending_h, call.pending_tokens)


def cohort_ar_cycles(trunk: Trunk, cache: list[Any], params: SamplingParams, history: TokenHistory,
                     seed: int, last_token: int, position: int) -> CohortCycles:
    """autoregressive.ar_cycles for the AR batch lane: one (1, 1) VerifyCall per token, picked
    by the same sampler (so a seeded row draws what it draws alone).

    `last_token` is the committed token at absolute `position`, in `history`, not yet fed."""
    pick_next = ar_pick(params, history, seed)
    token, following = last_token, mx.array([position + 1], mx.uint32)
    while True:
        _, logits = yield VerifyCall(trunk, mx.array([[token]], mx.uint32), cache)
        chosen, following = pick_next(logits[:, -1, :], following)  # a slice: no gather
        yield SettleCall([chosen])
        token = chosen.item()
        yield [token]
