"""One request from prompt to result: prefill, decode cycles, stops, streaming text, stats.

The decode strategy (AR or speculative) only yields committed token lists; this module
decides when to stop (EOS, stop ids, stop strings, max_tokens, cancellation), turns tokens
into UTF-8-safe text deltas and fills in the stats.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Callable, Generator, Iterator

import mlx.core as mx

from mtplxd.engine.decoding.autoregressive import ar_cycles
from mtplxd.engine.decoding.cohort_rows import (
    CohortCall, CohortSpeculativeDecoder, cohort_ar_cycles,
)
from mtplxd.engine.decoding.detokenize import TextStream
from mtplxd.engine.decoding.fused import FusedSpeculativeDecoder, fused_supported
from mtplxd.engine.decoding.fused_ar import fused_ar_cycles, fused_ar_wanted
from mtplxd.engine.decoding.fused_cohort import FusedCohortRow
from mtplxd.engine.decoding.logprobs import LogprobScorer
from mtplxd.engine.decoding.repetition import RepetitionDetector
from mtplxd.engine.decoding.sampling import TokenHistory, pick_first
from mtplxd.engine.decoding.speculative import SpeculativeDecoder, feed_pending_pairs
from mtplxd.engine.decoding.split import CycleSplit
from mtplxd.engine.interface import (
    GenerationRequest, GenerationResult, GenerationStats, SamplingParams, TokenDelta,
)
from mtplxd.engine.model.mrope import RowPositions
from mtplxd.engine.model.mrope import attach as attach_positions
from mtplxd.engine.model.mtp_head import MTPHead
from mtplxd.engine.model.trunk import PREFILL_CHUNK, PrefillChunk, Trunk
from mtplxd.engine.session.bank import SessionBank
from mtplxd.engine.model.vision import VisionTower, bank_key


class _Finish:
    """Where the request stands: committed tokens, text so far, and the finish reason.

    With the runaway-loop guard on, text is held back while a repeated span is forming
    (repetition.py) and released when it breaks; a complete loop ends the output at the
    point where holding began, so the repeats never reach the client."""

    def __init__(self, tokenizer, request: GenerationRequest) -> None:
        params = request.sampling
        self.max_tokens = params.max_tokens
        eos = set() if params.ignore_eos else set(tokenizer.eos_token_ids)
        self.stop_ids = eos | set(params.stop_token_ids)
        self.stream = TextStream(tokenizer, params.stop)
        self.token_ids: list[int] = []
        self.generated = 0  # tokens the model produced, a final stop token included
        self.reason: str | None = None
        self.text = ""  # everything handed to the client
        self.loops = RepetitionDetector(request.repetition) if request.repetition else None
        self.hold_from: int | None = None  # token index where held-back text starts
        self.held = ""
        self.loop_period = 0
        self.trimmed = 0

    def take(self, tokens: list[int]) -> TokenDelta | None:
        """Commit tokens in order until a stop; return the delta to stream (None if empty)."""
        accepted: list[int] = []
        text = ""
        for token in tokens:
            if self.reason is not None:
                break
            self.generated += 1
            if token in self.stop_ids:
                self.reason = "stop"
                break
            accepted.append(token)
            self.token_ids.append(token)
            text += self._route(self.stream.add(token))
            if self.loop_period:
                self.reason = "length"
            elif self.stream.stopped:
                self.reason = "stop"
            elif self.generated >= self.max_tokens:
                self.reason = "length"
        if self.loop_period:
            accepted = accepted[:max(0, len(accepted) - self.trimmed)]
        elif self.reason == "length" or (self.reason == "stop" and not self.stream.stopped):
            text += self.flush()
        elif self.reason == "stop":  # a stop string ended the text stream: release the held text
            text += self._release()
        self.text += text
        if not accepted and not text:
            return None
        return TokenDelta(token_ids=accepted, text=text)

    def flush(self) -> str:
        """The output ended (not by a loop): what is held back and pending, released."""
        return self._release() + self.stream.finish()

    def _release(self) -> str:
        held, self.held, self.hold_from = self.held, "", None
        return held

    def _route(self, piece: str) -> str:
        """Pass the latest token's text through the loop guard: the text to send now."""
        if self.loops is None:
            return piece
        self.loops.add(self.token_ids[-1])
        if not self.loops.forming:
            return self._release() + piece
        if self.hold_from is None:
            self.hold_from = len(self.token_ids) - 1
        self.held += piece
        period = self.loops.loop_period()
        if period:
            self.loop_period = period
            self.trimmed = len(self.token_ids) - self.hold_from
            del self.token_ids[self.hold_from:]
            self.held = ""
        return ""


