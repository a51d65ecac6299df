"""What each request leaves behind: one line in `logs/mtplxd.log` and one flight record.

Every request that reaches a route ends here exactly once: a generation when it finishes
(completed, cancelled, cut off by its client, failed), anything else when it is refused with
its 4xx/5xx. The log line is for `mtplxctl logs -f`; the record (mtplxd/flight.py) is what
`mtplxctl trace` reads. No prompt text is logged unless `log_prompts = true`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mtplxd.flight import FlightRecorder
from mtplxd.logs import printable

if TYPE_CHECKING:  # importing the engine loads MLX: `mtplxctl trace` reads PREFIX_BLOCK only
    from mtplxd.engine.interface import GenerationResult

log = logging.getLogger("mtplxd.requests")

# Prompt blocks hashed for `trace`: two turns that share their first N blocks share N*256
# prompt tokens, which says whether a cache miss was a rewritten history or a lost entry.
PREFIX_BLOCK = 256
PROMPT_EXCERPT_CHARS = 200
CLIENT_CLOSED = 499  # nginx's "client closed request": the client left before the end


@dataclass
class Client:
    """Who sent the request, read while its HTTP context is live."""

    method: str = ""
    path: str = ""
    user_agent: str | None = None
    session_id: str | None = None
    started: float = 0.0  # perf_counter at arrival
    wall: float = 0.0  # time.time() at arrival
    prompt_excerpt: str | None = None  # only with log_prompts


def prefix_hashes(prompt_ids: list[int], block: int = PREFIX_BLOCK) -> list[str]:
    """Chained hashes of the prompt's whole `block`-token blocks (8 hex digits each): equal
    first k entries mean equal first k*block tokens."""
    out: list[str] = []
    digest = hashlib.blake2b(digest_size=8)
    for start in range(0, len(prompt_ids) - block + 1, block):
        digest.update(b"".join(t.to_bytes(4, "little", signed=False) for t in prompt_ids[start:start + block]))
        out.append(digest.copy().hexdigest()[:8])
    return out


class Receipts:
    """Writes the log line and the flight record of each request."""

    def __init__(self, recorder: FlightRecorder | None, log_prompts: bool = False) -> None:
        self.recorder = recorder
        self.log_prompts = log_prompts

    def finished(self, plan: Any, client: Client, result: GenerationResult | None, outcome: str,
                 status: int, flight: Any = None) -> None:
        """A generation ended: `outcome` is completed, cancelled, disconnected or error."""
        request = plan.request
        entry: dict[str, Any] = {
            "id": plan.id, **_client_fields(client), "endpoint": plan.endpoint,
            "model": plan.model_id, "status": status, "outcome": outcome,
            "stream": bool(flight.stream) if flight is not None else None,
            "prompt_tokens": len(request.prompt_ids), "max_tokens": plan.max_tokens,
            "max_tokens_requested": plan.max_tokens_requested,
            "context_window": plan.context_window,
            "depth": request.depth, "prefix_hashes": prefix_hashes(request.prompt_ids),
        }
        if result is not None:
            entry.update(_result_fields(result))
        elif flight is not None:  # no result reached the API: what the live board saw
            live = flight.snapshot(time.monotonic())
            entry.update({"finish_reason": None, "completion_tokens": live["completion_tokens"],
                          "ttft_s": live["ttft_seconds"],
                          "decode_tok_s": live["decode_tokens_per_second"],
                          "accepted_length": live["mean_accepted_length"], "samples": []})
        entry["duration_s"] = round(time.perf_counter() - client.started, 4)
        self._emit(entry, client)

    def refused(self, client: Client, status: int, code: str | None, message: str,
                param: str | None = None, plan: Any = None) -> None:
        """A request answered with an error status before (or instead of) generating."""
        entry: dict[str, Any] = {
            "id": plan.id if plan is not None else None, **_client_fields(client),
            "status": status, "outcome": "refused", "error": {"code": code, "param": param,
                                                              "message": message},
        }
        if plan is not None:
            entry.update({"endpoint": plan.endpoint, "model": plan.model_id,
                          "prompt_tokens": len(plan.request.prompt_ids),
                          "max_tokens": plan.max_tokens, "context_window": plan.context_window,
                          "prefix_hashes": prefix_hashes(plan.request.prompt_ids)})
        entry["duration_s"] = round(time.perf_counter() - client.started, 4)
        self._emit(entry, client)

    def _emit(self, entry: dict[str, Any], client: Client) -> None:
        log.info("%s", request_line(entry, client.prompt_excerpt if self.log_prompts else None))
        if self.recorder is not None:
            self.recorder.record(entry)


def request_line(entry: dict[str, Any], prompt: str | None = None) -> str:
    """The one log line of a request: method, path, model, status, tokens, TTFT, tok/s,
    duration (and the error or the finish when it is not a plain completion)."""
    parts = [printable(entry.get("method") or "-"), printable(entry.get("path") or "-"),
             str(entry["status"])]
    if entry.get("model"):
        parts.append(f"model={printable(entry['model'])}")
    if entry.get("prompt_tokens") is not None:
        parts.append(f"prompt={entry['prompt_tokens']}")
    if entry.get("completion_tokens") is not None:
        parts.append(f"completion={entry['completion_tokens']}")
    if entry.get("cached_tokens"):
        parts.append(f"cached={entry['cached_tokens']}")
    if entry.get("ttft_s") is not None:
        parts.append(f"ttft={entry['ttft_s']:.3f}s")
    if entry.get("decode_tok_s"):
        parts.append(f"tok/s={entry['decode_tok_s']:.1f}")
    parts.append(f"duration={entry['duration_s']:.3f}s")
    if entry["outcome"] == "refused":
        error = entry["error"]
        param = f" ({printable(error['param'])})" if error.get("param") else ""
        parts.append(f"refused: {error.get('code') or 'error'}{param}: {printable(error['message'])}")
    elif entry["outcome"] != "completed" or entry.get("finish_reason") not in (None, "stop"):
        parts.append(f"{entry['outcome']}" + (f" finish={entry['finish_reason']}"
                                              if entry.get("finish_reason") else ""))
    if prompt:
        parts.append(f"prompt_text={printable(prompt)!s:.{PROMPT_EXCERPT_CHARS + 2}}")
    return " ".join(parts)


def _client_fields(client: Client) -> dict[str, Any]:
    return {"arrived": round(client.wall, 3), "method": client.method, "path": client.path,
            "client": {"user_agent": client.user_agent, "session_id": client.session_id}}


def _result_fields(result: GenerationResult) -> dict[str, Any]:
    stats = result.stats
    return {
        "finish_reason": result.finish_reason,
        "completion_tokens": stats.completion_tokens,
        "cached_tokens": stats.cached_tokens,
        "queue_wait_s": round(stats.queue_wait_seconds, 4),
        "prefill": {"tokens": stats.prompt_tokens - stats.cached_tokens,
                    "seconds": round(stats.prefill_seconds, 4), "chunks": stats.prefill_chunks,
                    "tok_s": round(stats.prefill_tokens_per_second, 2)},
        "restore": {"from": stats.restored_from, "reused_tokens": stats.cached_tokens},
        "ttft_s": round(stats.ttft_seconds, 4),
        "decode_s": round(stats.decode_seconds, 4),
        "decode_tok_s": round(stats.decode_tokens_per_second, 2),
        "depth_used": stats.depth,
        "accepted_length": round(stats.mean_accepted_length, 3),
        "drafted_by_depth": stats.drafted_by_depth,
        "accepted_by_depth": stats.accepted_by_depth,
        "cycles": stats.cycles,
        "rows_max": stats.rows_max,
        "repetition_stop": stats.repetition_stop,  # the runaway-loop guard ended it
        "repetition_period": stats.repetition_period,
        "repetition_trimmed_tokens": stats.repetition_trimmed_tokens,
        "samples": stats.samples,
    }
