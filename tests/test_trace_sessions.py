"""`mtplxctl trace`'s reading of flight records: sessions without an id are grouped by client,
first prompt block and time; each cache verdict and pathology flag fires on the records that
show it (records shaped as the daemon writes them, see tests/api/test_trace_e2e.py)."""

from __future__ import annotations

from mtplxd.api.receipts import prefix_hashes
from mtplxctl.trace.sessions import SESSION_GAP, analyse, group_sessions

SYSTEM = list(range(1000, 1000 + 4096))


def record(at: float, prompt: list[int], reused: int = 0, agent: str = "pi/0.73", sid=None, **extra):
    base = {
        "id": f"chat-{at}", "arrived": at, "method": "POST", "path": "/v1/chat/completions",
        "client": {"user_agent": agent, "session_id": sid}, "model": "m", "status": 200,
        "outcome": "completed", "finish_reason": "stop", "prompt_tokens": len(prompt),
        "completion_tokens": 20, "context_window": 32768, "prefix_hashes": prefix_hashes(prompt),
        "restore": {"from": "ram" if reused else "cold", "reused_tokens": reused},
        "prefill": {"tokens": len(prompt) - reused, "seconds": 0.5, "chunks": 1},
        "queue_wait_s": 0.0, "decode_s": 1.0, "ttft_s": 0.5, "decode_tok_s": 19.0,
        "accepted_length": 2.0, "duration_s": 1.6, "samples": [],
    }
    base.update(extra)
    return base


def test_sessions_without_an_id_split_by_client_prefix_and_silence():
    other = list(range(5000, 5300))
    records = [
        record(0, SYSTEM + [1]), record(10, SYSTEM + [1, 2], reused=4096),
        record(20, other + [1], agent="hermes/0.19"),  # another agent at the same time
        record(30 + SESSION_GAP, SYSTEM + [1, 2, 3]),  # back after a long silence: a new one
        record(40, SYSTEM + [9], sid="abc"), record(50, other, sid="abc"),  # named: one session
    ]
    junk = [{"arrived": "yesterday"}, {"arrived": 5, "client": "me"}, {"v": 1}]
    sessions = group_sessions(records + junk)
    assert [len(s.records) for s in sessions] == [2, 1, 2, 1]
    assert len({s.id for s in sessions}) == 4


def test_a_lost_cache_entry_is_a_miss_and_a_long_cold_reprefill_is_flagged():
    turns = analyse(group_sessions([record(0, SYSTEM + [1]), record(5, SYSTEM + [1, 2], reused=0)])[0])["turns"]
    assert turns[1]["cache"].startswith("miss: 4096 tokens matched the previous turn but only 0")
    assert [f["kind"] for f in turns[1]["flags"]] == ["cold_reprefill"]


def test_a_turn_after_a_short_first_prompt_is_no_miss_from_the_start():
    """A first prompt under one block has no block hashes: the next turn cannot be compared
    with it, which is not "differs from its start" (seen on a real 245-token first turn)."""
    short = list(range(200))
    turns = analyse(group_sessions([record(0, short, sid="s"), record(5, short + list(range(300)), reused=199, sid="s")])[0])["turns"]
    assert turns[1]["cache"] == "hit"
    turns = analyse(group_sessions([record(0, short, sid="s"), record(5, short + list(range(300)), sid="s")])[0])["turns"]
    assert turns[1]["cache"].startswith("short prompt")


def test_stalls_context_near_the_limit_507_and_disconnects_are_flagged():
    records = [
        record(0, SYSTEM, queue_wait_s=12.0, samples=[{"t": 1, "seconds": 14.0, "tok_s": 1.0}]),
        record(30, SYSTEM + [1] * 25000, reused=29000, context_window=30000),
        record(40, SYSTEM, status=507, outcome="refused", error={"code": "insufficient_memory"}),
        record(50, SYSTEM, reused=4096, outcome="disconnected", status=499),
    ]
    analysis = analyse(group_sessions(records)[0], stall_seconds=10)
    kinds = [(f["turn"], f["kind"]) for f in analysis["flags"]]
    assert kinds == [(1, "stall"), (1, "stall"), (2, "context_near_limit"),
                     (3, "insufficient_memory"), (4, "disconnected")]
    assert analysis["totals"]["queue_s"] == 12.0  # the refused turn counts no time


def test_a_turn_the_loop_guard_stopped_is_flagged_with_its_period():
    stopped = record(0, SYSTEM, finish_reason="length", repetition_stop=True, repetition_period=4,
                     repetition_trimmed_tokens=40)
    capped = record(10, SYSTEM + [1], reused=4096, finish_reason="length")  # a plain output cap
    turns = analyse(group_sessions([stopped, capped])[0])["turns"]
    assert turns[0]["flags"] == [{"kind": "repetition_stop", "text": "the loop guard stopped it "
                                  "repeating a 4-token span (40 repeated tokens trimmed)"}]
    assert turns[1]["flags"] == []


def test_a_turns_draft_verify_split_is_the_mean_over_its_timed_cycles():
    split = {"split_source": "sampled"}
    mtp = [{"t": 1, "seconds": 1.0, "tok_s": 50, "draft_ms": 2.0, "verify_ms": 6.0, "split_cycles": 1, **split},
           {"t": 2, "seconds": 1.0, "tok_s": 50, "draft_ms": 5.0, "verify_ms": 9.0, "split_cycles": 2, **split},
           {"t": 2.2, "seconds": 0.2, "tok_s": 40}]  # the last window's timed cycle never ran
    ar = [{"t": 1, "seconds": 1.0, "tok_s": 30}]
    analysis = analyse(group_sessions([record(0, SYSTEM + [1], samples=mtp),
                                       record(5, SYSTEM + [1, 2], reused=4096, samples=ar)])[0])
    first, second = analysis["turns"]
    assert (first["draft_ms"], first["verify_ms"], first["split_source"]) == (4.0, 8.0, "sampled")
    assert (second["draft_ms"], second["verify_ms"], second["split_source"]) == (None, None, None)
    assert [s["draft_ms"] for s in analysis["samples"]] == [2.0, 5.0, None, None]


def test_the_report_shows_the_split_as_bars_or_says_why_there_is_none():
    from mtplxctl.trace.report import render_html

    split = {"draft_ms": 2.0, "verify_ms": 6.0, "split_cycles": 1, "split_source": "sampled"}
    mtp = analyse(group_sessions([record(0, SYSTEM + [1], samples=[{"t": 1, "seconds": 1.0, **split}])])[0])
    html = render_html(mtp | {"report": "x"})
    assert "turn 1 draft ms: 2" in html and "turn 1 verify ms: 6" in html
    ar = analyse(group_sessions([record(0, SYSTEM + [1], samples=[{"t": 1, "seconds": 1.0}])])[0])
    assert "no draft/verify split to show" in render_html(ar)
