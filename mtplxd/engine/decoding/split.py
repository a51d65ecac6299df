"""How a speculative cycle's time divides between drafting and verifying, from sampled cycles.

Why sampled: no decode loop has a host sync between its draft and its verify. The stepwise
loop (speculative.py) builds drafts and verify as one lazy graph and starts cycle c+1 before
it reads cycle c; the fused loop (fused.py) is one compiled graph per cycle; a cohort row's
drafts are evaluated with the cohort's shared forward. The host's clock around the existing
`.tolist()`/`.item()` reads therefore measures whole (overlapped) cycles on every backend, the
CPU one included, and cannot tell the two phases apart. Splitting every cycle would need a
sync between them, which stops the pipelining the loops are built for. So the flight recorder
asks for a few cycles only (generation.DecodeSamples arms the decoder's CycleSplit: a
request's first cycle, then one per sample window of about a second, at most one in
SPLIT_EVERY_CYCLES), and the decoder runs each with a sync after the drafts and after the
verify, timing both; the other cycles run untouched. Its numbers are a cycle run alone,
labelled `split_source: "sampled"` in the samples.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

SPLIT_SOURCE = "sampled"


class CycleSplit:
    """A decoder's draft/verify timer: armed for one cycle at a time, summed per window."""

    def __init__(self) -> None:
        self.armed = False  # the next cycle to launch runs timed
        self.draft_seconds = 0.0
        self.verify_seconds = 0.0
        self.cycles = 0  # timed cycles since the last take()

    def arm(self) -> None:
        """Ask for the next cycle to be timed (the decoder disarms when it records it)."""
        self.armed = True

    def record(self, draft_seconds: float, verify_seconds: float) -> None:
        """Add one timed cycle and disarm."""
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        self.cycles += 1
        self.armed = False

    def take(self) -> dict[str, Any]:
        """The window's split as sample fields (per timed cycle means, in ms), then start a
        new window; {} when no cycle was timed in it (the keys are left out, not faked)."""
        if not self.cycles:
            return {}
        fields = {"draft_ms": round(1000 * self.draft_seconds / self.cycles, 3),
                  "verify_ms": round(1000 * self.verify_seconds / self.cycles, 3),
                  "split_cycles": self.cycles, "split_source": SPLIT_SOURCE}
        self.draft_seconds = self.verify_seconds = 0.0
        self.cycles = 0
        return fields


def evaluated_at(*arrays: Any) -> float:
    """Evaluate the arrays (lists of arrays too) and return the clock when they are done."""
    mx.eval(*arrays)
    return time.perf_counter()
