"""The scheduler: every generation is a row that the owner thread steps one cycle at a time.

A request waits in a FIFO admission queue (at most `max_queued`; one more is refused with
QueueFull) until a row slot is free (at most `max_concurrent` rows) and the admission hook (the
memory guard, priced next to the running rows) lets it in. Each turn of the owner thread's loop
admits what it can, then steps every running row once, in admission order: one prefill chunk
or one decode cycle each. So a long prompt never holds the others back for more than one
chunk, and a short request's first token does not wait for a long one's last.

A row is the generator of `generation.generate_steps`: it owns its caches, rollback state,
sampler, seed and stats, so its output does not depend on what runs between its steps
(greedy output of a row is its solo output, bitwise on the CPU backend). A row that finishes,
is cancelled (its client left) or fails leaves at the end of the turn and gives back its
memory reservation; a failure ends only that row.

Rows made with `cohort=True` (LoadedModel.generate_steps) do not run the steps a cohort
shares: a decode cycle yields a DraftCall, a VerifyCall and a SettleCall in turn, and after
every row of the turn has been stepped the scheduler answers them a phase at a time (cohort.py:
the MTP rows' heads drafting together, then one target forward per cohort of fixed width, MTP
rows of one depth together and AR rows in the AR batch lane, then one host sync for all);
each row then commits its own cycle.

Rows of the fused cohort cycle (decoding/fused_cohort.py) share KV buffers padded to one
capacity and one width: the `cohort_memory` callbacks (the memory guard's, in the daemon)
hold that padding next to the rows' own reservations, and a row whose join would not fit
runs in a cohort of its own instead.

A row whose reader is slow (more than `max_backlog` delivered items not yet taken) is
paused: it is not stepped until its reader catches up, and the other rows go on.
No trio, no HTTP: the daemon reaches this through `ModelOwner.submit_row`.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from mtplxd.engine.cohort import (
    DEFAULT_WIDTHS, group, run_cohort, run_drafts, run_prefills, settle_together,
)
from mtplxd.engine.decoding.cohort_memory import UNLIMITED, CohortMemory
from mtplxd.engine.decoding.cohort_rows import CohortCall, DraftCall, SettleCall, VerifyCall
from mtplxd.engine.decoding.fused_cohort import FusedCohorts, FusedCycleCall
from mtplxd.engine.interface import GenerationRequest, GenerationResult, QueueFull, TokenDelta
from mtplxd.engine.model.trunk import PrefillChunk

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUED = 64
# Items a row may have delivered that its reader has not taken yet before it is paused.
DEFAULT_MAX_BACKLOG = 256
MAX_CONCURRENT_LIMIT = 64
# A row's service-time estimate before any row finished (seconds), for Retry-After.
INITIAL_SERVICE_SECONDS = 5.0

# Makes a row's step iterator given its should_stop(); LoadedModel.generate_steps fits.
StepsFactory = Callable[[Callable[[], bool]], Iterator[Any]]
# Prices a request next to the running rows: a release callable when it fits now, None when it
# must wait for running rows to leave; raises (InsufficientMemory) when it can never fit.
AdmitHook = Callable[[GenerationRequest], "Callable[[], None] | None"]


def default_max_concurrent() -> int:
    """Rows run at once by default: 8 where the backend compiles fixed shapes (CUDA: one full
    8-wide cohort), 4 elsewhere (Metal, CPU), where more rows stretch each one for less
    batching gain while holding their KV."""
    from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

    return 8 if fixed_shapes_wanted() else 4


@dataclass
class RowFailure:
    """What a failed row delivers instead of a result: the exception that ended it."""

    error: BaseException


_ids = itertools.count(1)


class Row:
    """One generation: waiting in the queue, then running until its result is delivered.

    `deliver` is called on the owner thread with each TokenDelta, then the GenerationResult
    (or a RowFailure); it must not block (the daemon hands items to trio without waiting).
    """

    def __init__(self, request: GenerationRequest, start: StepsFactory,
                 deliver: Callable[[Any], None], *, cohort_capable: bool = False) -> None:
        self.id = next(_ids)
        self.request = request
        self.deliver = deliver
        self._start = start
        # True when `start` takes `cohort=` (LoadedModel.generate_steps): the scheduler then
        # decides whether the row prefills and decodes in cohorts (cohort_mode, `_decides`).
        self.cohort_capable = cohort_capable
        self.in_cohorts = False
        self._cancelled = threading.Event()
        self.steps: Iterator[Any] | None = None
        self.phase = "queued"  # queued | prefill | decode | done
        self.release: Callable[[], None] | None = None
        self.admitted_at: float | None = None
        self.tokens = 0
        self.steps_taken = 0  # prefill chunks and decode cycles run so far
        self.rows_max = 0
        self.cohort_widths: dict[int, int] = {}  # cohort width -> decode cycles run in it
        self._backlog = 0  # delivered items its reader has not taken (see consumed)
        self._backlog_lock = threading.Lock()
        self.wake: Callable[[], None] = lambda: None  # the scheduler's: a paused row may go on
        self.paused = False  # over its backlog when last checked: `consumed` must wake the owner

    def delivered(self) -> None:
        """Count one item handed to `deliver` (owner thread)."""
        with self._backlog_lock:
            self._backlog += 1

    def consumed(self, items: int = 1) -> None:
        """The reader took `items` delivered items (any thread); wakes the owner when the
        row was paused for its backlog (only then: a wake per token would flood the owner's
        queue, and jobs wait behind it)."""
        with self._backlog_lock:
            self._backlog = max(self._backlog - items, 0)
            paused, self.paused = self.paused, False
        if paused:
            self.wake()

    @property
    def backlog(self) -> int:
        return self._backlog

    def over_backlog(self, bound: int) -> bool:
        """True when `bound` items wait unread; then marks the row paused, atomically with
        `consumed`, so the reader's next take is sure to wake the owner."""
        with self._backlog_lock:
            if self._backlog >= bound:
                self.paused = True
                return True
            return False

    def cancel(self) -> None:
        """Ask the row to end (thread-safe): it leaves with finish_reason "cancelled" at the
        next cycle boundary, or straight from the queue."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def snapshot(self, now: float) -> dict[str, Any]:
        """The row as status and the flight board show it."""
        arrived = self.request.arrived_at or now
        admitted = self.admitted_at
        return {
            "row": self.id,
            "request_id": self.request.request_id,
            "phase": self.phase,
            "prompt_tokens": len(self.request.prompt_ids),
            "completion_tokens": self.tokens,
            "steps": self.steps_taken,
            "depth": self.request.depth,
            "cohort_width": max(self.cohort_widths, key=self.cohort_widths.get, default=None),
            "backlog": self._backlog,
            "queue_wait_seconds": round((admitted if admitted is not None else now) - arrived, 3),
            "age_seconds": round(now - arrived, 3),
        }


class Scheduler:
    """FIFO admission and round-robin stepping of rows; `turn` runs on the owner thread only."""

    def __init__(self, max_concurrent: int = 1, max_queued: int = DEFAULT_MAX_QUEUED,
                 admit: AdmitHook | None = None, widths: tuple[int, ...] = DEFAULT_WIDTHS,
                 numerics: str = "exact", max_backlog: int | None = None,
                 cohort_mode: str = "auto", cohort_drafting: str = "batched",
                 cohort_cycle: str = "fused", cohort_memory: CohortMemory = UNLIMITED) -> None:
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.admit = admit
        self.widths = widths  # cohort widths (sorted, 1 included): cohort.parse_widths
        self.numerics = numerics  # "exact" | "throughput": cohort.resolve_numerics
        # None: never pause (the caller's deliver takes everything); the daemon bounds it and
        # its readers call Row.consumed.
        self.max_backlog = max_backlog
        self.cohort_mode = cohort_mode  # auto | always | off: see _wants_cohort
        self.cohort_drafting = cohort_drafting  # batched | per-row: cohort.DRAFTING_CHOICES
        self.cohort_cycle = cohort_cycle  # fused | phased: cohort.CYCLE_CHOICES
        # The fused cohorts' slots and in-flight cycles; their padding held by cohort_memory.
        self.fused = FusedCohorts(cohort_memory)
        # Rows prefilling in one turn share their forwards (cohort.run_prefills); off only to
        # measure what that gains (bench.concurrency's mtp_cohorts_solo_prefill arm).
        self.batch_prefills = True
        # A row decoding alone moves into cohorts that form beside it (`_joins`); off only to
        # measure what that gains (bench.concurrency's late long request).
        self.move_solo_rows = True
        self.cohort_histogram: dict[int, int] = {w: 0 for w in widths}  # width -> cohorts run
        self.wake: Callable[[], None] = lambda: None  # set by the owner: a submission wakes it
        self._lock = threading.Lock()
        self._queue: deque[Row] = deque()
        self._running: list[Row] = []
        self._service_seconds = INITIAL_SERVICE_SECONDS
        # prefill_batches: batched prefill forwards (rows prefilling in one turn, run together:
        # cohort.run_prefills); prefill_batched_chunks: the row chunks they carried.
        # moved_into_cohorts: rows that started decoding alone and joined cohorts (`_joins`).
        self.counters = {"admitted": 0, "finished": 0, "failed": 0, "refused_queue_full": 0,
                         "prefill_batches": 0, "prefill_batched_chunks": 0, "moved_into_cohorts": 0}

    def configure(self, max_concurrent: int | None = None, max_queued: int | None = None,
                  widths: tuple[int, ...] | None = None, numerics: str | None = None,
                  cohort_mode: str | None = None, max_backlog: int | None = None,
                  cohort_drafting: str | None = None, cohort_cycle: str | None = None,
                  batch_prefills: bool | None = None) -> None:
        """Change the limits (any thread); rows already running keep running."""
        if batch_prefills is not None:
            self.batch_prefills = batch_prefills
        if max_concurrent is not None:
            self.max_concurrent = max(1, min(int(max_concurrent), MAX_CONCURRENT_LIMIT))
        if max_queued is not None:
            self.max_queued = max(0, int(max_queued))
        if widths is not None:
            self.widths = widths
            self.cohort_histogram = {w: self.cohort_histogram.get(w, 0) for w in widths}
        if numerics is not None:
            self.numerics = numerics
        if cohort_mode is not None:
            self.cohort_mode = cohort_mode
        if cohort_drafting is not None:
            self.cohort_drafting = cohort_drafting
        if cohort_cycle is not None:
            self.cohort_cycle = cohort_cycle
        if max_backlog is not None:
            self.max_backlog = max_backlog

    # -- any thread -----------------------------------------------------------------------

    def submit(self, row: Row) -> Row:
        """Queue `row` (stamping its arrival if the caller did not); raises QueueFull when
        `max_queued` requests already wait."""
        if row.request.arrived_at is None:
            row.request.arrived_at = time.perf_counter()
        row.wake = self.wake
        with self._lock:
            # Only requests that cannot start at once count against the queue's bound.
            free = self.max_concurrent - len(self._running)
            if len(self._queue) >= self.max_queued + max(free, 0):
                self.counters["refused_queue_full"] += 1
                raise QueueFull(len(self._queue), self.retry_after_seconds())
            self._queue.append(row)
        self.wake()
        return row

    def retry_after_seconds(self) -> int:
        """A client's fair wait before retrying when the queue is full: the queue's length in
        row service times, spread over the row slots (1 to 60 seconds)."""
        waiting = len(self._queue) + 1
        estimate = self._service_seconds * waiting / max(self.max_concurrent, 1)
        return int(min(max(math.ceil(estimate), 1), 60))

    def has_work(self) -> bool:
        """True while a row can be stepped or a request waits (rows paused for a slow reader
        do not count: the owner may block until a reader wakes it)."""
        return bool(self._queue) or any(not self._paused(row) for row in self._running)

    def _paused(self, row: Row) -> bool:
        return (self.max_backlog is not None and not row.cancelled
                and row.over_backlog(self.max_backlog))

    def cancel_all(self) -> None:
        """Cancel every waiting and running row (model unload, daemon stop)."""
        with self._lock:
            rows = list(self._queue) + list(self._running)
        for row in rows:
            row.cancel()

    def status(self) -> dict[str, Any]:
        """Limits, counts and the rows, for `daemon.status`, /metrics and the flight board."""
        now = time.perf_counter()
        with self._lock:
            running, queued = list(self._running), list(self._queue)
        return {
            "max_concurrent": self.max_concurrent,
            "max_queued": self.max_queued,
            "running": len(running),
            "queued": len(queued),
            "rows": [row.snapshot(now) for row in running + queued],
            "cohort_widths": list(self.widths),
            "numerics": self.numerics,
            "cohort_cycle": self.cohort_cycle,
            "cohorts_by_width": dict(self.cohort_histogram),
            "paused": sum(1 for row in running if self._paused(row)),
            **self.counters,
        }

    # -- owner thread ---------------------------------------------------------------------

    def turn(self) -> None:
        """One turn: admit what fits, then step every running row once."""
        self._admit()
        running = list(self._running)
        waiting: list[tuple[Row, CohortCall]] = []
        for row in running:
            row.rows_max = max(row.rows_max, len(running))
            if self._paused(row):
                continue  # its reader is behind: the others go on (its next take wakes us)
            call = self._step(row)
            if call is not None:
                waiting.append((row, call))
        if waiting:
            self._run_cohorts(waiting)
        with self._lock:
            self._running = [row for row in self._running if row.phase != "done"]
            idle = not self._running
        if idle and running:
            _release_buffers()

    def drain(self, max_turns: int = 10_000) -> None:
        """Cancel everything and turn until every row has left (owner thread, at stop)."""
        self.cancel_all()
        for _ in range(max_turns):
            if not self.has_work():
                return
            self.turn()

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._queue or len(self._running) >= self.max_concurrent:
                    return
                row = self._queue[0]
            if not row.cancelled and not self._reserve(row):
                return  # FIFO: the head waits for memory, and nobody overtakes it
            with self._lock:
                self._queue.popleft()
                if row.phase != "done":
                    self._running.append(row)
            if row.phase != "done":
                self._start(row)

    def _reserve(self, row: Row) -> bool:
        """Price the row next to the running ones; False when it must wait. A row that can
        never fit fails here (its deliver gets the guard's error)."""
        if self.admit is None:
            return True
        try:
            release = self.admit(row.request)
        except Exception as exc:
            self._fail(row, exc)
            return True  # it leaves the queue, failed
        if release is None:
            return False
        row.release = release
        return True

    def _start(self, row: Row) -> None:
        row.admitted_at = time.perf_counter()
        row.phase = "prefill"
        self.counters["admitted"] += 1
        try:
            if row.cohort_capable:
                row.steps = row._start(lambda: row.cancelled, cohort=_CohortQuestions(self, row))
            else:
                row.steps = row._start(lambda: row.cancelled)
        except Exception as exc:  # bad depth and the like: this request's error only
            self._fail(row, exc)

    def _decides(self, row: Row) -> str | bool:
        """What a cohort-capable row runs (generation.generate_steps asks when its prefill
        starts, and again when its decoding starts): False for its solo loops, else
        `_cohort_kind()`. Asked at the decoding's start too, so that a row admitted alone
        joins the rows that arrived while it prefilled (requests an agent sends together
        reach the daemon milliseconds apart)."""
        row.in_cohorts = self._wants_cohort(row)
        return row.in_cohorts and self._cohort_kind()

    def _joins(self, row: Row) -> str | bool:
        """Asked at each cycle boundary by a row decoding alone in its solo MTP loop (auto
        mode): once another row decodes in cohorts, it moves into them (False, or
        `_cohort_kind()`), so the two verify in one forward instead of taking turns: a long
        agent turn and the title request or subagent that arrives during it. Only where
        batching pays ("throughput" numerics): under "exact" a cohort's rows run their own
        forwards, and the move would only trade the solo loop for a slower one."""
        if self.cohort_mode != "auto" or self.numerics != "throughput" or not self.move_solo_rows:
            return False
        with self._lock:
            company = any(r is not row and r.in_cohorts and r.phase == "decode" for r in self._running)
        if not company:
            return False
        row.in_cohorts = True
        self.counters["moved_into_cohorts"] += 1
        return self._cohort_kind()

    def _wants_cohort(self, row: Row) -> bool:
        """Whether a row decodes in cohorts: always, never (off), or (auto) when it is not
        alone. A lone request keeps the solo decode loop (fused, pipelined: the single-stream
        speed) until another row decodes in cohorts beside it (`_joins`)."""
        if self.cohort_mode != "auto":
            return self.cohort_mode == "always"
        with self._lock:
            others = [r for r in self._running if r is not row and r.phase != "done"]
            return bool(others or self._queue)

    def _cohort_kind(self) -> str | bool:
        """What a cohort row runs: "fused" (a dense model's MTP rows: one compiled cycle per
        cohort) when so set and the numerics are "throughput" (the fused cycle's forwards are
        batched), else True (the phased cohorts: cohort.py)."""
        if self.cohort_cycle == "fused" and self.numerics == "throughput":
            return "fused"
        return True

    def _step(self, row: Row) -> CohortCall | None:
        """Step a row once; a cohort row's call comes back for `_run_cohorts`."""
        if row.phase == "done" or row.steps is None:
            return None
        row.steps_taken += 1
        return self._advance(row, None)

    def _run_cohorts(self, waiting: list[tuple[Row, CohortCall]]) -> None:
        """Answer this turn's cohort calls a phase at a time (drafts, then verifies, then the
        one sync), until every row has committed its cycle."""
        while waiting:
            kind = next(k for k in PHASES if any(isinstance(call, k) for _, call in waiting))
            batch = [(row, call) for row, call in waiting if isinstance(call, kind)]
            waiting = [(row, call) for row, call in waiting if not isinstance(call, kind)]
            if kind is PrefillChunk:
                waiting += self._run_prefills(batch)
            elif kind is FusedCycleCall:
                waiting += self._run_fused(batch)
            elif kind is SettleCall:
                waiting += self._settle([call for _, call in batch], batch)
            else:
                waiting += self._run_grouped(kind, batch)

    def _run_grouped(self, kind: type, batch: list[tuple[Row, CohortCall]]
                     ) -> list[tuple[Row, CohortCall]]:
        """Run the batch's draft or verify calls as cohorts; return each row's next call."""
        calls = [call for _, call in batch]
        following = []
        for indices, width in group(calls, self.widths):
            cohort = [calls[i] for i in indices]
            try:
                if kind is DraftCall:
                    answers = run_drafts(cohort, width, self.numerics, self.cohort_drafting)
                else:
                    answers = run_cohort(cohort, width, self.numerics)
            except Exception as exc:  # the shared forward failed: its rows end, no others
                for i in indices:
                    self._fail(batch[i][0], exc)
                continue
            if kind is VerifyCall:
                self.cohort_histogram[width] = self.cohort_histogram.get(width, 0) + 1
            for i, answer in zip(indices, answers):
                row = batch[i][0]
                if kind is VerifyCall:
                    row.cohort_widths[width] = row.cohort_widths.get(width, 0) + 1
                following += self._next_call(row, answer, kind)
        return following

    def _run_prefills(self, batch: list[tuple[Row, PrefillChunk]]) -> list[tuple[Row, CohortCall]]:
        """This turn's prefill chunks, batched where the numerics allow (cohort.run_prefills);
        each row then goes on to its next chunk's boundary or its first token. A forward that
        fails ends its rows (all of a shared one's), no others."""
        calls = [call for _, call in batch]
        # Shared forwards round rows apart from their solo numbers: never under "exact".
        answers, batched = run_prefills(calls, share=self.batch_prefills and self.numerics != "exact")
        self.counters["prefill_batches"] += len(batched)
        self.counters["prefill_batched_chunks"] += sum(batched)
        following = []
        for (row, _), answer in zip(batch, answers):
            if isinstance(answer, Exception):
                log.warning("row %s (%s): its prefill failed: %s", row.id, row.request.request_id, answer)
                self._fail(row, answer)
                continue
            following += self._next_call(row, answer, PrefillChunk)
        return following

    def _run_fused(self, batch: list[tuple[Row, CohortCall]]) -> list[tuple[Row, CohortCall]]:
        """One cycle of every fused cohort with a row in `batch`; each row gets the tokens
        read back for it (one cycle late: decoding/fused_cohort.py)."""
        try:
            answers = self.fused.turn([call for _, call in batch], self.widths)
        except Exception as exc:  # not a cohort's graph (those come back per row): all end
            for row, _ in batch:
                self._fail(row, exc)
            return []
        following = []
        for (row, _), answer in zip(batch, answers):
            if isinstance(answer, BaseException):  # its cohort's graph failed: it ends, no other
                self._fail(row, answer)
                continue
            width, tokens = answer
            row.cohort_widths[width] = row.cohort_widths.get(width, 0) + 1
            following += self._next_call(row, tokens, FusedCycleCall)
        for width in self.fused.widths_run:
            self.cohort_histogram[width] = self.cohort_histogram.get(width, 0) + 1
        return following

    def _settle(self, calls: list[SettleCall], batch: list[tuple[Row, CohortCall]]
                ) -> list[tuple[Row, CohortCall]]:
        """The turn's one host sync over every row's decisions; then each row commits."""
        try:
            settle_together(calls, self.cohort_drafting)
        except Exception as exc:  # a row's graph failed: which one is unknown, so all end
            for row, _ in batch:
                self._fail(row, exc)
            return []
        following = []
        for row, _ in batch:
            following += self._next_call(row, None, SettleCall)
        return following

    def _next_call(self, row: Row, answer: Any, answered: type) -> list[tuple[Row, CohortCall]]:
        """Send the row its answer (to an `answered` call); its next call, if the cycle goes
        on ([] when it ended). A cycle's calls come in PHASES order, each once: a row that
        asks for a phase again would stall the turn, so it fails instead."""
        call = self._advance(row, answer)
        if call is None:
            return []
        if _phase(call) <= PHASES.index(answered):
            self._fail(row, RuntimeError(f"a cohort row asked for {type(call).__name__} again "
                                         "in one cycle"))
            return []
        return [(row, call)]

    def _advance(self, row: Row, answer: Any) -> CohortCall | None:
        """Resume the row's generator (next, or send a cohort's answer) and handle its item."""
        try:
            item = next(row.steps) if answer is None else row.steps.send(answer)
        except StopIteration:
            self._fail(row, RuntimeError("the generation ended without a result"))
            return None
        except Exception as exc:
            log.warning("row %s (%s) failed: %s", row.id, row.request.request_id, exc, exc_info=exc)
            self._fail(row, exc)
            return None
        if isinstance(item, PrefillChunk):  # a cohort row's prefill chunk: run with the turn's others
            return item
        if isinstance(item, CohortCall):
            row.phase = "decode"
            return item
        if isinstance(item, TokenDelta):
            row.phase = "decode"
            row.tokens += len(item.token_ids)
            self._deliver(row, item)
        elif isinstance(item, GenerationResult):
            item.stats.rows_max = max(row.rows_max, 1)
            item.stats.cohort_widths = {str(w): n for w, n in sorted(row.cohort_widths.items())}
            self._deliver(row, item)
            self._finish(row)
        return None

    def _finish(self, row: Row) -> None:
        """The row's result is out: run what the generation does after it (the session bank's
        copy), then give back its memory."""
        try:
            for _ in row.steps:
                pass
        except Exception:  # the client has its answer; only the bank's copy is lost
            log.exception("row %s: after its result", row.id)
        if row.admitted_at is not None:
            spent = time.perf_counter() - row.admitted_at
            self._service_seconds = 0.8 * self._service_seconds + 0.2 * spent
        self.counters["finished"] += 1
        self._leave(row)

    def _fail(self, row: Row, exc: BaseException) -> None:
        self.counters["failed"] += 1
        self._deliver(row, RowFailure(exc))
        if row.steps is not None:
            try:
                row.steps.close()
            except Exception:
                log.exception("row %s: closing after a failure", row.id)
        self._leave(row)

    def _leave(self, row: Row) -> None:
        row.phase = "done"
        row.steps = None
        if row.release is not None:
            row.release()
            row.release = None

    def _deliver(self, row: Row, item: Any) -> None:
        row.delivered()
        try:
            row.deliver(item)
        except Exception:  # a broken consumer ends its own row, never the scheduler
            log.exception("row %s: delivery failed; cancelling it", row.id)
            row.cancel()


class _CohortQuestions:
    """What a cohort-capable row asks the scheduler (generation.generate_steps): called,
    whether it prefills and decodes in cohorts (Scheduler._decides); `join()`, at each cycle
    boundary while it decodes alone, whether it moves into cohorts now (Scheduler._joins)."""

    def __init__(self, scheduler: Scheduler, row: Row) -> None:
        self._scheduler, self._row = scheduler, row

    def __call__(self) -> str | bool:
        return self._scheduler._decides(self._row)

    def join(self) -> str | bool:
        return self._scheduler._joins(self._row)


# The order in which a turn answers rows' calls; a row's step asks each at most once (a
# prefill chunk's step asks nothing more).
PHASES = (PrefillChunk, FusedCycleCall, DraftCall, VerifyCall, SettleCall)


def _phase(call: CohortCall) -> int:
    return next(i for i, kind in enumerate(PHASES) if isinstance(call, kind))


def _release_buffers() -> None:
    """Give MLX's cached buffers back once no row runs. Not when one row of several leaves:
    its neighbours would only allocate the same buffers again."""
    import mlx.core as mx

    mx.clear_cache()
