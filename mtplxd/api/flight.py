"""Live view of in-flight requests (`GET /v1/mtplx/flight`).

Each generation registers a `Flight` when it is admitted and updates it as tokens commit;
the endpoint lists the running ones with their phase, decode rate, live acceptance and how
long since the last token (a stall shows as a growing `stall_seconds`).

Live acceptance is measured from what the engine streams: every decode cycle commits its
accepted drafts plus one token as one delta, so committed tokens per delta is the running
mean accepted length (exact at the end, from the engine's stats).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

TAIL_CHARS = 80


@dataclass
class Flight:
    """One running request."""

    id: str
    endpoint: str
    model: str
    prompt_tokens: int
    max_tokens: int
    depth: int | None
    stream: bool
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0
    deltas: int = 0
    tail: str = ""

    def on_delta(self, token_count: int, text: str) -> None:
        """Record committed tokens."""
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        elif token_count:
            self.deltas += 1  # decode cycles after the prefill's first token
        self.last_token_at = now
        self.tokens += token_count
        self.tail = (self.tail + text)[-TAIL_CHARS:]

    def snapshot(self, now: float) -> dict[str, Any]:
        """The JSON the endpoint shows for this request."""
        decoding = self.first_token_at is not None
        decode_s = (self.last_token_at or now) - self.first_token_at if decoding else 0.0
        decoded = max(self.tokens - 1, 0)
        return {
            "id": self.id,
            "endpoint": self.endpoint,
            "model": self.model,
            "phase": "decode" if decoding else "prefill",
            "stream": self.stream,
            "age_seconds": round(now - self.started, 3),
            "ttft_seconds": round(self.first_token_at - self.started, 3) if decoding else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "max_tokens": self.max_tokens,
            "depth": self.depth,
            "decode_tokens_per_second": round(decoded / decode_s, 2) if decode_s > 0 else None,
            "mean_accepted_length": round(decoded / self.deltas, 3) if self.deltas else None,
            "stall_seconds": round(now - (self.last_token_at or self.started), 3),
            "text_tail": self.tail,
        }


class FlightBoard:
    """The set of running requests."""

    def __init__(self) -> None:
        self._running: dict[str, Flight] = {}
        self._ids = itertools.count(1)

    def next_id(self, prefix: str) -> str:
        """A request id unique within this daemon's life."""
        return f"{prefix}-{int(time.time())}-{next(self._ids)}"

    def begin(self, flight: Flight) -> Flight:
        self._running[flight.id] = flight
        return flight

    def end(self, flight: Flight) -> None:
        self._running.pop(flight.id, None)

    def snapshot(self, scheduler: dict[str, Any] | None = None) -> dict[str, Any]:
        """What `GET /v1/mtplx/flight` returns; with the scheduler's status, each request
        carries its scheduler row (phase queued/prefill/decode, queue wait, steps) and the
        answer the scheduler's rows and limits."""
        now = time.monotonic()
        rows = {r["request_id"]: r for r in (scheduler or {}).get("rows", [])}
        requests = []
        for flight in self._running.values():
            entry = flight.snapshot(now)
            row = rows.get(flight.id)
            if row is not None:
                entry["row"] = row
                if row["phase"] == "queued":
                    entry["phase"] = "queued"
            requests.append(entry)
        answer = {"object": "mtplx.flight", "running": len(requests), "requests": requests}
        if scheduler is not None:
            answer["scheduler"] = {k: v for k, v in scheduler.items() if k != "rows"}
        return answer
