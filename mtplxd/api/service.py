"""The generation pipeline every dialect shares: admit, render, clamp, run, parse, account.

A dialect module parses its body into a Conversation (or raw prompt ids) and GenParams, asks
`Generations.plan_*` for a Plan (model checks, chat template, context clamp, sampler), then
either `complete(plan)` (non-streamed) or iterates `stream(plan)` (streamed) and renders
what comes back in its own shape. Flight board and metrics are fed here, once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import trio

from mtplxd.api import chat_format
from mtplxd.api.errors import (
    APIError, context_length_exceeded, group_lost, invalid, model_not_found, model_not_loaded,
    queue_full,
)
from mtplxd.api.flight import Flight, FlightBoard
from mtplxd.api.logprobs import LogprobItems, Scored, ids_of, scored, token_pieces
from mtplxd.api.metrics import Metrics
from mtplxd.api.receipts import CLIENT_CLOSED, Client, Receipts
from mtplxd.api.retrieval import refuse_chat_on_retrieval_model
from mtplxd.api.parsers import (
    QWEN_TOOLS, Event, OutputParser, ParsedOutput, ToolCallEvent, ToolDialect, collect,
)
from mtplxd.api.schemas import Conversation, GenParams, generation_defaults
from mtplxd.engine.interface import (
    GenerationRequest, GenerationResult, GroupLost, QueueFull, RepetitionPolicy, SamplingParams,
    TokenDelta, TokenLogprob,
)
from mtplxd.guard import DEFAULT_PREFILL_CHUNK, ContextWindow, InsufficientMemory, context_window
from mtplxd.runtime import ModelNotLoaded, Runtime

UNKNOWN_CONTEXT = 1 << 31
# The request field a prompt arrives in, by endpoint (a context_length_exceeded names it).
PROMPT_FIELD = {"completions": "prompt", "responses": "input"}
SCORE_WAIT_SECONDS = 0.05  # how often a prompt score waiting for memory asks the guard again
# An admitted stream whose response body has not started by then lost its client: cancelled.
STREAM_START_SECONDS = 5.0


class Tick:
    """Nothing to send for a while: the SSE writer sends a keep-alive."""


TICK = Tick()


@dataclass
class Plan:
    """One admitted generation, ready to run."""

    id: str
    endpoint: str
    model_id: str
    request: GenerationRequest
    max_tokens: int
    max_tokens_requested: int | None
    parse_tools: bool = False
    tool_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    start_in_reasoning: bool = False
    output_prefix: str = ""
    dialect: ToolDialect = QWEN_TOOLS  # the model's tool-call markup
    think_close_id: int | None = None  # the model's `</think>` token, where it is one token
    raw_text: bool = False  # legacy completions: output is plain text, verbatim
    opened: "_OpenStream | None" = None  # set by Generations.open_stream
    client: Client = field(default_factory=Client)  # who asked (request log, flight record)
    context_window: int | None = None  # the server's window when it was admitted
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def clamped(self) -> bool:
        """The client's output cap did not fit the context and was lowered."""
        return self.max_tokens_requested is not None and self.max_tokens_requested > self.max_tokens

    def headers(self) -> dict[str, str]:
        """Response headers that make the effective output cap visible."""
        headers = {"X-MTPLX-Request-Id": self.id, "X-MTPLX-Max-Tokens": str(self.max_tokens)}
        if self.clamped:
            headers["X-MTPLX-Max-Tokens-Clamped-From"] = str(self.max_tokens_requested)
        return headers

    def new_parser(self) -> OutputParser:
        """An output parser for this plan, already fed the forced opener (if any)."""
        parser = OutputParser(parse_tools=self.parse_tools, start_in_reasoning=self.start_in_reasoning,
                              tool_schemas=self.tool_schemas, raw=self.raw_text,
                              dialect=self.dialect)
        if self.output_prefix:
            parser.feed_prefix(self.output_prefix)
        return parser