SAMPLE_SECONDS = 1.0
# Time one cycle per sample window (decoding/split.py). Not a setting: the split-cost bench
# (bench/split_cost.py) turns it off to measure what it costs.
TIME_SAMPLED_CYCLES = True
# ... and at most one in this many cycles: where a cycle takes a large part of a second (a
# CPU), one per window would time a quarter of all cycles and their lost overlap would show.
SPLIT_EVERY_CYCLES = 16


class DecodeSamples:
    """Per-second decode samples into `stats.samples`: what the flight recorder plots.

    Each sample covers the window since the previous one: tokens/s, cycles and their mean
    time, accepted length and accepted/drafted counts by draft position, and the context
    length at its end. A speculative decoder's window also carries the draft/verify split of
    the cycle timed in it, if one was (draft_ms, verify_ms, split_cycles, split_source:
    decoding/split.py says why a sampled cycle): the request's first cycle, then one per
    window, at most one in SPLIT_EVERY_CYCLES. AR has no draft, so its samples carry none.
    """

    def __init__(self, stats: GenerationStats, arrived: float, start: float,
                 acceptance: Any = None, split: CycleSplit | None = None) -> None:
        self.stats = stats
        self.arrived = arrived
        self.acceptance = acceptance  # the decoder's AcceptanceStats (None: AR)
        self.split = split if TIME_SAMPLED_CYCLES else None  # the decoder's CycleSplit (None: AR)
        self.at, self.generated, self.cycles, self.committed = start, 1, 0, 0
        self.by_depth = ([], [])
        self.split_at = 0  # decoder cycles when the last timed cycle was asked for
        if self.split is not None:
            self.split.arm()  # the request's first cycle runs timed

    def _arm_split(self) -> None:
        """Ask for a timed cycle when this window has none yet and SPLIT_EVERY_CYCLES cycles
        ran since the last one was asked for (so about one per second where cycles are fast)."""
        split = self.split
        if split is None or split.armed or split.cycles:
            return
        if self.acceptance.cycles - self.split_at >= SPLIT_EVERY_CYCLES:
            split.arm()
            self.split_at = self.acceptance.cycles

    def tick(self, now: float, generated: int, force: bool = False) -> None:
        """After a cycle: close the window when a second passed (or `force`, at the end, when
        tokens came), then ask for a timed cycle if one is due."""
        self._close_window(now, generated, force)
        self._arm_split()

    def _close_window(self, now: float, generated: int, force: bool) -> None:
        seconds = now - self.at
        if (seconds < SAMPLE_SECONDS and not force) or generated <= self.generated or seconds <= 0:
            return
        acc = self.acceptance
        cycles = acc.cycles if acc is not None else generated - 1
        committed = acc.committed if acc is not None else generated - 1
        drafted = list(acc.drafted_by_depth) if acc is not None else []
        accepted = list(acc.accepted_by_depth) if acc is not None else []
        window_cycles = cycles - self.cycles
        sample = {
            "t": round(now - self.arrived, 3),
            "seconds": round(seconds, 3),
            "tokens": generated - self.generated,
            "tok_s": round((generated - self.generated) / seconds, 2),
            "cycles": window_cycles,
            "cycle_ms": round(1000 * seconds / window_cycles, 2) if window_cycles else None,
            "accepted_length": (round((committed - self.committed) / window_cycles, 3)
                                if window_cycles else None),
            "drafted_by_depth": [a - b for a, b in zip(drafted, self.by_depth[0] or [0] * len(drafted))],
            "accepted_by_depth": [a - b for a, b in zip(accepted, self.by_depth[1] or [0] * len(accepted))],
            "context": self.stats.prompt_tokens + generated,
        }
        if self.split is not None:
            sample.update(self.split.take())
        self.stats.samples.append(sample)
        self.at, self.generated, self.cycles, self.committed = now, generated, cycles, committed
        self.by_depth = (drafted, accepted)


