"""MTP cohorts: several rows' drafting, verify and host sync shared, one of each per cycle.

A row that decodes in a cohort (generation.generate_steps with `cohort=True`) does not run
the steps a cohort shares: it yields a call for each (decoding/cohort_rows.py) and waits.
After a scheduler turn has stepped every row:
  - draft: the MTP rows' DraftCalls are grouped into cohorts (whatever their depths) and
    each cohort's heads run as one batched forward per depth step (run_drafts);
  - verify: the MTP rows' VerifyCalls (blocks of depth + 1 tokens, whatever the depth:
    shorter blocks are right-padded to the longest and each row's cache advances by its own
    length only) run as one target forward per cohort (run_cohort); AR rows (L = 1) form the
    AR batch lane, their own cohorts;
  - settle: every row's accept decisions are evaluated in one mx.eval (settle_together),
    the turn's one host sync, and each row commits and rolls back on its own.
Cohorts have a fixed width (by default 1, 3 or 8 rows; sealed at the narrowest width that
holds them, more rows than the widest make several cohorts). Each row makes its own draft,
accept, commit and rollback decisions; its cache, head cache, sampler and seed never leave it.

Fixed widths keep the set of verify shapes small (CUDA builds kernels per shape): a cohort
of 2 rows runs 3 wide with a padding row, whose output is discarded.

Numerics (`numerics` setting): "throughput" runs a cohort's drafting and verify as batched
forwards (model/batched.py, decoding/cohort_drafts.py); "exact" runs each row's head and
trunk forwards alone, so a row's numbers are its solo numbers on any backend (the cohort
still forms and shares its sync; the forwards are not shared). "auto" is
throughput where batched matmuls compute each row alone (MLX's bundled CPU BLAS: bitwise
equal anyway) and on GPUs (a verify of K+1 rows already rounds apart from AR there, and
batching is the point), and exact on a CPU with an optimized BLAS (OpenBLAS): there rows
would round apart from solo, and that CPU is where exactness is checked, not served.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from mtplxd.engine.decoding.cohort_drafts import draft_together
from mtplxd.engine.decoding.cohort_rows import DraftCall, SettleCall, VerifyCall, width_for
from mtplxd.engine.decoding.speculative import Drafted
from mtplxd.engine.decoding.split import evaluated_at
from mtplxd.engine.model.batched import batched_forward, batched_supported, pad_to
from mtplxd.engine.model.trunk import PREFILL_CHUNK, PrefillChunk

DEFAULT_WIDTHS = (1, 3, 8)
NUMERICS_CHOICES = ("auto", "exact", "throughput")
COHORT_MODES = ("auto", "always", "off")
# How a cohort's rows draft and sync: "batched" (heads together, one sync per turn) or
# "per-row" (each row's head alone and a sync per row: the cohorts as first built, kept to
# measure against).
DRAFTING_CHOICES = ("batched", "per-row")
# How a dense model's MTP cohort runs its cycle: "fused" (one compiled graph per cohort cycle,
# read one cycle late: decoding/fused_cohort.py) or "phased" (draft, verify and settle as the
# phases above). Hybrid models, images and the "exact" numerics always run phased.
CYCLE_CHOICES = ("fused", "phased")


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
        cohorts.append((rows, width_for(rows, widths)))
        count -= rows
    return cohorts


def group(calls: list[VerifyCall] | list[DraftCall],
          widths: tuple[int, ...]) -> list[tuple[list[int], int]]:
    """Cohorts for one turn's calls: [(indices into calls, width)], in the calls' order
    (admission order: FIFO). The calls of one model's MTP rows go together whatever their
    depths; AR rows' verify calls (L = 1) make the AR batch lane."""
    by_length: dict[tuple[int, bool], list[int]] = {}
    for index, call in enumerate(calls):
        if isinstance(call, DraftCall):
            key = (id(call.decoder.trunk), True)
        else:
            key = (id(call.trunk), call.length > 1)
        by_length.setdefault(key, []).append(index)
    cohorts = []
    for indices in by_length.values():
        start = 0
        for rows, width in seal(len(indices), widths):
            cohorts.append((indices[start:start + rows], width))
            start += rows
    return cohorts


def run_cohort(calls: list[VerifyCall], width: int,
               numerics: str) -> list[tuple[mx.array | None, mx.array]]:
    """Verify every call's block (one trunk) as one cohort of `width` rows; return each row's
    (hidden (1, L, H) or None, logits (1, L, V)) for its own block length L, lazily
    evaluated, unless a row times this cycle: then the forward is evaluated here and each
    call's `seconds` holds its time (the drafts of rows not timed are evaluated with it and
    counted in it). Blocks shorter than the longest are right-padded; the padding's results
    are discarded and never enter a cache."""
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
    lengths = [call.length for call in calls]
    longest = max(lengths)
    rows = [pad_to(call.tokens, longest, axis=1) for call in calls]
    padding = width - len(calls)
    tokens = mx.concatenate(rows + [mx.zeros_like(rows[0])] * padding, axis=0)
    ragged = None if len(set(lengths)) == 1 else lengths + [longest] * padding
    hidden, logits = batched_forward(trunk, tokens, [call.cache for call in calls] + [None] * padding,
                                     ragged)
    return [(hidden[i:i + 1, :n], logits[i:i + 1, :n]) for i, n in enumerate(lengths)]


