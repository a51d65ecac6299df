"""The runaway-loop guard through the real daemon: a scripted model that loops forever, read by
the real openai and anthropic clients."""

from __future__ import annotations

import time

import httpx

from mtplxd.api.service import LoopGuard
from mtplxd.api.schemas import GenParams
from mtplxd.config import load_config
from mtplxd.flight import read_records
from support.api_daemon import daemon_fixture, scripted

MODEL_ID = "scripted-loop"
LOOP = ["Here is the list:", " alpha", " beta", " gamma", " delta"]
USER = [{"role": "user", "content": "list the letters"}]


api = daemon_fixture(scripted(MODEL_ID, LOOP, loop_to=1))


def test_an_uncapped_loop_ends_as_length_with_repetition_stop_and_streams_no_repeats(api):
    whole = api.openai.chat.completions.create(model=MODEL_ID, messages=USER)
    stats = whole.model_extra["mtplx_stats"]
    assert whole.choices[0].finish_reason == "length"
    assert stats["repetition_stop"] and stats["repetition_period"] == 4
    assert stats["completion_tokens"] < 200  # the context is 4096: it would have run to the end
    text = whole.choices[0].message.content
    assert text.startswith("Here is the list: alpha beta gamma delta alpha")
    # (The SDK's stream helper refuses to parse a `length` finish, so the plain stream is read.)
    chunks = list(api.openai.chat.completions.create(model=MODEL_ID, messages=USER, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The repeats that were held back were dropped: the stream never carried more than the answer.
    assert streamed == text
    assert chunks[-1].choices[0].finish_reason == "length"
    metrics = httpx.get(api.base_url + "/metrics").text
    assert "mtplx_repetition_stops_total 2.0" in metrics
    # The flight recorder keeps the stop, so `mtplxctl trace` can flag the turn afterwards.
    deadline = time.monotonic() + 30
    while len(stopped := [r for r in read_records(api.home / "metrics") if r.get("repetition_stop")]) < 2:
        assert time.monotonic() < deadline, "the flight records of the two stopped turns never arrived"
        time.sleep(0.05)
    assert {r["repetition_period"] for r in stopped} == {4}
    assert all(r["finish_reason"] == "length" and r["repetition_trimmed_tokens"] > 0 for r in stopped)


def test_a_capped_request_runs_to_its_cap_unless_it_asks_for_the_guard(api):
    capped = api.openai.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=300)
    assert capped.usage.completion_tokens == 300
    assert not capped.model_extra["mtplx_stats"]["repetition_stop"]
    guarded = api.openai.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=300,
                                                 extra_body={"repetition_guard": True})
    assert guarded.model_extra["mtplx_stats"]["repetition_stop"]
    assert guarded.usage.completion_tokens < 300


def test_the_per_request_off_switch_lets_an_uncapped_loop_run(api):
    loop = "gamma delta alpha beta " * 8
    reply = api.openai.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=None,
                                               extra_body={"repetition_guard": False}, stop=[loop.rstrip()])
    # Stopped by the stop string (32 repeats in), not by the guard.
    assert reply.choices[0].finish_reason == "stop"
    assert not reply.model_extra["mtplx_stats"]["repetition_stop"]


def test_anthropic_sees_max_tokens_when_the_guard_ends_a_loop(api):
    reply = api.anthropic.messages.create(model=MODEL_ID, max_tokens=2000, messages=USER,
                                          extra_body={"repetition_guard": True})
    assert reply.stop_reason == "max_tokens"
    assert reply.model_extra["mtplx_stats"]["repetition_stop"]
    assert reply.usage.output_tokens < 2000


def test_config_chooses_which_requests_get_the_guard(tmp_path):
    config_file = tmp_path / "config.toml"
    config_file.write_text('repetition_guard = "off"\nrepetition_min_tokens = 64\n')
    guard = LoopGuard.from_config(load_config(config_file, environ={}))
    assert guard.policy_for(GenParams()) is None
    assert guard.policy_for(GenParams(repetition_guard=True)).min_tokens == 64
    on = LoopGuard.from_config(load_config(config_file, environ={"MTPLX_REPETITION_GUARD": "on"}))
    assert on.policy_for(GenParams(max_tokens=10)) is not None
    auto = LoopGuard.from_config(load_config(tmp_path / "absent.toml", environ={}))
    assert auto.policy_for(GenParams()) is not None and auto.policy_for(GenParams(max_tokens=10)) is None
    # An agent's standing cap (Claude Code, Hermes: 32,768; OpenCode: 32,000) counts as none.
    assert auto.policy_for(GenParams(max_tokens=32000)) is not None
    assert auto.policy_for(GenParams(max_tokens=LoopGuard.AGENT_SIZED_CAP - 1)) is None
    assert auto.policy_for(GenParams(max_tokens=32000, repetition_guard=False)) is None