class Step:
    """A generation step that has nothing to stream: one prefill chunk, or a decode cycle
    whose tokens completed no text yet. The scheduler runs other rows after it."""

    def __repr__(self) -> str:
        return "STEP"


STEP = Step()


def generate(trunk: Trunk, head: MTPHead | None, tokenizer, request: GenerationRequest,
             depth: int, vocab_size: int,
             should_stop: Callable[[], bool],
             bank: SessionBank | None = None,
             vision: VisionTower | None = None) -> Iterator[TokenDelta | GenerationResult]:
    """Run one request; yield TokenDeltas, then exactly one GenerationResult.

    depth 0 (or no head) decodes plain AR; depth K >= 1 runs the speculative loop. The
    caller validated depth. should_stop() is checked before prefill and between cycles.
    With a session `bank`, the longest stored prefix of the prompt is restored first (only
    the rest is prefilled; stats.cached_tokens says how much), and after the result the
    committed state is stored back. A request with images needs the model's `vision` tower.
    """
    for item in generate_steps(trunk, head, tokenizer, request, depth, vocab_size,
                               should_stop, bank, vision):
        if not isinstance(item, Step):
            yield item
    mx.clear_cache()  # the request's buffers go back now, not when the next one needs them


def generate_steps(trunk: Trunk, head: MTPHead | None, tokenizer, request: GenerationRequest,
                   depth: int, vocab_size: int,
                   should_stop: Callable[[], bool],
                   bank: SessionBank | None = None,
                   vision: VisionTower | None = None, *,
                   cohort: bool | str | Callable[[], bool | str] = False
                   ) -> Generator[TokenDelta | GenerationResult | Step | CohortCall, Any, None]:
    """`generate`, one unit of work per item: every prefill chunk and every decode cycle
    yields (a TokenDelta when it completed text, else STEP), so the scheduler can step many
    requests on one thread. The request's own caches, sampler and seed live in this
    generator alone: its output does not depend on what runs between its steps.

    With `cohort`, each decode cycle first yields its cohort calls (DraftCall, VerifyCall,
    SettleCall: decoding/cohort_rows.py) and must be sent each call's answer (engine/cohort.py
    runs the calls of many rows together); the item that the last `send` returns is the
    cycle's TokenDelta or STEP (or the result). `cohort="fused"` makes an MTP row of a dense
    model a fused cohort row instead (one FusedCycleCall a cycle: decoding/fused_cohort.py);
    other rows (hybrid, images, AR) then run phased cohorts. A callable `cohort` is asked
    when the prefill starts (whether its chunks go to the scheduler) and again when the
    decoding starts (which loop decodes): a row that started alone can still join rows that
    arrived during its prefill. When the callable also has a `join()` (the scheduler's
    questions), a row decoding alone in its solo MTP loop asks it at each cycle boundary, and
    a truthy answer (the cohort kind) moves the row into cohorts from its committed state
    (`_moved_into_cohorts`)."""
    params = request.sampling
    prompt = list(request.prompt_ids)
    if not prompt:
        raise ValueError("empty prompt: at least one prompt token is needed")
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    depth = depth if head is not None else 0
    stats = GenerationStats(prompt_tokens=len(prompt), depth=depth)
    finish = _Finish(tokenizer, request)
    start = time.perf_counter()
    arrived = request.arrived_at if request.arrived_at is not None else start
    stats.queue_wait_seconds = max(start - arrived, 0.0)
    if params.max_tokens <= 0 or should_stop():
        reason = "length" if params.max_tokens <= 0 else "cancelled"
        yield _result(finish, stats, reason, start, start, start)
        return

    history = TokenHistory(vocab_size, prompt)
    chunk = request.prefill_chunk or PREFILL_CHUNK
    turn, head_cache, pending_from = None, None, 0
    embeddings, key, positions = _image_inputs(trunk, vision, request)
    if bank is None:
        cache = trunk.make_cache()
        attach_positions(cache, positions)
        prefill = trunk.prefill_steps(prompt, cache, chunk, should_stop=should_stop,
                                      embeddings=embeddings)
    else:
        turn = bank.begin(trunk, head if depth > 0 else None, prompt, request.session_id, key=key,
                          positions=positions)
        cache, head_cache, pending_from = turn.cache, turn.head_cache, turn.pending_from
        attach_positions(cache, positions)
        stats.cached_tokens = turn.cached
        stats.restored_from = turn.restored_from
        prefill = turn.prefill_steps(chunk, should_stop=should_stop, embeddings=embeddings)
    # A cohort row hands its prefill chunks to the scheduler, which may batch them with
    # other rows' (cohort.run_prefills); any other row runs each chunk itself.
    decide = cohort if callable(cohort) else lambda: cohort
    join = getattr(cohort, "join", None)
    prefilled = yield from _counted(prefill, stats, pass_up=bool(decide()))
    if prefilled is None:
        now = time.perf_counter()
        yield _result(finish, stats, "cancelled", start, now, now)
        return
    hiddens, last_logits = prefilled
    first = pick_first(last_logits, params, history, seed, len(prompt))
    prefill_done = time.perf_counter()
    stats.ttft_seconds = prefill_done - arrived  # the queue wait is part of what the client waited
    scorer = None
    if request.logprobs is not None:
        scorer = LogprobScorer(trunk, params, prompt, request.logprobs, vocab_size,
                               embeddings=embeddings, positions=positions)
    delta = _scored(finish.take([first]), scorer)
    yield delta if delta is not None else STEP

    decoder = None
    cohort = decide()  # asked again now: rows may have arrived during the prefill
    if depth > 0:
        fused = trunk.decode_loop == "fused" and fused_supported(
            trunk, cache, hybrid=_hybrid_may_fuse(params, positions))
        if cohort == "fused" and positions is None and fused_supported(trunk, cache):
            decoder_class = FusedCohortRow
        elif cohort:
            decoder_class = CohortSpeculativeDecoder
        else:
            decoder_class = FusedSpeculativeDecoder if fused else SpeculativeDecoder
        decoder = decoder_class(trunk, head, cache, params, history, seed, depth,
                                head_cache=head_cache)
        attach_positions(decoder.head_cache, positions)  # the head drafts at the row's positions
        cycles = decoder.cycles(hiddens, prompt, first, pending_from=pending_from)
    elif cohort:
        cycles = cohort_ar_cycles(trunk, cache, params, history, seed, first, len(prompt))
    elif positions is None and fused_ar_wanted(trunk, cache, len(prompt)):  # an image row keeps mrope's loop
        cycles = fused_ar_cycles(trunk, cache, params, history, seed, first, len(prompt))
    else:
        cycles = ar_cycles(trunk, cache, params, history, seed, first, len(prompt))
    reason = finish.reason
    samples = DecodeSamples(stats, arrived, prefill_done, decoder.stats if decoder else None,
                            decoder.split if decoder else None)
    # A turn that ends on its first token (max_tokens 1, a stop) runs no cycle, so nothing
    # feeds the head: keep the hiddens to give its bank entry the head's KV after the result.
    unfed = hiddens if turn is not None and decoder is not None and reason is not None else None
    del hiddens
    produced = [first]  # every token the decoder committed (the bank keys the cache by them)
    if cohort or decoder is None or positions is not None:
        join = None  # only a solo MTP row moves: cohort, AR and image rows stay where they are
    while reason is None:
        if should_stop():
            reason = "cancelled"
            break
        # After its first cycle (before it, the decode start's question was the same one).
        if join is not None and len(produced) > 1 and (kind := join()):
            decoder, cycles = _moved_into_cohorts(decoder, cycles, kind, prompt + produced[:-1], produced[-1])
            join = None
        step = next(cycles)
        while isinstance(step, CohortCall):  # a cohort row: the scheduler runs the shared steps
            step = cycles.send((yield step))
        produced += step
        delta = _scored(finish.take(step), scorer)
        reason = finish.reason
        samples.tick(time.perf_counter(), finish.generated)
        if delta is not None:
            yield delta
        elif reason is None:
            yield STEP
    cycles.close()
    if reason == "cancelled":
        tail = finish.flush()
        finish.text += tail
        if tail:
            yield TokenDelta(token_ids=[], text=tail)
    end = time.perf_counter()
    samples.tick(end, finish.generated, force=True)
    if decoder is not None:
        acc = decoder.stats
        stats.drafted_by_depth, stats.accepted_by_depth = acc.drafted_by_depth, acc.accepted_by_depth
        stats.drafted, stats.accepted = sum(acc.drafted_by_depth), sum(acc.accepted_by_depth)
        stats.cycles = acc.cycles
        stats.mean_accepted_length = acc.committed / acc.cycles if acc.cycles else 0.0
    else:
        stats.cycles = max(finish.generated - 1, 0)
    yield _result(finish, stats, reason, start, prefill_done, end)
    if turn is not None:  # after the result: the client is not kept waiting for the copy
        if unfed is not None:
            decoder.pending_hidden = feed_pending_pairs(trunk, head, decoder.head_cache, unfed,
                                                        prompt, first, pending_from)
        turn.store(produced, decoder.head_cache if decoder else None,
                   decoder.pending_hidden if decoder else None, returned=finish.generated)


