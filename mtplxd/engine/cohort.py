"""MTP cohorts: the verify forwards of several rows run as one batched target forward.

A row that decodes in a cohort (generation.generate_steps with `cohort=True`) does not run
its own verify: at that point of its cycle it yields a VerifyCall (its (1, L) block of the
last committed token and its drafts, and its own trunk cache) and waits. After a scheduler
turn has stepped every row, the calls with the same block length L (MTP rows of one depth:
L = depth + 1; AR rows: L = 1, the AR batch lane) are grouped into cohorts of a fixed width
(by default 1, 3 or 8 rows; sealed at the narrowest width that holds them, more rows than
the widest make several cohorts), and each cohort runs one forward. Each row then gets its
own (hidden, logits) back and makes its own accept, commit and rollback decisions; its
cache, head cache, sampler and seed never leave it.

Fixed widths keep the set of verify shapes small (CUDA builds kernels per shape): a cohort
of 2 rows runs 3 wide with a padding row, whose output is discarded.

Numerics (`numerics` setting): "throughput" runs a cohort as one batched forward
(model/batched.py); "exact" runs each row's forward alone, so a row's numbers are its solo
numbers on any backend (the cohort still forms; the forward is not shared). "auto" is
throughput where batched matmuls compute each row alone (MLX's bundled CPU BLAS: bitwise
equal anyway) and on GPUs (a verify of K+1 rows already rounds apart from AR there, and
batching is the point), and exact on a CPU with an optimized BLAS (OpenBLAS): there rows
would round apart from solo, and that CPU is where exactness is checked, not served.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from mtplxd.engine.decoding.cohort_rows import VerifyCall
from mtplxd.engine.decoding.split import evaluated_at
from mtplxd.engine.model.batched import batched_forward, batched_supported

DEFAULT_WIDTHS = (1, 3, 8)
NUMERICS_CHOICES = ("auto", "exact", "throughput")
COHORT_MODES = ("auto", "always", "off")


def normalize_widths(widths: Any) -> tuple[int, ...]:
    """Cohort widths as the scheduler uses them: sorted, unique, 1 always included (a lone
    row needs a cohort). The config checked each is a whole number from 1 to 64."""
    return tuple(sorted({int(w) for w in widths} | {1}))


def resolve_numerics(setting: str) -> str:
    """"exact" or "throughput" for this backend (see the module docstring for "auto")."""
    if setting not in NUMERICS_CHOICES:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS_CHOICES)}, got {setting!r}")
    if setting != "auto":
        return setting
    if mx.default_device() != mx.cpu:
        return "throughput"
    from mtplxd import blas

    return "throughput" if blas.activate().kind == blas.BUNDLED else "exact"


def seal(count: int, widths: tuple[int, ...]) -> list[tuple[int, int]]:
    """Split `count` waiting rows into cohorts: [(rows, width)], each at the narrowest width
    that holds its rows; rows beyond the widest width fill further cohorts."""
    cohorts = []
    widest = widths[-1]
    while count > 0:
        rows = min(count, widest)
        cohorts.append((rows, next(w for w in widths if w >= rows)))
        count -= rows
    return cohorts


def group(calls: list[VerifyCall], widths: tuple[int, ...]) -> list[tuple[list[int], int]]:
    """Cohorts for one turn's calls: [(indices into calls, width)], rows of equal block length
    together, in the calls' order (admission order: FIFO within a length)."""
    by_length: dict[tuple[int, int], list[int]] = {}
    for index, call in enumerate(calls):
        by_length.setdefault((id(call.trunk), call.length), []).append(index)
    cohorts = []
    for indices in by_length.values():
        start = 0
        for rows, width in seal(len(indices), widths):
            cohorts.append((indices[start:start + rows], width))
            start += rows
    return cohorts


def run_cohort(calls: list[VerifyCall], width: int,
               numerics: str) -> list[tuple[mx.array | None, mx.array]]:
    """Verify every call's block (one trunk, one length) as one cohort of `width` rows; return
    each row's (hidden (1, L, H) or None, logits (1, L, V)), lazily evaluated, unless a row
    times this cycle: then the forward is evaluated here and each call's `seconds` holds its
    time (the drafts of rows not timed are evaluated with it and counted in it)."""
    timed = any(call.timed for call in calls)
    start = time.perf_counter()
    answers = _forward(calls, width, numerics)
    if timed:  # a row times this cycle (decoding/split.py): evaluate the forward now
        seconds = evaluated_at([logits for _, logits in answers]) - start
        for call in calls:
            call.seconds = seconds
    return answers


def _forward(calls: list[VerifyCall], width: int,
             numerics: str) -> list[tuple[mx.array | None, mx.array]]:
    trunk = calls[0].trunk
    if numerics == "exact" or not batched_supported(trunk):
        return [trunk.forward(call.tokens, call.cache, all_logits=True) for call in calls]
    padding = width - len(calls)
    tokens = mx.concatenate([call.tokens for call in calls]
                            + [mx.zeros_like(calls[0].tokens)] * padding, axis=0)
    hidden, logits = batched_forward(trunk, tokens, [call.cache for call in calls] + [None] * padding)
    return [(hidden[i:i + 1], logits[i:i + 1]) for i in range(len(calls))]
