"""Exact speculative decoding with the model's own MTP head (batch 1).

Cycle (reference engine.md 2.5; n = number of tokens in the trunk cache, x_n = the last
committed token, not yet fed):
  draft   the head runs over PENDING pairs (h_j, x_{j+1}) with true trunk hiddens, gives d_1;
          then K-1 chained steps feed (g, d_i) back and give d_2..d_K (q_i = their
          distributions when sampling: sampling.draft_weights, unfiltered by top-p/top-k).
  verify  one trunk forward over [x_n, d_1..d_K] (always K+1 rows: a fixed shape per depth).
  accept  temperature 0: d_i accepted while it equals the argmax of p_i; the first mismatch
          emits that argmax, a full accept emits the bonus argmax of row K+1.
          temperature > 0 (Leviathan/Chen): accept d_i with probability min(1, p_i/q_i) in
          float32; at the first rejection emit a draw from norm(max(0, p_i - q_i)); on a full
          accept emit a bonus draw from p_{K+1}. Penalties use each position's own history.
  commit  every trunk cache entry is rolled back with `trim(K - a)` (the cache protocol, so
          hybrid rollback caches work too); the head's cache drops its K-1 chained entries;
          PENDING becomes the a+1 verified rows with their true hiddens.

Shapes per cycle: the verify is always (1, K+1); chained draft steps are (1, 1); the head's
first step sees a+1 in 1..K+1 rows (K+1 shapes). Prefill chunks are PREFILL_CHUNK long, bar
the last. So a request at depth K compiles at most K+3 distinct shapes after prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import mlx.core as mx

from mtplxd.engine.decoding.sampling import (
    ACCEPT, DRAFT, RESIDUAL, TokenHistory, apply_penalties, draft_weights, one_hot, position_key,
    scaled_logits,
)
from mtplxd.engine.decoding.split import CycleSplit, evaluated_at
from mtplxd.engine.interface import SamplingParams
from mtplxd.engine.model import small_m_qmm
from mtplxd.engine.model.mtp_head import MTPHead
from mtplxd.engine.model.trunk import PREFILL_CHUNK, Trunk


@dataclass
class AcceptanceStats:
    """Drafted and accepted counts by draft position (index i = position i+1)."""

    depth: int
    drafted_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    cycles: int = 0
    committed: int = 0

    def __post_init__(self) -> None:
        self.drafted_by_depth = [0] * self.depth
        self.accepted_by_depth = [0] * self.depth

    def record(self, accepted: int, committed: int) -> None:
        """Count one cycle that accepted `accepted` drafts and committed `committed` tokens."""
        self.cycles += 1
        self.committed += committed
        for i in range(self.depth):
            self.drafted_by_depth[i] += 1
            if i < accepted:
                self.accepted_by_depth[i] += 1


def acceptance_probability(p_draft: mx.array, q_draft: mx.array) -> mx.array:
    """min(1, p/q) for each draft, float32 (q > 0 because the draft was drawn from q)."""
    p32, q32 = p_draft.astype(mx.float32), q_draft.astype(mx.float32)
    return mx.minimum(mx.array(1.0, mx.float32), p32 / q32)


def residual_distribution(p: mx.array, q: mx.array) -> mx.array:
    """norm(max(0, p - q)) per row; rows whose residual vanished fall back to p."""
    residual = mx.maximum(p - q, 0.0)
    total = mx.sum(residual, axis=-1, keepdims=True)
    return mx.where(total > 0, residual / mx.where(total > 0, total, 1.0), p)


def log_weights(probs: mx.array) -> mx.array:
    """log(probs), with -inf (never drawn) where a probability is 0."""
    return mx.where(probs > 0, mx.log(mx.maximum(probs, 1e-38)), float("-inf"))


def draw_rows(probs: mx.array, key: mx.array) -> mx.array:
    """One categorical draw per row of a (rows, V) probability matrix."""
    return mx.random.categorical(log_weights(probs), axis=-1, key=key)


def feed_pending_pairs(trunk: Trunk, head: MTPHead, head_cache: list[Any],
                       prompt_hiddens: list[mx.array], prompt_ids: list[int], first_token: int,
                       pending_from: int = 0) -> mx.array:
    """Feed the head every PENDING pair after a prefill but the last, in prefill-sized chunks;
    return the hidden of that last pair, (1, 1, H).

    The head's KV rows depend only on their own pair, so feeding them here gives the same
    cache a speculative cycle builds. The fused loop starts this way, and a turn that ended on
    its first token (no cycle ran) uses it so that its session-bank entry holds the head's KV.
    """
    pending_h = mx.concatenate(prompt_hiddens, axis=1)
    pending_tokens = prompt_ids[pending_from + 1:] + [first_token]
    for start in range(0, len(pending_tokens) - 1, PREFILL_CHUNK):
        stop = min(start + PREFILL_CHUNK, len(pending_tokens) - 1)
        tokens = mx.array(pending_tokens[start:stop])[None]
        head(pending_h[:, start:stop], trunk.embed(tokens), head_cache)
    return pending_h[:, -1:]


class SpeculativeDecoder:
    """The state of one request's speculative decode: trunk and head caches plus PENDING."""

    def __init__(self, trunk: Trunk, head: MTPHead, cache: list[Any], params: SamplingParams,
                 history: TokenHistory, seed: int, depth: int,
                 head_cache: list[Any] | None = None) -> None:
        self.trunk, self.head, self.cache = trunk, head, cache
        self.params, self.history, self.seed, self.depth = params, history, seed, depth
        # A session-bank restore hands in the head's cache over the restored pairs.
        self.head_cache = head_cache if head_cache is not None else trunk.make_head_cache(head)
        self.pending_hidden: mx.array | None = None  # hiddens of the PENDING pairs (session bank)
        self.stats = AcceptanceStats(depth)
        self.split = CycleSplit()  # armed by the flight recorder's samples (split.py)
        for entry in cache:
            if not (hasattr(entry, "trim") and entry.is_trimmable()):
                raise ValueError(f"speculative decoding needs trimmable caches, got {type(entry).__name__}")

    @small_m_qmm.routed_as_cycles
    def cycles(self, prompt_hiddens: list[mx.array], prompt_ids: list[int],
               first_token: int, *, pending_from: int = 0) -> Iterator[list[int]]:
        """Yield the tokens committed by each cycle, forever (the caller stops iterating).

        `prompt_hiddens` are the trunk's post-norm hiddens over the prompt (prefill chunks)
        from position `pending_from` on, and `first_token` the token sampled from the last
        prompt row (already committed). `pending_from` > 0 when the head's cache already
        holds the pairs before it (a session-bank restore).

        Each cycle runs as an MTP cycle (small_m_qmm.routed_as_cycles: a dense model's
        quantized layers route row-invariantly there).
        """
        n, pending_h, pending_tokens = self._begin(prompt_hiddens, prompt_ids, first_token,
                                                   pending_from)
        token = first_token
        # Cycle c+1 is built and handed to the device before cycle c's tokens go out, so the
        # caller's work (detokenizing, streaming) overlaps the device's.
        launched: _Launched | None = self._launch(n, token, pending_h, pending_tokens)
        try:
            while True:
                accepted, committed, hidden = self._settle(launched)
                launched = None
                pending_h, pending_tokens = self._commit(accepted, committed, hidden)
                n += len(committed)
                token = committed[-1]
                launched = self._launch(n, token, pending_h, pending_tokens)
                yield committed
        finally:
            if launched is not None:  # the caller stopped: undo the cycle nobody will read
                self._retract(launched)

    def _begin(self, prompt_hiddens: list[mx.array], prompt_ids: list[int], first_token: int,
               pending_from: int) -> tuple[int, mx.array, list[int]]:
        """The state before the first cycle: (n, PENDING hiddens, PENDING tokens)."""
        pending_h = mx.concatenate(prompt_hiddens, axis=1)
        self.pending_hidden = pending_h
        return len(prompt_ids), pending_h, prompt_ids[pending_from + 1:] + [first_token]

    def _commit(self, accepted: int, committed: list[int],
                hidden: mx.array) -> tuple[mx.array, list[int]]:
        """Count a settled cycle and make its verified rows PENDING; return (hiddens, tokens)."""
        self.stats.record(accepted, len(committed))
        self.history.append(committed)
        self.pending_hidden = hidden
        return hidden, committed

    def _first_draft_hidden(self, pending_h: mx.array, pending_tokens: list[int]) -> mx.array:
        """Run the head over PENDING (in prefill-sized chunks); return the last g (1,1,H)."""
        g = None
        for start in range(0, len(pending_tokens), PREFILL_CHUNK):
            tokens = mx.array(pending_tokens[start:start + PREFILL_CHUNK])[None]
            g = self.head(pending_h[:, start:start + PREFILL_CHUNK], self.trunk.embed(tokens), self.head_cache)
        return g[:, -1:, :]

    def _draft(self, n: int, pending_h: mx.array, pending_tokens: list[int]):
        """K chained drafts (lazy arrays) and, when sampling, their distributions q."""
        g = self._first_draft_hidden(pending_h, pending_tokens)
        picker = self.draft_picker(n)
        drafts: list[mx.array] = []
        for i in range(1, self.depth + 1):
            d = picker.pick(self.trunk.draft_logits(g)[0], i)
            drafts.append(d[0])
            if i < self.depth:
                g = self.head(g, self.trunk.embed(d[None]), self.head_cache)
        return mx.stack(drafts), picker.q_rows

    def draft_picker(self, n: int) -> "DraftPicker":
        """This row's draft sampler for the cycle starting after position n (cohorts draft
        many rows' heads together, each row picking with its own)."""
        return DraftPicker(self.params, self.seed, n, self.history)

    def _cycle(self, n: int, token: int, pending_h: mx.array,
               pending_tokens: list[int]) -> tuple[int, list[int], mx.array]:
        """One whole cycle: launch and settle (accepted, committed tokens, their hiddens)."""
        return self._settle(self._launch(n, token, pending_h, pending_tokens))

    def _launch(self, n: int, token: int, pending_h: mx.array,
                pending_tokens: list[int]) -> "_Launched":
        """Build drafts, verify and the accept decisions lazily; start them on the device."""
        if self.split.armed:
            return self._launch_timed(n, token, pending_h, pending_tokens)
        drafted = self._prepare(n, token, pending_h, pending_tokens)
        hidden, logits = self.trunk.forward(drafted.block, self.cache, all_logits=True)
        return self._decide(n, drafted, hidden, logits)

    def _launch_timed(self, n: int, token: int, pending_h: mx.array,
                      pending_tokens: list[int]) -> "_Launched":
        """`_launch` with a sync after the drafts and after the verify, each phase timed from
        the start of building its graph (split.py says why only sampled cycles run so). The
        previous cycle was settled, so the device starts idle."""
        start = time.perf_counter()
        drafted = self._prepare(n, token, pending_h, pending_tokens)
        drafted_at = evaluated_at(drafted.drafts, drafted.q_rows)
        hidden, logits = self.trunk.forward(drafted.block, self.cache, all_logits=True)
        launched = self._decide(n, drafted, hidden, logits)
        verified_at = evaluated_at(launched.decisions, launched.hidden)
        self.split.record(drafted_at - start, verified_at - drafted_at)
        return launched

    def _prepare(self, n: int, token: int, pending_h: mx.array,
                 pending_tokens: list[int]) -> "Drafted":
        """Feed PENDING to the head and draft K tokens: the (1, K+1) verify block, lazily.
        Cohorts (decoding/cohort_rows.py) verify many rows' blocks in one forward."""
        head_start = self.head_cache[0].offset
        drafts, q_rows = self._draft(n, pending_h, pending_tokens)
        block = mx.concatenate([mx.array([token], dtype=drafts.dtype), drafts])[None]
        return Drafted(head_start, head_start + len(pending_tokens), drafts, q_rows, block)

    def _decide(self, n: int, drafted: "Drafted", hidden: mx.array,
                logits: mx.array) -> "_Launched":
        """The accept decisions from the verify's (1, K+1) logits; start them on the device."""
        params, K = self.params, self.depth
        drafts, q_rows = drafted.drafts, drafted.q_rows
        counts, seen = self.history.rows(drafts, K + 1)
        penalised = apply_penalties(logits[0], params, counts, seen)
        if params.greedy:
            decisions = mx.argmax(penalised, axis=-1)  # the target token at every row
        else:
            decisions = self._sampled_decisions(n, penalised, drafts, q_rows)
        mx.async_eval(decisions, drafts, hidden)
        return _Launched(drafted.head_start, drafted.head_committed, drafts, decisions, hidden)

    def _settle(self, launched: "_Launched") -> tuple[int, list[int], mx.array]:
        """Read the decisions (the cycle's one host sync), commit, roll the rest back."""
        K = self.depth
        draft_list = launched.drafts.tolist()
        if self.params.greedy:
            targets = launched.decisions.tolist()
            accepted = 0
            while accepted < K and draft_list[accepted] == targets[accepted]:
                accepted += 1
            correction = targets[accepted]
        else:
            accept_list, corrections = launched.decisions.tolist()
            accepted = 0
            while accepted < K and accept_list[accepted]:
                accepted += 1
            correction = corrections[accepted]
        for entry in self.cache:
            entry.trim(K - accepted)
        for entry in self.head_cache:
            entry.trim(entry.offset - launched.head_committed)
        committed = draft_list[:accepted] + [correction]
        return accepted, committed, launched.hidden[:, :accepted + 1]

    def _retract(self, launched: "_Launched") -> None:
        """Undo a launched, unsettled cycle: the caches return to the committed state."""
        for entry in self.cache:
            entry.trim(self.depth + 1)
        for entry in self.head_cache:
            entry.trim(entry.offset - launched.head_start)

    def _sampled_decisions(self, n: int, penalised: mx.array, drafts: mx.array,
                           q_rows: list[mx.array]) -> mx.array:
        """Leviathan/Chen: (2, K+1) int array, row 0 = accept flags of d_1..d_K (then a pad),
        row 1 = the token to emit at each possible first rejection, the bonus last."""
        K = self.depth
        p = mx.softmax(scaled_logits(penalised, self.params), axis=-1)  # (K+1, V) float32
        q = mx.stack(q_rows)  # (K, V)
        rows = mx.arange(K)
        ratio = acceptance_probability(p[rows, drafts], q[rows, drafts])
        # One key per cycle and purpose, derived from the cycle's absolute start position:
        # a given seed replays the same cycles, so the output is reproducible.
        uniforms = mx.random.uniform(shape=(K,), key=position_key(self.seed, n + 1, ACCEPT))
        accept = (uniforms < ratio).astype(mx.uint32)
        # Row i < K: the residual at a rejection of d_{i+1}; row K: the bonus, drawn from p.
        fallback = mx.concatenate([residual_distribution(p[:K], q), p[K:]], axis=0)
        corrections = draw_rows(fallback, position_key(self.seed, n + 1, RESIDUAL)).astype(mx.uint32)
        return mx.stack([mx.concatenate([accept, mx.zeros((1,), mx.uint32)]), corrections])