@dataclass
class Outcome:
    """A finished generation: the engine's result, its parse, and accounting."""

    plan: Plan
    result: GenerationResult
    parsed: ParsedOutput
    reasoning_tokens: int
    stop_sequence: str | None
    logprobs: list[TokenLogprob] | None = None  # the generated tokens', when the request asked

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish_reason: length beats tool_calls beats stop."""
        if self.result.finish_reason == "length":
            return "length"
        if self.parsed.tool_calls:
            return "tool_calls"
        return "stop"

    def mtplx_stats(self) -> dict[str, Any]:
        """The engine's stats for this request plus the output-cap facts."""
        stats = self.result.stats.to_dict()
        stats.pop("samples", None)  # the flight recorder's, not the client's
        stats["max_tokens"] = self.plan.max_tokens
        stats["max_tokens_requested"] = self.plan.max_tokens_requested
        stats["request_id"] = self.plan.id
        return stats

    def usage_openai(self) -> dict[str, Any]:
        """Chat/completions `usage`."""
        stats = self.result.stats
        return {
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }


@dataclass
class LoopGuard:
    """The runaway-loop guard's settings (config `repetition_*`): which requests get it."""

    mode: str = "auto"  # auto: requests without an output cap or with an agent's; on; off
    policy: RepetitionPolicy = field(default_factory=RepetitionPolicy)

    # In auto mode a cap this large counts as none: agents send a standing cap with every
    # request (Claude Code and Hermes 32,768, OpenCode 32,000; Anthropic requires one), and a
    # loop under it runs for tens of minutes on a small model (seen: OpenCode, 5,800 tokens of
    # "/main" at 17 tok/s). A client asking for a bounded answer sets a smaller one.
    AGENT_SIZED_CAP = 8192

    @classmethod
    def from_config(cls, config: Any) -> "LoopGuard":
        """The guard config.toml (or the environment) asks for."""
        return cls(config.repetition_guard, RepetitionPolicy(
            min_tokens=config.repetition_min_tokens, min_repeats=config.repetition_min_repeats))

    def policy_for(self, params: GenParams) -> RepetitionPolicy | None:
        """The guard for one request: its own `repetition_guard` wins, else the mode."""
        wanted = params.repetition_guard
        if wanted is None:
            uncapped = params.max_tokens is None or params.max_tokens >= self.AGENT_SIZED_CAP
            wanted = self.mode == "on" or (self.mode == "auto" and uncapped)
        return self.policy if wanted else None