def _hybrid_may_fuse(params: SamplingParams, positions: RowPositions | None) -> bool:
    """Whether a hybrid model's row may decode in the fused loop: not with an image prompt
    (its positions are mrope's), nor when it is sampled with a seed. A seeded row must give
    the same tokens alone as in cohorts, and a hybrid row's cohorts are phased ones, which
    draw as the stepwise loop does; the fused loop draws other tokens (same distribution)."""
    return positions is None and (params.greedy or params.seed is None)


def _moved_into_cohorts(decoder: FusedSpeculativeDecoder | SpeculativeDecoder, cycles: Iterator[list[int]],
                        kind: str | bool, context: list[int], last_token: int
                        ) -> tuple[FusedCohortRow | CohortSpeculativeDecoder, Iterator[Any]]:
    """A solo MTP row goes on as a cohort row (a fused one when `kind` is "fused" and the cache
    allows it, else phased) from the state its loop committed, as a session-bank turn goes on
    from a restored prefix: closing the loop leaves the trunk cache over `context` (every
    token committed but the last, `last_token`), the head's cache and the hiddens of the
    PENDING pairs the head has not been fed; the cohort row feeds those and decodes on. Its
    stats and cycle split go on counting in the solo loop's objects. A fused loop's cycle in
    flight is dropped: its tokens were never read back, so nothing of it was committed."""
    cycles.close()
    pending = decoder.pending_hidden
    trunk, cache = decoder.trunk, decoder.cache
    row_class = FusedCohortRow if kind == "fused" and fused_supported(trunk, cache) else CohortSpeculativeDecoder
    moved = row_class(trunk, decoder.head, cache, decoder.params, decoder.history, decoder.seed,
                      decoder.depth, head_cache=decoder.head_cache)
    moved.stats, moved.split = decoder.stats, decoder.split
    return moved, moved.cycles([pending], context, last_token,
                               pending_from=len(context) - pending.shape[1])