class DraftPicker:
    """One row's draft decisions in one cycle: draft i from that step's head logits (1, V),
    under the row's own penalties (drafts so far counted) and seed; q_rows collects each
    sampled draft's distribution q for the accept rule."""

    def __init__(self, params: SamplingParams, seed: int, n: int, history: TokenHistory) -> None:
        self.params, self.seed, self.n = params, seed, n
        self.counts, self.seen = history.counts[None], history.seen[None]
        self.q_rows: list[mx.array] = []

    def pick(self, logits: mx.array, i: int) -> mx.array:
        """Draft i (1-based) as a (1,) array, lazily."""
        params = self.params
        penalised = apply_penalties(logits, params, self.counts, self.seen)
        if params.greedy:
            d = mx.argmax(penalised, axis=-1)
        else:
            weights = draft_weights(penalised, params)
            d = mx.random.categorical(weights, key=position_key(self.seed, self.n + i, DRAFT))
            self.q_rows.append(mx.softmax(weights, axis=-1)[0])
        if params.has_penalties:
            onehot = one_hot(d, self.counts.shape[-1])
            self.counts, self.seen = self.counts + onehot, self.seen + onehot
        return d


@dataclass
class Drafted:
    """A cycle's drafts, before its verify forward."""

    head_start: int  # head cache offset before the PENDING pass
    head_committed: int  # ... after it (the chained draft entries come on top)
    drafts: mx.array
    q_rows: list[mx.array]
    block: mx.array  # (1, K+1): the last committed token, then the drafts


@dataclass
class _Launched:
    """A cycle on its way through the device: what settling or retracting it needs."""

    head_start: int  # head cache offset before the PENDING pass
    head_committed: int  # ... after it (the chained draft entries come on top)
    drafts: mx.array
    decisions: mx.array
    hidden: mx.array
