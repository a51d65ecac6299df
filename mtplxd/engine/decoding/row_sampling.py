"""Sampling settings per row, as arrays inside one graph (a fused cohort's rows).

Why: rows of a fused cohort (fused_cohort.py) may each ask for their own temperature,
top-p, top-k, min-p and penalties, and one compiled graph serves them all. The settings
travel as a (W, columns) float32 table; which steps the graph contains (`Features`: greedy
rows, sampled rows, each filter, each penalty) is what any row uses, so the graph is traced
once per such set, not per value.

Exactness: a row must get the numbers its solo loop gets (sampling.py's functions with its
own scalars). So every step runs with the row's own value in float32, as the scalar would be
(mx converts a Python float to the array's float32), and a step the row does not use is
either an identity on it (a repetition penalty of 1.0 divides or multiplies by 1.0, a
frequency or presence penalty of 0 subtracts 0) or computed and then not selected for it
(`mx.where` on the row's flag): a top-p of 1.0 computed in float32 can drop tail tokens, so
it must not merely be "1.0".
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mtplxd.engine.decoding.sampling import _min_p, _top_p
from mtplxd.engine.interface import SamplingParams

# Columns of the settings table.
GREEDY, TEMPERATURE, TOP_P_ON, TOP_P, MIN_P_ON, MIN_P, TOP_K_ON, TOP_K, REPETITION, \
    FREQUENCY, PRESENCE = range(11)
COLUMNS = 11


@dataclass(frozen=True)
class Features:
    """The sampling steps some row of a cohort uses: the part of a graph's key that the
    settings decide."""

    greedy: bool = False
    sampled: bool = False
    top_p: bool = False
    min_p: bool = False
    top_k: bool = False
    repetition: bool = False
    frequency: bool = False
    presence: bool = False

    @property
    def penalties(self) -> bool:
        return self.repetition or self.frequency or self.presence


def features_of(settings: list[SamplingParams | None], vocab_size: int) -> Features:
    """What the rows' settings use (None: an empty slot, which runs as a greedy row)."""
    rows = [p if p is not None else SamplingParams() for p in settings]
    return Features(
        greedy=any(p.greedy for p in rows),
        sampled=any(not p.greedy for p in rows),
        top_p=any(not p.greedy and 0.0 < p.top_p < 1.0 for p in rows),
        min_p=any(not p.greedy and p.min_p > 0.0 for p in rows),
        top_k=any(not p.greedy and 0 < p.top_k < vocab_size for p in rows),
        repetition=any(p.repetition_penalty != 1.0 for p in rows),
        frequency=any(p.frequency_penalty != 0.0 for p in rows),
        presence=any(p.presence_penalty != 0.0 for p in rows))


def settings_table(settings: list[SamplingParams | None], vocab_size: int) -> mx.array:
    """(W, COLUMNS) float32: each row's settings, with the on-flags its solo loop tests."""
    table = []
    for p in (q if q is not None else SamplingParams() for q in settings):
        sampled = not p.greedy
        table.append([
            float(p.greedy), p.temperature,
            float(sampled and 0.0 < p.top_p < 1.0), p.top_p,
            float(sampled and p.min_p > 0.0), p.min_p,
            float(sampled and 0 < p.top_k < vocab_size), float(p.top_k),
            p.repetition_penalty, p.frequency_penalty, p.presence_penalty])
    return mx.array(table, mx.float32)


def column(table: mx.array, index: int, ndim: int) -> mx.array:
    """Column `index` shaped to broadcast over a (W, ..., V) array of `ndim` dimensions."""
    return table[:, index].reshape((-1,) + (1,) * (ndim - 1))


def flag(table: mx.array, index: int, ndim: int) -> mx.array:
    return column(table, index, ndim) > 0


def penalties(logits: mx.array, features: Features, table: mx.array, counts: mx.array,
              seen: mx.array) -> mx.array:
    """sampling.apply_penalties with each row's own penalties (float32 logits, (W, ..., V))."""
    logits = logits.astype(mx.float32)
    ndim = logits.ndim
    if features.repetition:
        rp = column(table, REPETITION, ndim)
        penalised = mx.where(logits > 0, logits / rp, logits * rp)
        logits = mx.where(seen > 0, penalised, logits)
    if features.frequency:
        logits = logits - column(table, FREQUENCY, ndim) * counts
    if features.presence:
        logits = logits - column(table, PRESENCE, ndim) * (counts > 0).astype(mx.float32)
    return logits


def scaled_logits(penalised: mx.array, features: Features, table: mx.array) -> mx.array:
    """sampling.scaled_logits with each row's own filters and temperature (sampled rows;
    a greedy row's result is not used)."""
    ndim = penalised.ndim
    logprobs = penalised - mx.logsumexp(penalised, axis=-1, keepdims=True)
    if features.top_p:
        logprobs = mx.where(flag(table, TOP_P_ON, ndim),
                            _top_p(logprobs, column(table, TOP_P, ndim)), logprobs)
    if features.min_p:
        logprobs = mx.where(flag(table, MIN_P_ON, ndim),
                            _min_p(logprobs, column(table, MIN_P, ndim)), logprobs)
    if features.top_k:
        logprobs = mx.where(flag(table, TOP_K_ON, ndim),
                            _top_k(logprobs, column(table, TOP_K, ndim)), logprobs)
    return logprobs / column(table, TEMPERATURE, ndim)


def draft_weights(penalised: mx.array, features: Features, table: mx.array) -> mx.array:
    """sampling.draft_weights with each row's own min-p and temperature."""
    ndim = penalised.ndim
    if features.min_p:
        penalised = mx.where(flag(table, MIN_P_ON, ndim),
                             _min_p(penalised, column(table, MIN_P, ndim)), penalised)
    return penalised / column(table, TEMPERATURE, ndim)


def _top_k(logprobs: mx.array, top_k: mx.array) -> mx.array:
    """sampling._top_k with a k per row (rows whose k is off are not selected)."""
    vocab_size = logprobs.shape[-1]
    at = mx.clip(vocab_size - top_k.astype(mx.int32), 0, vocab_size - 1)
    at = mx.broadcast_to(at, logprobs.shape[:-1] + (1,))
    kth = mx.take_along_axis(mx.sort(logprobs, axis=-1), at, axis=-1)
    # Ties at the k-th value are all kept, as sampling._top_k keeps them.
    return mx.where(logprobs >= kth, logprobs, float("-inf"))