def _image_inputs(trunk: Trunk, vision: VisionTower | None, request: GenerationRequest
                  ) -> tuple[mx.array | None, list[int] | None, RowPositions | None]:
    """(the prompt's input embeddings with its images spliced in, the session-bank key that
    names each image row by the image's bytes, the prompt's multimodal rotary positions), or
    (None, None, None) for a text-only prompt."""
    if not request.images:
        return None, None, None
    if vision is None:
        raise ValueError("this model has no vision tower; the request carries images")
    prompt = list(request.prompt_ids)
    embeddings = vision.embed_prompt(trunk.input_embedding, prompt, request.images)
    mx.eval(embeddings)
    return (embeddings, bank_key(prompt, vision.image_token_id, request.images),
            vision.row_positions(prompt, request.images))


def _scored(delta: TokenDelta | None, scorer: LogprobScorer | None) -> TokenDelta | None:
    """`delta` with its tokens' logprobs when the request asked for them."""
    if delta is not None and scorer is not None:
        delta.logprobs = scorer.score(delta.token_ids)
    return delta


def _counted(steps: Generator[PrefillChunk | None, Any, Any], stats: GenerationStats, *,
             pass_up: bool) -> Generator[Step | PrefillChunk, Any, Any]:
    """Run a prefill one chunk per scheduler step (its step boundaries pass on as STEPs),
    counting its forwards in stats.prefill_chunks. Each PrefillChunk is answered here alone,
    or with `pass_up` yielded to the scheduler, which sends back its answer."""
    stats.prefill_chunks = 0
    answer = None
    while True:
        try:
            item = steps.send(answer)
        except StopIteration as done:
            return done.value
        if item is None:
            answer = yield STEP
            continue
        stats.prefill_chunks += 1
        answer = (yield item) if pass_up else item.run()


