"""What a fused cohort's KV buffers hold, and the callbacks that tell the memory guard.

Why: a fused cohort stores every row's KV buffers at one capacity (its longest row's) and
pads itself to a cohort width, so a short row beside a long one, and every empty row, holds
buffer slots that the row's own admission (priced by its own prompt + max output) never
paid for. The cohort asks for that difference before a row joins, and gives it back as rows
leave; the engine imports no guard: it gets plain callbacks (the daemon backs them with
MemoryGuard.hold_cohort / free_cohort).

A cohort is priced at the most its buffers may reach: width x the largest capacity any of its
rows may grow to (from each row's own ceiling, the length the guard priced it for), in the
bytes one buffer slot really takes (measured on the arrays: trunk and MTP head, keys and
values, in the model's compute dtype). So a cohort never needs a new grant while its rows
decode; only a join (a wider or longer cohort) asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx


# hold(cohort key, buffer bytes at the cohort's reach, its rows' ceilings, must) -> granted.
# Not granted: nothing changed (the row does not join). `must`: record it whatever the limit
# (the buffers exist, or will, either way).
HoldCallback = Callable[[Any, int, list[int], bool], bool]


@dataclass(frozen=True)
class CohortMemory:
    """The memory guard as fused cohorts see it."""

    hold: HoldCallback
    free: Callable[[Any], None]  # the cohort has no row left: its hold goes


UNLIMITED = CohortMemory(hold=lambda key, buffer_bytes, ceilings, must: True,
                         free=lambda key: None)


def slot_bytes(buffers: list[mx.array]) -> int:
    """Bytes one buffer slot of one row takes across `buffers` ((rows, heads, capacity, dim)
    each): from the arrays' own shapes and dtype (lazy arrays need no evaluation)."""
    return sum(a.nbytes // (a.shape[0] * a.shape[2]) for a in buffers)