class Generations:
    """Admission and running of generations over the daemon's runtime."""

    def __init__(self, runtime: Runtime, metrics: Metrics, flights: FlightBoard,
                 nursery: Callable[[], trio.Nursery], keepalive_seconds: float,
                 receipts: Receipts | None = None, loop_guard: "LoopGuard | None" = None) -> None:
        self.runtime = runtime
        self.loop_guard = loop_guard or LoopGuard()
        self.metrics = metrics
        self.flights = flights
        self.receipts = receipts or Receipts(None)
        self._nursery = nursery
        self.keepalive_seconds = keepalive_seconds
        self._tokenizer_limiter = trio.CapacityLimiter(1)

    # -- admission ------------------------------------------------------------------------

    def require_model(self, requested: str | None) -> Any:
        """The loaded model, or 400 (an embedding/reranker id) / 503 (none loaded) / 404
        (another id asked for)."""
        refuse_chat_on_retrieval_model(self.runtime, requested)
        if self.runtime.state != "loaded" or self.runtime.model is None:
            raise model_not_loaded(self.runtime.state)
        model = self.runtime.model
        if requested and requested != model.info.id:
            raise model_not_found(requested, model.info.id)
        return model

    async def on_model(self, fn: Callable[[Any], Any]) -> Any:
        """Run MLX work (prompt scoring) on the owner thread, mapping a lost model to 503."""
        try:
            return await self.runtime.run_on_model(fn)
        except ModelNotLoaded:
            raise model_not_loaded(self.runtime.state) from None

    async def on_tokenizer(self, fn: Callable[[Any], Any]) -> Any:
        """Run tokenizer-only work (chat template, encode, decode) in a worker thread.

        Not on the owner thread: a job there waits for a scheduler turn, and a request's
        template (or a count_tokens call) needs no MLX. No MLX is
        touched; one call at a time keeps the HF tokenizer's internals single-threaded here.
        """
        model = self.require_model(None)
        return await trio.to_thread.run_sync(fn, model, limiter=self._tokenizer_limiter)

    async def count_chat_tokens(self, requested: str | None, conversation: Conversation) -> int:
        """Prompt tokens `conversation` renders to."""
        self.require_model(requested)
        rendered = await self.on_tokenizer(lambda m: chat_format.render_chat(m, conversation))
        return len(rendered.prompt_ids)

    async def plan_chat(self, endpoint: str, requested: str | None, conversation: Conversation,
                        params: GenParams) -> Plan:
        """Render a chat conversation and admit it."""
        model = self.require_model(requested)
        rendered = await self.on_tokenizer(lambda m: chat_format.render_chat(m, conversation))
        plan = self._plan(endpoint, model, rendered.prompt_ids, params)
        plan.request.images = rendered.images
        if self.receipts.log_prompts and conversation.messages:
            plan.client.prompt_excerpt = str(conversation.messages[-1].get("content") or "")
        plan.parse_tools = conversation.tools_active
        plan.tool_schemas = conversation.tool_schemas()
        plan.start_in_reasoning = rendered.start_in_reasoning
        plan.output_prefix = rendered.output_prefix
        plan.dialect = rendered.dialect
        plan.think_close_id = rendered.think_close_id
        return plan

    async def plan_prompt(self, endpoint: str, requested: str | None, prompt_ids: list[int],
                          params: GenParams) -> Plan:
        """Admit a raw prompt (legacy completions)."""
        model = self.require_model(requested)
        plan = self._plan(endpoint, model, prompt_ids, params)
        plan.raw_text = True
        if self.receipts.log_prompts:
            tail = prompt_ids[-64:]
            plan.client.prompt_excerpt = await self.on_tokenizer(lambda m: m.tokenizer.decode(tail))
        return plan

    def check_window(self, prompt_ids: list[int], *, output_tokens: int = 1,
                      param: str = "messages") -> ContextWindow:
        """The served context window, once `prompt_ids` and `output_tokens` more fit in it: a
        400 past the model's context, a 507 past what memory serves (before any prefill)."""
        if not prompt_ids:
            raise invalid("the prompt is empty", "prompt")
        window = served_window(self.runtime)
        prompt = len(prompt_ids)
        if window.model and prompt + output_tokens > window.model:
            raise context_length_exceeded(prompt, window.model, param)
        if window.limited_by == "memory" and prompt + output_tokens > window.served:
            # The model could take it; memory cannot: a 507 before any prefill, not a 400.
            raise _translate(self.runtime.guard.refuse_prompt(prompt, window))
        return window

    async def score_prompt(self, prompt_ids: list[int]) -> list[float | None]:
        """log p of each prompt token given those before it (legacy completions' echo with
        logprobs), admitted as a generation is: the context window, then the memory guard,
        priced with the float32 logits of every position a prefill chunk holds; while running
        requests hold what it needs it waits, as a queued request does."""
        self.check_window(prompt_ids, output_tokens=0, param="prompt")
        guard = getattr(self.runtime, "guard", None)
        reservation = None
        if guard is not None:
            model = self.require_model(None)
            logits_bytes = 2 * min(DEFAULT_PREFILL_CHUNK, len(prompt_ids)) * model.info.vocab_size * 4
            while reservation is None:
                try:
                    reservation = guard.try_admit(len(prompt_ids), 0, DEFAULT_PREFILL_CHUNK, extra_bytes=logits_bytes)
                except InsufficientMemory as refused:
                    raise _translate(refused) from None
                if reservation is None:
                    await trio.sleep(SCORE_WAIT_SECONDS)
        try:
            return await self.on_model(lambda m: m.score(prompt_ids))
        finally:
            if reservation is not None:
                reservation.release()

    def _plan(self, endpoint: str, model: Any, prompt_ids: list[int], params: GenParams) -> Plan:
        window = self.check_window(prompt_ids, param=PROMPT_FIELD.get(endpoint, "messages"))
        prompt = len(prompt_ids)
        room = (window.served or UNKNOWN_CONTEXT) - prompt
        # The client's cap is the user's intent; it is lowered (visibly) only to what fits.
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        defaults = generation_defaults(model.info.path)
        sampling = SamplingParams(
            temperature=_pick(params.temperature, defaults.get("temperature"), 1.0),
            top_p=_pick(params.top_p, defaults.get("top_p"), 1.0),
            top_k=int(_pick(params.top_k, defaults.get("top_k"), 0)),
            min_p=_pick(params.min_p, defaults.get("min_p"), 0.0),
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            seed=params.seed,
            max_tokens=max_tokens,
            stop=list(params.stop),
            ignore_eos=params.ignore_eos,
        )
        plan_id = self.flights.next_id(endpoint)
        # Arrival is stamped here, before any queue: TTFT and queue_wait count from it.
        request = GenerationRequest(prompt_ids=list(prompt_ids), sampling=sampling, depth=params.depth,
                                    session_id=session_id_from_headers(),
                                    arrived_at=time.perf_counter(), request_id=plan_id,
                                    repetition=self.loop_guard.policy_for(params),
                                    logprobs=params.logprobs)
        plan = Plan(id=plan_id, endpoint=endpoint, model_id=model.info.id, request=request,
                    max_tokens=max_tokens, max_tokens_requested=params.max_tokens,
                    client=current_client(), context_window=window.served or None)
        _remember_plan(plan)  # a refusal after this point is recorded with the plan's facts
        return plan

    def _flight(self, plan: Plan, stream: bool) -> Flight:
        return self.flights.begin(Flight(
            id=plan.id, endpoint=plan.endpoint, model=plan.model_id,
            prompt_tokens=len(plan.request.prompt_ids), max_tokens=plan.max_tokens,
            depth=plan.request.depth, stream=stream))

    # -- running --------------------------------------------------------------------------

    async def complete(self, plan: Plan) -> Outcome:
        """Run `plan` to the end (a disconnect cancels the handler, which stops the engine)."""
        flight = self._flight(plan, stream=False)
        parser = plan.new_parser()
        events: list[Event] = []
        logprobs: list[TokenLogprob] = []
        reasoning_tokens = 0
        result = None
        refused = False
        ending = "cancelled"  # unless a result or an error says otherwise
        try:
            async with self._generate(plan) as items:
                async for item in items:
                    if isinstance(item, TokenDelta):
                        fed, reasoning = feed_counting_reasoning(parser, item, plan.think_close_id)
                        reasoning_tokens += reasoning
                        events += fed
                        logprobs += item.logprobs or []
                        flight.on_delta(len(item.token_ids), item.text)
                    elif isinstance(item, GenerationResult):
                        result, ending = item, ""
        except Exception as exc:
            ending = "error"
            error = _translate(exc)
            refused = isinstance(error, APIError)  # the app's error handler records it
            raise error from exc
        finally:
            self.flights.end(flight)
            if ending:
                self.metrics.observe_unfinished(ending)
            if not (ending == "error" and refused):
                self._receipt(plan, flight, result, ending)
        if result is None:
            raise RuntimeError("the engine ended without a result")
        events += parser.finish()
        outcome = await self._outcome(plan, result, collect(events), reasoning_tokens)
        outcome.logprobs = logprobs if plan.request.logprobs is not None else None
        return outcome

    async def open_stream(self, plan: Plan) -> None:
        """Admit `plan` to the engine before any byte of a streamed response is sent, so that a
        refusal (507 from the memory guard, 503) is a real HTTP status, not a frame."""
        send, receive = trio.open_memory_channel(math.inf)
        scope = trio.CancelScope()
        try:
            await self._nursery().start(self._produce, plan, send, scope)
        except Exception as exc:
            raise _translate(exc) from exc
        plan.opened = _OpenStream(receive, scope)
        self._nursery().start_soon(self._cancel_if_never_read, plan)

    async def _cancel_if_never_read(self, plan: Plan) -> None:
        """A client that leaves between the admission and the response's first byte cancels
        the handler before its body starts, and nothing else would stop the generation: it
        would run to its cap unseen. Unless `stream` starts within STREAM_START_SECONDS, the
        generation is cancelled and recorded as the client's leaving."""
        opened = plan.opened
        with trio.move_on_after(STREAM_START_SECONDS):
            await opened.body_started.wait()
        if opened.body_started.is_set():
            return
        opened.abandoned = True
        opened.scope.cancel()
        opened.receive.close()
        flight = self._flight(plan, stream=True)
        self.flights.end(flight)
        self.metrics.observe_unfinished("cancelled")
        self._receipt(plan, flight, None, "cancelled")

    async def stream(self, plan: Plan) -> AsyncIterator[Tick | list[Event] | LogprobItems | Outcome]:
        """Run `plan` (opened by `open_stream`, or opened here), yielding parsed events as they
        are decided (each delta's LogprobItems first, when the request asked), TICKs while
        quiet, then the Outcome. Leaving the iteration early (a disconnect) cancels the engine."""
        if plan.opened is not None:
            plan.opened.body_started.set()
            if plan.opened.abandoned:  # cancelled and recorded already (_cancel_if_never_read)
                return
        flight = self._flight(plan, stream=True)
        ending = "cancelled"  # a client that leaves mid-stream; cleared by a result, set by errors
        try:
            if plan.opened is None:
                await self.open_stream(plan)
                plan.opened.body_started.set()
        except BaseException:
            self.flights.end(flight)
            self.metrics.observe_unfinished("error")
            self._receipt(plan, flight, None, "error")
            raise
        receive, scope = plan.opened.receive, plan.opened.scope
        parser = plan.new_parser()
        reasoning_tokens = 0
        calls: list[ToolCallEvent] = []
        result: GenerationResult | None = None
        last_sent = trio.current_time()
        try:
            async with receive:
                while True:
                    with trio.move_on_at(last_sent + self.keepalive_seconds) as waiting:
                        item = await receive.receive()
                    if waiting.cancelled_caught:
                        last_sent = trio.current_time()
                        yield TICK
                        continue
                    if isinstance(item, BaseException):
                        ending = "error"
                        raise _translate(item) from item
                    if isinstance(item, TokenDelta):
                        flight.on_delta(len(item.token_ids), item.text)
                        if item.logprobs:
                            yield LogprobItems(item.logprobs)
                        events, reasoning = feed_counting_reasoning(parser, item, plan.think_close_id)
                        reasoning_tokens += reasoning
                        calls += [e for e in events if isinstance(e, ToolCallEvent)]
                        if events:
                            last_sent = trio.current_time()
                            yield events
                    elif isinstance(item, GenerationResult):
                        result = item
                        tail = parser.finish()
                        calls += [e for e in tail if isinstance(e, ToolCallEvent)]
                        if tail:
                            yield tail
                        ending = ""
                        # The text was already streamed; the outcome needs only the calls.
                        sent = ParsedOutput(tool_calls=calls)
                        yield await self._outcome(plan, item, sent, reasoning_tokens)
                        return
        except trio.EndOfChannel:
            ending = "error"
            raise RuntimeError("the engine ended without a result") from None
        finally:
            scope.cancel()
            self.flights.end(flight)
            if ending:
                self.metrics.observe_unfinished(ending)
            self._receipt(plan, flight, result, ending)

    async def show_logprobs(self, entries: list[TokenLogprob]) -> list[Scored]:
        """`entries` with their tokens' text and bytes (tokenizer work, off the owner thread)."""
        pieces = await self.on_tokenizer(lambda m: token_pieces(m, ids_of(entries)))
        return scored(entries, pieces)

    async def _produce(self, plan: Plan, send: trio.MemorySendChannel, scope: trio.CancelScope,
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Background task: forward engine items; ends (and stops the engine) when cancelled.

        Reports started once the engine admitted the request; an admission error propagates
        to `open_stream`, later errors travel down the channel."""
        started = False
        async with send:
            with scope:
                try:
                    async with self._generate(plan) as items:
                        task_status.started()
                        started = True
                        async for item in items:
                            send.send_nowait(item)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                except Exception as exc:
                    if not started:
                        raise
                    try:
                        send.send_nowait(exc)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass

    def _receipt(self, plan: Plan, flight: Flight, result: GenerationResult | None,
                 ending: str) -> None:
        """The request's log line and flight record. `ending` is "" (a result came), "error",
        or "cancelled": with a result the engine cancelled it (unload, stop); without one the
        client left first."""
        if result is not None and ending != "error":
            outcome = "cancelled" if result.finish_reason == "cancelled" else "completed"
            status = 200
        elif ending == "cancelled":
            outcome, status = "disconnected", CLIENT_CLOSED
        else:
            outcome, status = "error", 200 if flight.stream else 500
        self.receipts.finished(plan, plan.client, result, outcome, status, flight)

    def _generate(self, plan: Plan):
        return self.runtime.generate(plan.request)

    async def _outcome(self, plan: Plan, result: GenerationResult, parsed: ParsedOutput,
                       reasoning_tokens: int) -> Outcome:
        self.metrics.observe_generation(result.stats)
        stop_sequence = None
        stops = plan.request.sampling.stop
        # A stop string ends the output without consuming an end-of-sequence token.
        if result.finish_reason == "stop" and stops and result.stats.completion_tokens == len(result.token_ids):
            full = await self.on_tokenizer(lambda m: m.tokenizer.decode(result.token_ids))
            stop_sequence = _which_stop(full, result.text, stops)
        return Outcome(plan, result, parsed, reasoning_tokens, stop_sequence)


# Clients that name their conversation (OpenCode sends both of the last two); first wins.
SESSION_HEADERS = ("x-mtplx-session-id", "x-session-affinity", "x-session-id")


def session_id_from_headers() -> str | None:
    """The conversation id the current HTTP request names in a session header, if any
    (the session bank groups its entries by it; prefix reuse works without one)."""
    from quart import has_request_context, request

    if not has_request_context():
        return None
    for name in SESSION_HEADERS:
        value = request.headers.get(name, "").strip()
        if value:
            return value[:256]
    return None


def current_client() -> Client:
    """Who sent the current HTTP request (stamped by the app as it arrived); a blank Client
    outside a request."""
    from quart import g, has_request_context

    if not has_request_context():
        return Client(started=time.perf_counter(), wall=time.time())
    client = g.get("mtplx_client")
    return client if client is not None else Client(started=time.perf_counter(), wall=time.time())


def _remember_plan(plan: Plan) -> None:
    from quart import g, has_request_context

    if has_request_context():
        g.mtplx_plan = plan


@dataclass
class _OpenStream:
    """The engine side of an admitted streamed generation. `body_started`: the response's
    body is being sent (`stream` runs); `abandoned`: it never started, and the generation
    was cancelled for it (`_cancel_if_never_read`)."""

    receive: trio.MemoryReceiveChannel
    scope: trio.CancelScope
    body_started: trio.Event = field(default_factory=trio.Event)
    abandoned: bool = False


def served_window(runtime: Runtime) -> ContextWindow:
    """The loaded model's context window: the model's own, and what this server serves of it
    under the memory limit (the same numbers `daemon.status` and `/v1/models` advertise, so a
    client that trusts them never meets a 507 for a request that fits)."""
    info = runtime.info() or {}
    return context_window(int(info.get("context_length") or 0), getattr(runtime, "guard", None))


def _which_stop(full: str, text: str, stops: list[str]) -> str | None:
    tail = full[len(text):] if full.startswith(text) else full
    for stop in stops:
        if tail.startswith(stop):
            return stop
    hits = [(full.find(stop, max(len(text) - len(stop), 0)), stop) for stop in stops]
    hits = [h for h in hits if h[0] >= 0]
    return min(hits)[1] if hits else None


def _pick(value: Any, default: Any, fallback: Any) -> Any:
    if value is not None:
        return value
    return default if default is not None else fallback


def feed_counting_reasoning(parser: OutputParser, delta: TokenDelta,
                            think_close_id: int | None = None) -> tuple[list[Event], int]:
    """The parser's events for `delta`, and how many of its tokens are reasoning: the
    reasoning block's own tokens, its `<think>` and `</think>` included. A delta that closes
    the reasoning (an MTP cycle commits several tokens at once, so it may also carry the
    answer's first ones) counts through its `think_close_id` token where the model has one,
    so the count does not depend on the draft depth."""
    was_reasoning, had_ended = parser.in_reasoning, parser.reasoning_ended
    events = parser.feed(delta.text)
    ids = delta.token_ids
    if parser.reasoning_ended and not had_ended:
        return events, ids.index(think_close_id) + 1 if think_close_id in ids else len(ids)
    return events, len(ids) if was_reasoning or parser.in_reasoning else 0


def _translate(exc: BaseException) -> BaseException:
    """Engine-side failures as API errors where they have a meaning for the client."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ModelNotLoaded):
        return model_not_loaded("none")
    if isinstance(exc, GroupLost):
        return group_lost(str(exc))
    if isinstance(exc, QueueFull):
        return queue_full(exc.queued, exc.retry_after_seconds)
    if isinstance(exc, InsufficientMemory):
        details = {k: v for k, v in exc.to_dict().items() if k not in ("type", "message")}
        return APIError(507, str(exc), code="insufficient_memory", details=details)
    if isinstance(exc, MemoryError):
        # MLX failing to allocate: the same answer as the guard's refusal.
        return APIError(507, str(exc) or "not enough memory for this request",
                        code="insufficient_memory")
    if isinstance(exc, ValueError):
        return invalid(str(exc), None)
    return exc
