"""From flight records to coding sessions: grouping, per-turn cache reuse and why a turn
missed the cache, and the pathology flags `mtplxctl trace` reports.

A session is the requests an agent sent for one conversation: those that name the same
session id (OpenCode and others send one), else those that share their first prompt block
(the system prompt and tools) from the same client with no pause longer than SESSION_GAP.
Everything here is plain data in, JSON-ready dicts out: the terminal summary, `--json` and the
HTML report all render the same answer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable

from mtplxd.api.receipts import PREFIX_BLOCK

SESSION_GAP = 30 * 60.0  # seconds of silence that end a session without an id
LONG_PROMPT = 4096  # a prompt this long that is prefilled again from cold is worth a flag
COLD_SHARE = 0.5  # "cold": less than this share of the prompt came from the cache
NEAR_LIMIT = 0.9  # a turn that filled this share of the context window
DEFAULT_STALL_SECONDS = 10.0
# What the session's samples keep of each flight sample; the split keys are absent (None here)
# for AR turns and windows with no timed cycle (mtplxd/engine/decoding/split.py).
SAMPLE_KEYS = ("tok_s", "accepted_length", "context", "cycle_ms", "draft_ms", "verify_ms",
               "split_source")


@dataclass
class Session:
    """One conversation's requests, in arrival order."""

    key: str
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def id(self) -> str:
        """A short stable id: from the key and the first arrival."""
        first = self.records[0].get("arrived") or 0
        return hashlib.sha1(f"{self.key}@{first}".encode()).hexdigest()[:8]

    @property
    def last(self) -> float:
        return float(self.records[-1].get("arrived") or 0)


def group_sessions(records: Iterable[dict[str, Any]], gap: float = SESSION_GAP) -> list[Session]:
    """Sessions, oldest first (by their first request)."""
    named: dict[str, Session] = {}
    open_by_head: dict[tuple, Session] = {}
    sessions: list[Session] = []
    for record in sorted(filter(_well_formed, records), key=lambda r: r.get("arrived") or 0):
        client = record.get("client") or {}
        sid = client.get("session_id")
        if sid:
            session = named.get(sid)
            if session is None:
                session = named[sid] = Session(f"session:{sid}")
                sessions.append(session)
        else:
            hashes = record.get("prefix_hashes") or []
            head = (client.get("user_agent"), record.get("model"), hashes[0] if hashes else None)
            session = open_by_head.get(head)
            if session is None or (record.get("arrived") or 0) - session.last > gap:
                session = open_by_head[head] = Session(f"prefix:{head}")
                sessions.append(session)
        session.records.append(record)
    return sessions


def _well_formed(record: dict[str, Any]) -> bool:
    """A record this version can read (a hand-edited or foreign line is left out)."""
    return (isinstance(record.get("arrived"), (int, float)) and isinstance(record.get("client") or {}, dict)
            and isinstance(record.get("prefix_hashes") or [], list)
            and isinstance(record.get("prompt_tokens") or 0, int))


def summary_row(session: Session) -> dict[str, Any]:
    """What the session list shows of one session."""
    records = session.records
    client = records[0].get("client") or {}
    generated = [r for r in records if r.get("outcome") != "refused"]
    prompt = sum(r.get("prompt_tokens") or 0 for r in generated)
    reused = sum((r.get("restore") or {}).get("reused_tokens") or 0 for r in generated)
    return {
        "id": session.id,
        "session_id": client.get("session_id"),
        "agent": client.get("user_agent"),
        "model": next((r.get("model") for r in records if r.get("model")), None),
        "started": records[0].get("arrived"),
        "ended": max((r.get("arrived") or 0) + (r.get("duration_s") or 0) for r in records),
        "turns": len(records),
        "refused": len(records) - len(generated),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "cache_reuse": round(reused / prompt, 3) if prompt else None,
    }