PrefillAnswer = tuple[mx.array | None, mx.array] | Exception
# Only chunks that end within this many tokens of their prompt's start share forwards: there a
# forward is bound by kernel launches and weight reads, which sharing saves (an agent's short
# request beside another's start). Later chunks of a long prompt are bound by attention over
# their context, which sharing does not save, and run alone as the memory guard sized them.
SHARED_PREFILL_SPAN = 4 * PREFILL_CHUNK


def run_prefills(calls: list[PrefillChunk], share: bool, max_tokens: int | None = None
                 ) -> tuple[list[PrefillAnswer], list[int]]:
    """Every call's prefill chunk, evaluated: each row's (hidden (1, n, H) or None, logits
    (1, 1, V)), as `PrefillChunk.run` gives it alone, or the exception that ended its forward
    (a shared forward's, for each of its rows); and the row count of each shared forward.
    With `share` (the caller's: "throughput" numerics) on a trunk that batches, the chunks
    of rows prefilling in one turn that end within SHARED_PREFILL_SPAN tokens run as batched
    forwards (right-padded to the longest; a forward holds at most `max_tokens` padded
    tokens, by default one solo chunk's worth: the turn's longest chunk or PREFILL_CHUNK, so
    batching never raises the prefill's peak memory), one host sync each; the rest (and
    everything without `share`, with images, or on a body that does not batch) run alone."""
    trunk = calls[0].trunk
    shareable = [i for i, call in enumerate(calls) if call.position + call.length <= SHARED_PREFILL_SPAN]
    if (not share or len(shareable) < 2 or not batched_supported(trunk)
            or any(call.embeddings is not None or call.trunk is not trunk for call in calls)):
        return [_alone(call) for call in calls], []
    answers: list[PrefillAnswer | None] = [None] * len(calls)
    batched: list[int] = []
    if max_tokens is None:
        max_tokens = max(PREFILL_CHUNK, *(call.length for call in calls))
    for batch in _packed(shareable, [call.length for call in calls], max_tokens):
        if len(batch) > 1:
            batched.append(len(batch))
            try:
                for i, answer in zip(batch, _prefill_together(trunk, [calls[i] for i in batch])):
                    answers[i] = answer
            except Exception as exc:  # which row's input broke it is unknown: its rows share it
                for i in batch:
                    answers[i] = exc
    return [_alone(call) if answer is None else answer for call, answer in zip(calls, answers)], batched


def _alone(call: PrefillChunk) -> PrefillAnswer:
    try:
        return call.run()
    except Exception as exc:
        return exc


def _packed(indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """`indices` in order, in batches whose rows, padded to the batch's longest of `lengths`,
    hold at most `max_tokens` tokens (one longer than that is a batch of its own)."""
    batches: list[list[int]] = []
    for i in indices:
        if batches:
            batch = batches[-1]
            if (len(batch) + 1) * max(lengths[i], *(lengths[j] for j in batch)) <= max_tokens:
                batch.append(i)
                continue
        batches.append([i])
    return batches


def _prefill_together(trunk: Any, calls: list[PrefillChunk]) -> list[tuple[mx.array, mx.array]]:
    lengths = [call.length for call in calls]
    longest = max(lengths)
    tokens = mx.concatenate([pad_to(call.tokens, longest, axis=1) for call in calls], axis=0)
    hidden, logits = batched_forward(trunk, tokens, [call.cache for call in calls],
                                     None if len(set(lengths)) == 1 else lengths, last_logits=True)
    answers = [(hidden[i:i + 1, :n], logits[i:i + 1]) for i, n in enumerate(lengths)]
    mx.eval([part for answer in answers for part in answer])
    return answers


def run_drafts(calls: list[DraftCall], width: int, numerics: str,
               drafting: str = "batched") -> list[Drafted]:
    """Every call's drafts (lazily), the cohort's heads batched unless `numerics` is exact,
    `drafting` per-row, or the model's body cannot batch (then each row's solo code)."""
    trunk = calls[0].decoder.trunk
    if numerics == "exact" or drafting == "per-row" or not batched_supported(trunk):
        return [call.decoder.prepare(call) for call in calls]
    return draft_together(calls, width)


def settle_together(calls: list[SettleCall], drafting: str = "batched") -> None:
    """Evaluate every row's decisions in one sync (per-row drafting: one sync per row)."""
    if drafting == "per-row":
        for call in calls:
            mx.eval(*call.arrays)
        return
    mx.eval(*[array for call in calls for array in call.arrays])