def _result(finish: _Finish, stats: GenerationStats, reason: str, start: float,
            prefill_done: float, end: float) -> GenerationResult:
    stats.finish_reason = reason
    stats.completion_tokens = finish.generated
    stats.repetition_stop = bool(finish.loop_period)
    stats.repetition_period = finish.loop_period
    stats.repetition_trimmed_tokens = finish.trimmed
    stats.prefill_seconds = prefill_done - start
    stats.decode_seconds = end - prefill_done
    if stats.prefill_seconds > 0:
        # Tokens actually prefilled: a session-bank restore skips the cached ones.
        stats.prefill_tokens_per_second = (stats.prompt_tokens - stats.cached_tokens) / stats.prefill_seconds
    decoded = max(finish.generated - 1, 0)  # the first token comes from the prefill forward
    if stats.decode_seconds > 0 and decoded:
        stats.decode_tokens_per_second = decoded / stats.decode_seconds
    return GenerationResult(text=finish.text, token_ids=list(finish.token_ids),
                            finish_reason=reason, stats=stats)


def score(trunk: Trunk, prompt_ids: list[int]) -> list[float | None]:
    """log p(token_i | tokens_<i) for every prompt token; the first is None."""
    cache = trunk.make_cache()
    out: list[float | None] = [None]
    previous_row: Any = None
    for start in range(0, len(prompt_ids), PREFILL_CHUNK):
        chunk = prompt_ids[start:start + PREFILL_CHUNK]
        _, logits = trunk.forward(mx.array(chunk)[None], cache, all_logits=True)
        logits = logits[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if previous_row is None:  # the first token has no prefix to be scored against
            rows, targets = logprobs[:-1], chunk[1:]
        else:
            rows, targets = mx.concatenate([previous_row, logprobs[:-1]]), chunk
        if targets:
            picked = mx.take_along_axis(rows, mx.array(targets)[:, None], axis=-1)[:, 0]
            out.extend(picked.tolist())
        previous_row = logprobs[-1:]
    return out