def analyse(session: Session, stall_seconds: float = DEFAULT_STALL_SECONDS) -> dict[str, Any]:
    """The whole diagnosis of one session: summary, turns, samples over time and flags."""
    start = float(session.records[0].get("arrived") or 0)
    turns: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for index, record in enumerate(session.records, 1):
        turn = _turn(index, record, previous, start)
        turn["flags"] = _flags(turn, record, stall_seconds)
        turns.append(turn)
        if record.get("outcome") != "refused":
            previous = record
    samples = [
        {"t": round(float(r.get("arrived") or 0) - start + s["t"], 3), "turn": i, **{
            k: s.get(k) for k in SAMPLE_KEYS}}
        for i, r in enumerate(session.records, 1) for s in (r.get("samples") or [])
    ]
    flags = [{"turn": t["turn"], **f} for t in turns for f in t["flags"]]
    return {"session": summary_row(session), "totals": _totals(turns), "turns": turns,
            "samples": samples, "flags": flags, "stall_seconds": stall_seconds}


def _turn(index: int, record: dict[str, Any], previous: dict[str, Any] | None,
          start: float) -> dict[str, Any]:
    restore = record.get("restore") or {}
    prefill = record.get("prefill") or {}
    prompt = record.get("prompt_tokens") or 0
    reused = restore.get("reused_tokens") or 0
    shared = _shared_tokens(record, previous)
    turn = {
        "turn": index,
        "id": record.get("id"),
        "at": round(float(record.get("arrived") or 0) - start, 3),
        "path": record.get("path"),
        "status": record.get("status"),
        "outcome": record.get("outcome"),
        "finish_reason": record.get("finish_reason"),
        "prompt_tokens": prompt,
        "completion_tokens": record.get("completion_tokens"),
        "reused_tokens": reused,
        "restored_from": restore.get("from"),
        "prefill_tokens": prefill.get("tokens"),
        "shared_with_previous": shared,
        "queue_s": record.get("queue_wait_s") or 0.0,
        "prefill_s": prefill.get("seconds") or 0.0,
        "decode_s": record.get("decode_s") or 0.0,
        "ttft_s": record.get("ttft_s"),
        "duration_s": record.get("duration_s"),
        "tok_s": record.get("decode_tok_s"),
        "accepted_length": record.get("accepted_length"),
        "context_window": record.get("context_window"),
        "error": (record.get("error") or {}).get("code"),
        **_cycle_split(record.get("samples") or []),
    }
    turn["cache"] = _cache_verdict(turn, previous)
    return turn


def _cycle_split(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The turn's draft and verify ms per cycle: the mean over its timed cycles (None for an
    AR turn, which drafts nothing, or one whose samples carry no split)."""
    timed = [s for s in samples if s.get("split_cycles")]
    cycles = sum(s["split_cycles"] for s in timed)
    if not cycles:
        return {"draft_ms": None, "verify_ms": None, "split_source": None}
    return {key: round(sum(s[key] * s["split_cycles"] for s in timed) / cycles, 3)
            for key in ("draft_ms", "verify_ms")} | {"split_source": timed[0].get("split_source")}


def _shared_tokens(record: dict[str, Any], previous: dict[str, Any] | None) -> int | None:
    """Prompt tokens this turn shares with the previous turn's prompt, to a block."""
    if previous is None:
        return None
    mine, theirs = record.get("prefix_hashes") or [], previous.get("prefix_hashes") or []
    blocks = 0
    for a, b in zip(mine, theirs):
        if a != b:
            break
        blocks += 1
    return blocks * PREFIX_BLOCK


