"""`mtplxctl trace` over what a real daemon recorded: an agent's turns grouped by its session
id, the turn that extended the conversation reused the cache, the turn whose history was
rewritten is a miss saying where it diverged, a refusal is on the timeline, and the HTML
report opens from a file with nothing fetched from the network."""

from __future__ import annotations

import json
import re
import time

import openai
import pytest

from mtplxd.flight import read_records
from support.api_daemon import MODEL_ID, ctl_in, start_api_daemon

SYSTEM = "You are a careful coding agent. " + " ".join(f"rule{i}: keep the code tidy." for i in range(60))
# A pasted file: long enough (several 256-token blocks) that dropping it shows as a divergence.
CODE = "fix the bug in this file:\n" + "\n".join(f"def f{i}(x):\n    return x + {i}" for i in range(80))


@pytest.fixture(scope="module")
def session_home(tiny_checkpoint, tmp_path_factory):
    home = tmp_path_factory.mktemp("trace-home")
    daemon = start_api_daemon(home, MTPLX_MODEL=str(tiny_checkpoint))
    client = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="none", max_retries=0,
                           default_headers={"x-session-id": "agent-42", "User-Agent": "opencode/1.18"})
    try:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": CODE}]
        for turn in range(2):
            reply = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=8,
                                                   temperature=0)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or "ok"},
                         {"role": "user", "content": f"and now step {turn + 2}"}]
        # Compaction: the agent rewrites the history after the system prompt.
        rewritten = [messages[0], {"role": "user", "content": "summary so far: a bug was fixed"}]
        client.chat.completions.create(model=MODEL_ID, messages=rewritten, max_tokens=8, temperature=0)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gone", messages=rewritten, max_tokens=8)
        deadline = time.monotonic() + 15
        while len(list(read_records(home / "metrics"))) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        daemon.stop()
    return home


def test_the_list_shows_the_agents_session(session_home):
    listed = json.loads(ctl_in(session_home, "trace", "--json").stdout)
    [session] = listed["sessions"]
    assert session["session_id"] == "agent-42" and session["turns"] == 4 and session["refused"] == 1
    human = ctl_in(session_home, "trace")
    assert human.returncode == 0 and session["id"] in human.stdout and "opencode/1.18" in human.stdout


def test_one_session_is_diagnosed_turn_by_turn(session_home):
    result = ctl_in(session_home, "trace", "1", "--json", "--stall-seconds", "30")
    assert result.returncode == 0, result.stderr
    analysis = json.loads(result.stdout)
    turns = analysis["turns"]
    assert [t["outcome"] for t in turns] == ["completed", "completed", "completed", "refused"]
    first, second, third, refused = turns
    assert first["cache"] == "first turn: nothing to reuse yet"
    # The second turn extends the first: its shared prefix came from the session bank.
    assert second["shared_with_previous"] >= 256 and second["reused_tokens"] >= second["shared_with_previous"] - 256
    assert second["cache"] == "hit" and second["restored_from"] in ("ram", "ssd")
    # The third kept the system prompt and rewrote the rest: a miss that says where.
    assert third["cache"].startswith("diverged: the prompt differs from the previous turn's from about token")
    assert third["cache"].endswith("what came before it was reused") and third["reused_tokens"] >= 256
    assert refused["status"] == 404 and refused["cache"] == "refused before any prefill"
    assert analysis["samples"] and all(s["tok_s"] > 0 for s in analysis["samples"])
    assert analysis["totals"]["prompt_tokens"] == sum(t["prompt_tokens"] for t in turns[:3])


def test_the_html_report_is_self_contained(session_home):
    summary = ctl_in(session_home, "trace", "1")
    assert summary.returncode == 0, summary.stderr
    assert "cache reuse" in summary.stdout and "diverged" in summary.stdout
    report = next((session_home / "metrics").glob("trace-*.html"))
    html = report.read_text()
    assert html.startswith("<!doctype html>") and html.count("<svg") == 5
    assert "draft and verify time per cycle" in html
    # Nothing to fetch: no script or stylesheet source, no link; the only URL is SVG's namespace.
    assert not re.search(r"<(script|link|img|iframe)\b", html)
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) == {"http://www.w3.org/2000/svg"}


def test_flight_samples_carry_the_draft_verify_split(session_home):
    """An MTP request's first decode sample on disk names its timed cycle's draft and verify
    time (the first cycle is always timed), and every split fits in its sample's window;
    trace --json carries them per sample and per turn."""
    records = [r for r in read_records(session_home / "metrics") if r["outcome"] == "completed"]
    assert records and all(r["depth_used"] > 0 and r["samples"] for r in records)
    assert all("split_source" in r["samples"][0] for r in records)
    for sample in (s for r in records for s in r["samples"] if "split_source" in s):
        assert sample["split_source"] == "sampled" and sample["split_cycles"] >= 1
        assert sample["draft_ms"] > 0 and sample["verify_ms"] > 0
        split_ms = (sample["draft_ms"] + sample["verify_ms"]) * sample["split_cycles"]
        assert split_ms <= sample["seconds"] * 1000 + 0.5  # `seconds` is rounded to the ms
    analysis = json.loads(ctl_in(session_home, "trace", "1", "--json").stdout)
    assert all(s["draft_ms"] > 0 and s["verify_ms"] > 0 for s in analysis["samples"]
               if s["split_source"] is not None)
    ran = [t for t in analysis["turns"] if t["outcome"] == "completed"]
    assert all(t["draft_ms"] > 0 and t["verify_ms"] > 0 and t["split_source"] == "sampled" for t in ran)
    refused = analysis["turns"][-1]
    assert refused["draft_ms"] is None and refused["verify_ms"] is None
    summary = ctl_in(session_home, "trace", "1").stdout
    assert "draft/verify ms" in summary and f"{ran[0]['draft_ms']:.1f}/{ran[0]['verify_ms']:.1f}" in summary


def test_an_unknown_session_is_one_sentence(session_home):
    result = ctl_in(session_home, "trace", "zzzz")
    assert result.returncode == 1 and "there is no session zzzz on record" in result.stderr
