"""The fused cohort cycle: fused.py's device-resident cycle for several rows at once.

Why: a phased cohort cycle (engine/cohort.py) runs its drafting, verify and settle as
separate graphs with host turns between them, so on a launch-bound GPU a cohort of 3 rows
paid more launches and syncs than serial MTP's one compiled graph per cycle, and its
aggregate speed fell below serial MTP. Here a cohort's whole cycle is one compiled graph
over W rows (W a cohort width: 1, 3 or 8), read back one cycle late, as fused.py does for
one row:
  - state per row, all on the device and batched on a leading axis of W: KV buffers of
    (W, kv_heads, capacity, head_dim) for the trunk and the head, each row at its own offset
    (`RowsKVCache`: per-row writes, per-row causal masks and RoPE offsets), its PENDING rows,
    accepted count, penalty counts and seed;
  - the cycle is fused.py's, row-wise: the head's PENDING pass and K chained draft steps,
    one verify forward over (W, K+1), the accept rule and the next state, with each row's
    random numbers drawn from its own key (`device_position_keys` on its seed and position,
    as fused._cycle_noise), so a row's output does not depend on its neighbours;
  - rows join (their prefilled caches copied into a slot) and leave (slot freed) between
    cycles; a row that did not ask for a cycle this turn (a slow reader, an empty slot) is
    inactive: the cycle computes it but keeps its state, and its results are discarded.

All rows of one model and depth share fused cohorts, whatever their sampling settings: each
row's temperature, top-p, top-k, min-p and penalties are a row of a settings table inside
the graph (row_sampling.py), and the graph holds the steps any of its rows uses; greedy and
sampled rows mix, each taking its own rule's result.

Memory: one capacity for all rows and the padding to a cohort width hold more than each
row's own admission priced; a row joins a cohort only when the memory guard grants the
cohort's new padding (cohort_memory.py), else it starts a cohort of its own (width 1: no
padding), and decodes exactly as it would have beside the others.

Only dense qwen3 (whole trunk cache attention KV: fused.fused_supported); hybrid models and
the "exact" numerics profile keep the phased cohorts.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import mlx.core as mx

from mtplxd.engine.decoding import buffer_attention, row_sampling
from mtplxd.engine.decoding.cohort_memory import UNLIMITED, CohortMemory, slot_bytes
from mtplxd.engine.decoding.cohort_rows import CohortCall, width_for
from mtplxd.engine.decoding.fused import (
    FusedSpeculativeDecoder, RowsKVCache, compiled_graph, _CycleNoise, _CycleState,
    _state_of, buffers_of, grow_buffers, grown_capacity, reach_for,
)
from mtplxd.engine.decoding.row_sampling import Features, features_of, settings_table
from mtplxd.engine.decoding.sampling import CYCLE, device_position_keys, seed_words
from mtplxd.engine.decoding.split import evaluated_at
from mtplxd.engine.decoding.speculative import (
    acceptance_probability, log_weights, residual_distribution,
)
from mtplxd.engine.model.mtp_head import MTPHead
from mtplxd.engine.model.trunk import Trunk


def rows_caches(buffers: list[mx.array], offset: mx.array) -> list[RowsKVCache]:
    """One RowsKVCache per [keys, values] pair of `buffers`, all rows at `offset` (W,), held as a
    view of a 16-byte vector (buffer_attention.in_device_memory: on CUDA, out of MLX's managed
    pool), sharing one write index (built once per forward)."""
    offset = buffer_attention.in_device_memory(offset)
    shared: dict = {}
    return [RowsKVCache(buffers[i], buffers[i + 1], offset, shared)
            for i in range(0, len(buffers), 2)]


# --- the compiled cycle ----------------------------------------------------------------------


def cohort_cycle(trunk: Trunk, head: MTPHead, features: Features, K: int) -> Callable:
    """The function compiled for one cohort cycle at depth K: (seeds (W, 2) uint32, active
    (W,) bool, settings (W, columns) float32: row_sampling.settings_table, *state) ->
    (committed tokens (W, K+1), their counts (W,), *next state); the state is a _CycleState
    whose arrays carry a leading row axis. `features` are the sampling steps the rows use.
    Inactive rows keep their state (their results are discarded by the caller)."""

    def cycle(seeds: mx.array, active: mx.array, table: mx.array,
              *arrays: mx.array) -> tuple[mx.array, ...]:
        s = _state_of(arrays)
        rows = _Rows(features, table)
        noise = _rows_noise(seeds, s, K, s.counts.shape[-1]) if features.sampled else None
        head_cache, drafts, q_weights = _draft_rows(trunk, head, rows, K, s,
                                                    None if noise is None else noise.drafts)
        return _verify_rows(trunk, rows, K, s, active, noise, drafts, q_weights,
                            buffers_of(head_cache))

    return cycle


def cohort_cycle_halves(trunk: Trunk, head: MTPHead, features: Features,
                        K: int) -> tuple[Callable, Callable]:
    """The cohort cycle as two functions for a timed cycle (FusedCohort._launch_timed, as
    fused._cycle_halves for one row): draft (seeds, active, settings, *state) -> (drafts,
    [q-weights when any row samples,] *head KV), and verify (seeds, active, settings,
    *draft's outputs, *state) -> the cycle's outputs. Together they compute what
    `cohort_cycle` does (the verify half draws the same keyed noise again)."""
    drafted_count = (2 if features.sampled else 1) + 2  # drafts [, q-weights], head keys, values

    def noise_of(seeds: mx.array, s: _CycleState) -> _CycleNoise | None:
        return _rows_noise(seeds, s, K, s.counts.shape[-1]) if features.sampled else None

    def draft(seeds: mx.array, active: mx.array, table: mx.array,
              *arrays: mx.array) -> tuple[mx.array, ...]:
        s = _state_of(arrays)
        noise = noise_of(seeds, s)
        head_cache, drafts, q_weights = _draft_rows(trunk, head, _Rows(features, table), K, s,
                                                    None if noise is None else noise.drafts)
        return (drafts, *([] if q_weights is None else [q_weights]), *buffers_of(head_cache))

    def verify(seeds: mx.array, active: mx.array, table: mx.array,
               *arrays: mx.array) -> tuple[mx.array, ...]:
        drafted, s = arrays[:drafted_count], _state_of(arrays[drafted_count:])
        q_weights = drafted[1] if features.sampled else None
        return _verify_rows(trunk, _Rows(features, table), K, s, active, noise_of(seeds, s),
                            drafted[0], q_weights, list(drafted[-2:]))

    return draft, verify


@dataclass(eq=False)
class _Rows:
    """The rows' sampling inside a traced cycle: what steps exist, and each row's values."""

    features: Features
    table: mx.array

    def greedy(self, ndim: int) -> mx.array:
        """Each row's greedy flag, shaped for an array of `ndim` dimensions."""
        return row_sampling.flag(self.table, row_sampling.GREEDY, ndim)

    def penalties(self, logits: mx.array, counts: mx.array, seen: mx.array) -> mx.array:
        return row_sampling.penalties(logits, self.features, self.table, counts, seen)

    def pick(self, greedy: mx.array | None, sampled: mx.array | None) -> mx.array:
        """Greedy rows' choice where a row is greedy, the sampled choice elsewhere."""
        if sampled is None:
            return greedy
        if greedy is None:
            return sampled
        return mx.where(self.greedy(greedy.ndim), greedy, sampled)


def _rows_noise(seeds: mx.array, s: _CycleState, K: int, vocab_size: int) -> _CycleNoise:
    """fused._cycle_noise for every row, each from its own seed and position: a row's draw is
    the one its solo fused cycle makes at the same position."""
    keys = device_position_keys(seeds, s.n + 1, CYCLE)  # (W, 2): row w's (seed, position)
    # vmap draws every row's numbers in one kernel, each from its own key: bit for bit the
    # draw of that key alone (a loop over rows was W draws and W gathers).
    uniform = mx.vmap(lambda key: mx.random.uniform(shape=(2 * K + 2, vocab_size), key=key))(keys)
    gumbel = -mx.log(-mx.log(uniform[:, :2 * K + 1]))  # as mx.random.gumbel
    return _CycleNoise(gumbel[:, :K], gumbel[:, K:], uniform[:, 2 * K + 1, :K])


def _one_hot_rows(tokens: mx.array, vocab_size: int) -> mx.array:
    """(..., vocab_size) float32, 1 at each token id (sampling.one_hot over any leading shape)."""
    return (tokens[..., None] == mx.arange(vocab_size)).astype(mx.float32)


def _draft_rows(trunk: Trunk, head: MTPHead, rows: _Rows, K: int, s: _CycleState,
                draft_noise: mx.array | None
                ) -> tuple[list[RowsKVCache], mx.array, mx.array | None]:
    """fused._draft over W rows: (head cache, drafts (W, K), q log-weights (W, K, V) or None)."""
    W = s.n.shape[0]
    features = rows.features
    head_cache = rows_caches(s.head_kv, s.head_n)
    g = head(s.pending_h, trunk.embed(s.pending_tokens), head_cache)
    g = g[mx.arange(W), s.count - 1][:, None]  # each row's last real PENDING pair
    # the chained steps overwrite the invalid rows; each offset held as static_caches holds it
    head_cache[0].offset = buffer_attention.in_device_memory(s.head_n + s.count)
    drafts, q_weights = [], []
    counts, seen = s.counts, s.seen
    for i in range(K):
        logits = rows.penalties(trunk.draft_logits(g)[:, 0], counts, seen)
        greedy = mx.argmax(logits, axis=-1) if features.greedy else None
        sampled = None
        if features.sampled:  # Gumbel-max: argmax(w + Gumbel noise) is a draw from softmax(w)
            weights = row_sampling.draft_weights(logits, features, rows.table)
            sampled = mx.argmax(weights + draft_noise[:, i], axis=-1)
            q_weights.append(weights)
        d = rows.pick(greedy, sampled).astype(mx.uint32)
        drafts.append(d)
        if features.penalties:
            onehot = _one_hot_rows(d, counts.shape[-1])
            counts, seen = counts + onehot, seen + onehot
        if i + 1 < K:
            g = head(g, trunk.embed(d[:, None]), head_cache)
            head_cache[0].offset = buffer_attention.in_device_memory(head_cache[0].offset + 1)
    return (head_cache, mx.stack(drafts, axis=1),
            mx.stack(q_weights, axis=1) if q_weights else None)


def _verify_rows(trunk: Trunk, rows: _Rows, K: int, s: _CycleState, active: mx.array,
                 noise: _CycleNoise | None, drafts: mx.array, q_weights: mx.array | None,
                 head_kv: list[mx.array]) -> tuple[mx.array, ...]:
    """fused._verify over W rows: the verify forward, each row's accept rule, the next state."""
    caches = rows_caches(s.trunk_kv, s.n)
    hidden = trunk.text.model(mx.concatenate([s.token[:, None], drafts], axis=1), caches)
    accepted, targets = _accept_rows(trunk, rows, K, s, noise, hidden, drafts, q_weights)
    positions = mx.arange(K + 1)[None]
    correction = mx.take_along_axis(targets, accepted[:, None], axis=1)  # (W, 1)
    committed = mx.where(positions < accepted[:, None], mx.concatenate([drafts, correction], axis=1),
                         mx.where(positions == accepted[:, None], correction, mx.zeros_like(correction)))
    count = (accepted + 1).astype(mx.int32)
    counts, seen = s.counts, s.seen
    if rows.features.penalties:
        valid = (positions <= accepted[:, None])[..., None]
        gained = mx.sum(_one_hot_rows(committed, counts.shape[-1]) * valid, axis=1)
        counts = mx.where(active[:, None], counts + gained, counts)
        seen = mx.where(active[:, None], seen + gained, seen)
    nxt = _CycleState(
        n=mx.where(active, s.n + count, s.n),
        head_n=mx.where(active, s.head_n + s.count, s.head_n),
        token=mx.where(active, correction[:, 0], s.token),
        pending_h=mx.where(active[:, None, None], hidden, s.pending_h),
        pending_tokens=mx.where(active[:, None], committed, s.pending_tokens),
        count=mx.where(active, count, s.count), counts=counts, seen=seen,
        trunk_kv=buffers_of(caches), head_kv=head_kv)
    return (committed, count, *nxt.flat())


def _accept_rows(trunk: Trunk, rows: _Rows, K: int, s: _CycleState,
                 noise: _CycleNoise | None, hidden: mx.array, drafts: mx.array,
                 q_weights: mx.array | None) -> tuple[mx.array, mx.array]:
    """fused._accept over W rows, each by its own rule: (accepted drafts (W,), the token to
    emit at each possible first rejection, bonus last (W, K+1))."""
    features = rows.features
    logits = trunk.lm_head(hidden)
    counts, seen = s.counts[:, None], s.seen[:, None]
    if features.penalties:  # row i of a block also counts the drafts before it
        before = mx.concatenate([mx.zeros((drafts.shape[0], 1, counts.shape[-1])),
                                 mx.cumsum(_one_hot_rows(drafts[:, :K], counts.shape[-1]), axis=1)],
                                axis=1)
        counts, seen = counts + before, seen + before
    penalised = rows.penalties(logits, counts, seen)
    greedy_targets = greedy_accept = sampled_targets = sampled_accept = None
    if features.greedy:
        greedy_targets = mx.argmax(penalised, axis=-1).astype(mx.uint32)
        greedy_accept = drafts == greedy_targets[:, :K]
    if features.sampled:
        p = mx.softmax(row_sampling.scaled_logits(penalised, features, rows.table), axis=-1)
        q = mx.softmax(q_weights, axis=-1)
        index = drafts.astype(mx.int32)[..., None]
        p_drafts = mx.take_along_axis(p[:, :K], index, axis=-1)[..., 0]
        q_drafts = mx.take_along_axis(q, index, axis=-1)[..., 0]
        sampled_accept = noise.accept < acceptance_probability(p_drafts, q_drafts)
        fallback = mx.concatenate([residual_distribution(p[:, :K], q), p[:, K:]], axis=1)
        sampled_targets = mx.argmax(log_weights(fallback) + noise.fallback, axis=-1).astype(mx.uint32)
    accept = rows.pick(greedy_accept, sampled_accept)
    targets = rows.pick(greedy_targets, sampled_targets)
    return mx.sum(mx.cumprod(accept.astype(mx.int32), axis=1), axis=1), targets


# --- rows and cohorts --------------------------------------------------------------------------


@dataclass
class FusedCycleCall(CohortCall):
    """Run this row's next cycle in its fused cohort: send back the tokens the row committed
    since its last call (a list of token ids, possibly empty: reads run one cycle late)."""

    decoder: "FusedCohortRow"


class FusedCohortRow(FusedSpeculativeDecoder):
    """A row of a fused cohort: SpeculativeDecoder's contract (cycles(), stats, head_cache,
    pending_hidden), its cycles run by the scheduler's FusedCohorts. It owns its caches until
    it joins, its slot while a member, and gets its committed caches back when it leaves."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cohort: FusedCohort | None = None
        self.initial: _CycleState | None = None  # its state before it joins (one row)
        self.capacity = 0  # the initial state's buffer slots
        self.ceiling = 0  # prompt + max output: the length its admission was priced for
        self.known_n = 0  # trunk length after the last cycle read back
        self.outbox: list[int] = []  # committed tokens read, not yet handed to the row
        self.failure: BaseException | None = None  # what ended its cohort's graph, if it failed
        # Where the row's last read (committed) state lives: (state, its row) or (state, None)
        # for the one-row initial state.
        self.committed: tuple[_CycleState, int | None] | None = None

    @property
    def key(self) -> tuple:
        """Rows with the same key may share a fused cohort: one model, one depth (each row
        keeps its own sampling settings: row_sampling.py)."""
        return (id(self.trunk), self.depth)

    def cycles(self, prompt_hiddens: list[mx.array], prompt_ids: list[int],
               first_token: int, *, pending_from: int = 0) -> Iterator[Any]:
        """Yield a FusedCycleCall, then the committed tokens it was answered with, forever.
        On close the row leaves its cohort and holds its committed caches (fused.py's
        write-back)."""
        self.initial, self.capacity = self._initial_state(prompt_hiddens, prompt_ids,
                                                          first_token, pending_from)
        self.known_n = len(prompt_ids)
        self.ceiling = len(prompt_ids) + self.params.max_tokens
        self.committed = (self.initial, None)
        try:
            while True:
                tokens = yield FusedCycleCall(self)
                yield tokens
        finally:
            if self.cohort is not None:
                self.cohort.leave(self)
            elif self.initial is not None:  # never joined: its own buffers are the newest
                self._write_back(self.initial, self.initial)

    @property
    def reach(self) -> int:
        """The most buffer slots this row may need in a cohort (fused.reach_for)."""
        return max(reach_for(self.ceiling, self.depth), self.capacity)

    def record(self, tokens: list[int]) -> None:
        """One cycle of this row read back: count it and keep its tokens for the row."""
        self.known_n += len(tokens)
        self.stats.record(len(tokens) - 1, len(tokens))
        self.outbox += tokens

    def take(self) -> list[int]:
        tokens, self.outbox = self.outbox, []
        return tokens


@dataclass(eq=False)
class _InFlight:
    """A cohort cycle handed to the device: its outputs (lazy) and who they belong to."""

    tokens: mx.array  # (W, K+1) committed tokens, padded
    count: mx.array  # (W,)
    state: _CycleState  # the state it leaves for the next cycle
    members: list[FusedCohortRow | None]
    active: list[bool]


@dataclass(eq=False)  # cohorts are compared by identity (their arrays cannot be compared)
class FusedCohort:
    """The rows of one key (model, depth) that run as one fused cycle."""

    trunk: Trunk
    head: MTPHead
    depth: int
    members: list[FusedCohortRow | None] = field(default_factory=list)
    state: _CycleState | None = None  # the next cycle's input (lazy: the in-flight's output)
    seeds: mx.array | None = None
    settings: mx.array | None = None  # row_sampling.settings_table of the members
    capacity: int = 0
    in_flight: _InFlight | None = None
    key: tuple = ()  # FusedCohortRow.key of its rows
    cycle: Callable | None = None  # the compiled cycle at the current width
    features: Features | None = None  # the sampling steps the members' cycle holds
    memory: CohortMemory = UNLIMITED  # the memory guard's hold on its padding
    slot_bytes: int = 0  # one row's buffer slot (trunk + head KV), set by its first row
    hold_key: int = field(default_factory=lambda: next(_hold_keys))  # its hold's name

    @property
    def rows(self) -> int:
        return sum(member is not None for member in self.members)

    @property
    def width(self) -> int:
        return len(self.members)

    def turn(self, callers: list[FusedCohortRow], widths: tuple[int, ...]) -> int:
        """Let `callers` not yet in join, launch the next cycle (with the callers active),
        read the previous one into the rows' outboxes; return the cycle's width."""
        joiners = [row for row in callers if row.cohort is not self]
        width = width_for(self.rows + len(joiners), widths)
        capacity, relayout = self.capacity, bool(joiners) or width != self.width
        if relayout:
            self._relayout(width, joiners)
        self._ensure_capacity()
        if relayout or capacity != self.capacity:  # within what was granted at placement
            self.hold(self.live_members(), self.width, must=True)
        calling = {id(row) for row in callers}
        active = [member is not None and id(member) in calling for member in self.members]
        if self.in_flight is None:  # a fresh pipeline: two cycles out, so one can be read now
            self.in_flight = self._launch(active)
        timed = [row for row in callers if row.split.armed]  # the flight recorder's samples
        launched = self._launch_timed(active, timed) if timed else self._launch(active)
        self._read(self.in_flight)
        self.in_flight = launched
        return width

    def leave(self, row: FusedCohortRow) -> None:
        """Free the row's slot; hand it its committed caches (trunk, head, PENDING, history)."""
        slot = self.members.index(row)
        state, at = row.committed
        committed = state if at is None else _row_of(state, at)
        newest = _CycleState(*[None] * _CycleState.SMALL,
                             trunk_kv=[a[slot:slot + 1] for a in self.state.trunk_kv],
                             head_kv=[a[slot:slot + 1] for a in self.state.head_kv])
        row._write_back(committed, newest)
        # Evaluated now (one sync): the row's caches then hold arrays, not the cohort's graph.
        mx.eval(*[e.keys for e in row.cache + row.head_cache], row.pending_hidden)
        self.members[slot] = None
        row.cohort = None
        row.initial = None
        row.committed = None
        if not self.rows:  # nothing left to compute: let the buffers go
            self.state, self.in_flight, self.members = None, None, []
            self.memory.free(self.hold_key)
        else:  # its slot keeps its buffers until the next relayout, and nothing prices it now
            self.hold(self.live_members(), self.width, must=True)

    def live_members(self) -> list[FusedCohortRow]:
        return [m for m in self.members if m is not None]

    def hold(self, rows: list[FusedCohortRow], width: int, must: bool = False) -> bool:
        """Ask the memory guard to hold what `rows` at `width` may reach beyond their own
        reservations (their buffers can grow to the longest one's reach, never past it)."""
        if not self.slot_bytes:
            self.slot_bytes = slot_bytes(rows[0].initial.trunk_kv + rows[0].initial.head_kv)
        reach = max([self.capacity] + [row.reach for row in rows])
        return self.memory.hold(self.hold_key, width * reach * self.slot_bytes,
                                [row.ceiling for row in rows], must)

    def _relayout(self, width: int, joiners: list[FusedCohortRow]) -> None:
        """Rebuild the state at `width` rows: the members kept, then the joiners, then empty
        rows (all at one capacity)."""
        K = self.depth
        kept = [(slot, m) for slot, m in enumerate(self.members) if m is not None]
        self.capacity = max([self.capacity] + [row.capacity for row in joiners])
        rows: list[list[mx.array]] = [_flat_row(self.state, slot) for slot, _ in kept]
        rows += [_flat_initial(row.initial) for row in joiners]
        template = rows[0]
        rows += [_empty_row(template) for _ in range(width - len(rows))]
        small = _CycleState.SMALL
        grown = [row[:small] + grow_buffers(row[small:], self.capacity) for row in rows]
        arrays = [mx.concatenate([row[i] for row in grown], axis=0) for i in range(len(template))]
        if self.state is not None:  # its buffers are copied: let the next cycle own the new ones
            self.state.trunk_kv, self.state.head_kv = [], []
        self.state = _CycleState.unflat(arrays, (len(arrays) - small - 2) // 2)
        self.members = [m for _, m in kept] + joiners
        self.members += [None] * (width - len(self.members))
        for row in joiners:
            row.cohort = self
            row.initial.trunk_kv, row.initial.head_kv = [], []  # copied into the cohort
        self.seeds = mx.stack([seed_words(m.seed) if m is not None else mx.zeros((2,), mx.uint32)
                               for m in self.members])
        settings = [m.params if m is not None else None for m in self.members]
        vocab_size = self.state.counts.shape[-1]
        self.settings = settings_table(settings, vocab_size)
        features = self.features = features_of(settings, vocab_size)
        self.cycle = compiled_graph(self.trunk, ("mtp-cohort", width, K, features),
                               lambda: cohort_cycle(self.trunk, self.head, features, K))

    def _ensure_capacity(self) -> None:
        """Grow the buffers before a cycle could write past them: the cycle after next writes
        at most 2(K+1) slots past a row's last read length (fused.py's rule, per row). Like
        fused.py it grows a step ahead (fewer copies), but never past its rows' reach: the
        memory guard priced the cohort at that."""
        members = self.live_members()
        longest = max(m.known_n for m in members)
        if longest + 2 * (self.depth + 1) + 1 > self.capacity:
            self.capacity = grown_capacity(longest, self.depth, max(m.reach for m in members))
            self.state.trunk_kv = grow_buffers(self.state.trunk_kv, self.capacity)
            self.state.head_kv = grow_buffers(self.state.head_kv, self.capacity)

    def _launch(self, active: list[bool]) -> _InFlight:
        """Hand one cycle to the device; it takes the state's KV buffers (as fused._launch)."""
        state = self.state
        arrays = self.cycle(self.seeds, mx.array(active), self.settings, *state.flat())
        launched = self._launched(arrays, active)  # before the evaluation: buffers move on
        mx.async_eval(arrays[0], arrays[1])
        return launched

    def _launch_timed(self, active: list[bool], timed: list[FusedCohortRow]) -> _InFlight:
        """`_launch` as two compiled halves with a sync after each, the times recorded in the
        `timed` rows' splits (split.py says why only sampled cycles run so). Every row of the
        cohort waits for the whole cohort's drafts and verify, so that is each row's split.
        The cycle in flight is finished first, so the device starts idle."""
        K, features = self.depth, self.features
        halves = ("mtp-cohort-draft", "mtp-cohort-verify")
        draft, verify = (
            compiled_graph(self.trunk, (name, self.width, K, features),
                      lambda half=half: cohort_cycle_halves(self.trunk, self.head, features, K)[half])
            for half, name in enumerate(halves))
        state, flags = self.state, mx.array(active)
        evaluated_at(self.in_flight.tokens, self.in_flight.count, state.flat())
        drafted = draft(self.seeds, flags, self.settings, *state.flat())
        start = time.perf_counter()
        drafted_at = evaluated_at(drafted)
        arrays = verify(self.seeds, flags, self.settings, *drafted, *state.flat())
        launched = self._launched(arrays, active)  # before the evaluation: buffers move on
        verify_start = time.perf_counter()
        verified_at = evaluated_at(arrays)
        for row in timed:
            row.split.record(drafted_at - start, verified_at - verify_start)
        return launched

    def _launched(self, arrays: tuple[mx.array, ...], active: list[bool]) -> _InFlight:
        """The in-flight record of a cycle's outputs; its state becomes the cohort's next
        input, and the one it took gives up its KV buffers (the cycle may reuse them in
        place: no other reference holds them)."""
        state = self.state
        following = _CycleState.unflat(list(arrays[2:]), len(state.trunk_kv) // 2)
        state.trunk_kv, state.head_kv = [], []
        self.state = following
        return _InFlight(arrays[0], arrays[1], following, list(self.members), active)

    def _read(self, cycle: _InFlight) -> None:
        """The cycle's tokens to the rows that were active in it and are still members."""
        tokens, counts = cycle.tokens.tolist(), cycle.count.tolist()
        for slot, (row, active) in enumerate(zip(cycle.members, cycle.active)):
            if row is not None and active and row.cohort is self:
                row.record(tokens[slot][:counts[slot]])
                row.committed = (cycle.state, slot)


_hold_keys = itertools.count(1)


def _row_of(state: _CycleState, slot: int) -> _CycleState:
    """Row `slot` of a cohort state's small arrays, shaped as a one-row fused state."""
    return _CycleState(
        n=state.n[slot], head_n=state.head_n[slot], token=state.token[slot:slot + 1],
        pending_h=state.pending_h[slot:slot + 1], pending_tokens=state.pending_tokens[slot],
        count=state.count[slot], counts=state.counts[slot], seen=state.seen[slot],
        trunk_kv=[], head_kv=[])


def _flat_row(state: _CycleState, slot: int) -> list[mx.array]:
    """Row `slot` of a cohort state, every array keeping its leading row axis."""
    return [array[slot:slot + 1] for array in state.flat()]


def _flat_initial(state: _CycleState) -> list[mx.array]:
    """A one-row fused state (scalars, unbatched vectors) with a leading row axis."""
    return [state.n.reshape(1), state.head_n.reshape(1), state.token.reshape(1), state.pending_h,
            state.pending_tokens[None], state.count.reshape(1), state.counts[None],
            state.seen[None], *state.trunk_kv, *state.head_kv]


def _empty_row(template: list[mx.array]) -> list[mx.array]:
    """An empty slot: zeros, at position 0 with one PENDING pair (never NaN: its rows compute
    like any other, and are discarded)."""
    row = [mx.zeros_like(array) for array in template]
    row[5] = mx.ones_like(template[5])  # count
    return row


class FusedCohorts:
    """Every fused cohort of the scheduler: rows of one key (model, depth) share cohorts of at most the widest width; each turn runs one cycle per cohort."""

    def __init__(self, memory: CohortMemory = UNLIMITED) -> None:
        self.memory = memory  # the memory guard's holds on the cohorts' padding
        self.cohorts: list[FusedCohort] = []
        self.widths_run: list[int] = []  # the width of each cohort cycle of the last turn

    def turn(self, calls: list[FusedCycleCall], widths: tuple[int, ...]
             ) -> list[tuple[int, list[int]] | BaseException]:
        """Run one cycle of every cohort that has a caller; return each call's (cohort width,
        tokens committed since its last call), or the exception that ended its cohort's graph
        (that cohort is dropped and all its rows get it; other cohorts go on)."""
        self.cohorts = [c for c in self.cohorts if c.rows]
        placed: dict[int, list[FusedCohortRow]] = {}
        for call in calls:
            row = call.decoder
            if row.failure is None:
                cohort = row.cohort or self._place(row, widths, placed)
                placed.setdefault(id(cohort), []).append(row)
        widths_run: dict[int, int] = {}
        for cohort in list(self.cohorts):
            callers = placed.get(id(cohort))
            if not callers:
                continue
            try:
                widths_run[id(cohort)] = cohort.turn(callers, widths)
            except Exception as exc:  # noqa: BLE001 - the rows get it as their error
                self._drop(cohort, callers, exc)
        self.widths_run = list(widths_run.values())
        return [call.decoder.failure or (widths_run[id(call.decoder.cohort)], call.decoder.take())
                for call in calls]

    def _drop(self, cohort: FusedCohort, callers: list[FusedCohortRow], error: BaseException) -> None:
        """A cohort's graph failed: every row in it (callers, parked members, joiners) fails
        with `error`; its state is dropped, so the rows hand back no caches."""
        self.cohorts.remove(cohort)
        self.memory.free(cohort.hold_key)
        for row in {id(r): r for r in [*cohort.members, *callers] if r is not None}.values():
            row.failure, row.cohort, row.initial = error, None, None
        cohort.state, cohort.in_flight, cohort.members = None, None, []

    def _place(self, row: FusedCohortRow, widths: tuple[int, ...],
               placed: dict[int, list[FusedCohortRow]]) -> FusedCohort:
        """The first cohort of the row's key with room for one more whose new padding the
        memory guard grants, else a new one (a lone row's own: it runs whatever the answer)."""
        for cohort in self.cohorts:
            joining = [r for r in placed.get(id(cohort), []) if r.cohort is not cohort]
            rows = [*cohort.live_members(), *joining, row]
            if (cohort.key == row.key and len(rows) <= widths[-1]
                    and cohort.hold(rows, width_for(len(rows), widths))):
                return cohort
        cohort = FusedCohort(row.trunk, row.head, row.depth, key=row.key, memory=self.memory)
        cohort.hold([row], width_for(1, widths), must=True)
        self.cohorts.append(cohort)
        return cohort