def _cache_verdict(turn: dict[str, Any], previous: dict[str, Any] | None) -> str:
    """Why this turn reused what it did, in words (a hit says nothing more)."""
    if turn["outcome"] == "refused":
        return "refused before any prefill"
    prompt, reused, shared = turn["prompt_tokens"], turn["reused_tokens"], turn["shared_with_previous"]
    if previous is None:
        return f"first turn: reused {reused} tokens from {turn['restored_from']}" if reused else \
            "first turn: nothing to reuse yet"
    previous_prompt = previous.get("prompt_tokens") or 0
    if shared is None or min(prompt, previous_prompt) < PREFIX_BLOCK:
        # Prompts are compared a whole block at a time: a shorter one has nothing to compare.
        return "hit" if reused else "short prompt: too short to compare with the previous turn"
    if shared == 0:
        return ("miss: the prompt differs from the previous turn's from its start (a new system "
                "prompt, tool list or conversation)")
    lost = reused + PREFIX_BLOCK < shared
    if shared + PREFIX_BLOCK < previous_prompt:
        return (f"diverged: the prompt differs from the previous turn's from about token {shared} "
                "(the agent rewrote earlier history: compaction, an edited message, a changed "
                "system prompt or tool list); "
                + (f"only {reused} of the {shared} shared tokens came from the cache" if lost
                   else "what came before it was reused"))
    if not lost:
        return "hit"
    return (f"miss: {shared} tokens matched the previous turn but only {reused} came from the "
            "cache (its entry was evicted, the daemon restarted or the model reloaded, or the "
            "session bank is off)")


def _flags(turn: dict[str, Any], record: dict[str, Any], stall: float) -> list[dict[str, str]]:
    flags: list[dict[str, str]] = []

    def flag(kind: str, text: str) -> None:
        flags.append({"kind": kind, "text": text})

    prompt = turn["prompt_tokens"]
    if (turn["turn"] > 1 and turn["outcome"] != "refused" and prompt >= LONG_PROMPT
            and turn["reused_tokens"] < COLD_SHARE * prompt):
        flag("cold_reprefill", f"prefilled {turn['prefill_tokens']} of {prompt} prompt tokens "
                               f"again in {turn['prefill_s']:.1f}s ({turn['cache']})")
    if turn["queue_s"] > stall:
        flag("stall", f"waited {turn['queue_s']:.1f}s in the queue for a row")
    gaps = [s["seconds"] for s in record.get("samples") or [] if s.get("seconds", 0) > stall]
    if gaps:
        flag("stall", f"decode went {max(gaps):.1f}s between tokens")
    window = turn["context_window"]
    used = prompt + (turn["completion_tokens"] or 0)
    if window and used >= NEAR_LIMIT * window:
        flag("context_near_limit", f"{used} of the server's {window}-token context window")
    if record.get("repetition_stop"):
        flag("repetition_stop", f"the loop guard stopped it repeating a "
                                f"{record.get('repetition_period', 0)}-token span "
                                f"({record.get('repetition_trimmed_tokens', 0)} repeated tokens trimmed)")
    if turn["status"] == 507:
        flag("insufficient_memory", "refused with 507: the memory guard had no room")
    elif turn["status"] == 429:
        flag("queue_full", "refused with 429: the queue was full")
    if turn["outcome"] == "disconnected":
        flag("disconnected", "the client left before the answer ended")
    return flags


def _totals(turns: list[dict[str, Any]]) -> dict[str, Any]:
    ran = [t for t in turns if t["outcome"] != "refused"]
    prompt = sum(t["prompt_tokens"] for t in ran)
    reused = sum(t["reused_tokens"] for t in ran)
    decode_s = sum(t["decode_s"] for t in ran)
    produced = sum(max((t["completion_tokens"] or 0) - 1, 0) for t in ran)
    return {
        "queue_s": round(sum(t["queue_s"] for t in ran), 3),
        "prefill_s": round(sum(t["prefill_s"] for t in ran), 3),
        "decode_s": round(decode_s, 3),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "prefill_tokens": sum(t["prefill_tokens"] or 0 for t in ran),
        "completion_tokens": sum(t["completion_tokens"] or 0 for t in ran),
        "cache_reuse": round(reused / prompt, 3) if prompt else None,
        "decode_tok_s": round(produced / decode_s, 2) if decode_s > 0 else None,
    }
