"""Runaway-loop detection on committed tokens: a span repeating past a threshold.

For every period p up to `max_period`, `runs[p]` counts how many of the latest tokens equal
the token p places before them; the last `runs[p] + p` tokens are then periodic with period
p. Updating all periods is one vectorised compare per token, so healthy output pays a few
microseconds. Two thresholds (docs/api.md, "Runaway-loop guard"):

- forming: `runs[p] >= hold_tokens` (a span of that many tokens is being written a second
  time). The caller holds text back from here; it is released the moment the pattern breaks.
- loop: the periodic tail covers `max(min_repeats * p, min_tokens)` tokens. The generation
  ends; what was held back (the repeats) is dropped.
"""

from __future__ import annotations

import numpy as np

from mtplxd.engine.interface import RepetitionPolicy


class RepetitionDetector:
    """Feed committed tokens one at a time; ask whether a loop is forming or complete."""

    def __init__(self, policy: RepetitionPolicy) -> None:
        self.policy = policy
        size = policy.max_period
        self._recent = np.full(size, -1, dtype=np.int64)  # _recent[i]: the token i+1 places back
        self._runs = np.zeros(size, dtype=np.int64)       # _runs[i]: the run for period i+1
        self._periods = np.arange(1, size + 1)
        # A loop of period p is complete when runs[p] >= need[p] (tail of max(k*p, min) tokens).
        self._need = np.maximum(policy.min_repeats * self._periods, policy.min_tokens) - self._periods

    def add(self, token: int) -> None:
        """Commit one token."""
        self._runs = np.where(self._recent == token, self._runs + 1, 0)
        self._recent = np.roll(self._recent, 1)
        self._recent[0] = token

    @property
    def forming(self) -> bool:
        """A span is being repeated (the caller should hold text back)."""
        return bool((self._runs >= self.policy.hold_tokens).any())

    def loop_period(self) -> int:
        """The period of a complete loop ending at the latest token, else 0."""
        hits = np.nonzero(self._runs >= self._need)[0]
        return int(hits[0]) + 1 if hits.size else 0
