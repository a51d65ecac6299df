"""Every request leaves one line in logs/mtplxd.log and one flight record under metrics/,
against a real daemon: completed, streamed, refused, cut off by its client; no prompt text
unless log_prompts; the recorder's off switches; a broken metrics folder loses records, never
requests."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from mtplxd.flight import read_records
from support.api_daemon import MODEL_ID, ApiDaemon, start_api_daemon

SECRET = "the prompt says pineapple"
# Greedy with negative penalties loops on the tiny model: a stream that lasts (AR, long).
ENDLESS = {"temperature": 0, "frequency_penalty": -2.0, "presence_penalty": -2.0, "mtp_depth": 0,
           "max_tokens": 4000}


def _wait_for(predicate, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _lines(daemon: ApiDaemon, needle: str) -> list[str]:
    log = daemon.home / "logs" / "mtplxd.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return [line for line in text.splitlines() if needle in line]


def _record(daemon: ApiDaemon, request_id: str) -> dict:
    def find():
        return next((r for r in read_records(daemon.home / "metrics") if r.get("id") == request_id), None)
    return _wait_for(find)


def _client(daemon: ApiDaemon, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="none", max_retries=0,
                         default_headers=headers)


@pytest.fixture(scope="module")
def logged(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    daemon = start_api_daemon(tmp_path_factory.mktemp("log-home"), MTPLX_MODEL=str(tiny_checkpoint))
    try:
        yield daemon
    finally:
        daemon.stop()


def test_a_completed_request_has_one_line_with_its_figures_and_no_prompt_text(logged):
    raw = _client(logged, **{"x-session-id": "sess-1"}).chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=[{"role": "user", "content": SECRET}], max_tokens=12, temperature=0)
    request_id = raw.headers["x-mtplx-request-id"]
    reply = raw.parse()
    lines = _wait_for(lambda: _lines(logged, f"model={MODEL_ID} prompt={reply.usage.prompt_tokens} "))
    assert len(lines) == 1
    line = lines[0]
    assert "mtplxd.requests: POST /v1/chat/completions 200 " in line
    assert f"completion={reply.usage.completion_tokens} " in line
    for field in ("ttft=", "tok/s=", "duration="):
        assert field in line, line
    assert "pineapple" not in (logged.home / "logs" / "mtplxd.log").read_text()

    record = _record(logged, request_id)
    assert record["outcome"] == "completed" and record["status"] == 200
    assert record["client"]["session_id"] == "sess-1"
    assert record["client"]["user_agent"].startswith("OpenAI/Python")
    assert record["prompt_tokens"] == reply.usage.prompt_tokens
    assert record["completion_tokens"] == reply.usage.completion_tokens
    assert record["restore"]["from"] in ("cold", "ram", "ssd")
    assert record["prefill"]["tokens"] == record["prompt_tokens"] - record["restore"]["reused_tokens"]
    assert record["queue_wait_s"] >= 0 and record["ttft_s"] > 0
    assert record["finish_reason"] in ("stop", "length")
    # The last decode window is always closed: its sample carries rate, acceptance, context.
    sample = record["samples"][-1]
    assert sample["context"] == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert sample["tok_s"] > 0 and len(sample["accepted_by_depth"]) == record["depth_used"]
    assert sum(s["tokens"] for s in record["samples"]) == reply.usage.completion_tokens - 1
    assert "pineapple" not in json.dumps(record)


def test_a_streamed_request_and_a_refused_one_are_recorded(logged):
    stream = _client(logged).chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hello"}], max_tokens=8, stream=True)
    request_id = stream.headers["x-mtplx-request-id"]
    list(stream.parse())
    assert _record(logged, request_id)["stream"] is True

    with pytest.raises(openai.NotFoundError):
        _client(logged).chat.completions.create(model="no-such-model", max_tokens=2,
                                                messages=[{"role": "user", "content": "hi"}])
    line = _wait_for(lambda: _lines(logged, "refused: model_not_found"))[-1]
    assert "POST /v1/chat/completions 404 " in line
    refused = _wait_for(lambda: [r for r in read_records(logged.home / "metrics")
                                 if r["outcome"] == "refused" and r["status"] == 404])
    assert refused[-1]["error"]["code"] == "model_not_found"


def test_a_client_that_leaves_mid_stream_is_recorded_as_disconnected(logged):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "go on"}], "stream": True,
            **ENDLESS}
    with httpx.Client(base_url=logged.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as answer:
            request_id = answer.headers["x-mtplx-request-id"]
            for i, _ in enumerate(answer.iter_lines()):
                if i > 10:
                    break
    record = _record(logged, request_id)
    assert record["outcome"] == "disconnected" and record["status"] == 499
    assert record["completion_tokens"] > 0
    assert _wait_for(lambda: _lines(logged, "POST /v1/chat/completions 499 "))


def test_log_prompts_puts_the_last_message_in_the_line(tiny_checkpoint, tmp_path):
    daemon = start_api_daemon(tmp_path / "home", MTPLX_MODEL=str(tiny_checkpoint),
                              MTPLX_LOG_PROMPTS="true")
    try:
        _client(daemon).chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": SECRET}], max_tokens=2)
        line = _wait_for(lambda: _lines(daemon, "POST /v1/chat/completions 200 "))[0]
        assert f"prompt_text={SECRET}" in line
    finally:
        daemon.stop()


def test_the_recorder_switched_off_writes_nothing_and_a_broken_folder_loses_only_records(
        tiny_checkpoint, tmp_path):
    off = start_api_daemon(tmp_path / "off", MTPLX_MODEL=str(tiny_checkpoint),
                           MTPLX_FLIGHT_RECORDER="off")
    try:
        _client(off).chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert _wait_for(lambda: _lines(off, "POST /v1/chat/completions 200 "))
        assert not list((off.home / "metrics").glob("flight*"))
        assert off.client.call("daemon.status")["flight_recorder"]["enabled"] is False
    finally:
        off.stop()

    # metrics/flight.jsonl is a folder: every write fails, every request still succeeds.
    (tmp_path / "broken" / "metrics" / "flight.jsonl").mkdir(parents=True)
    broken = start_api_daemon(tmp_path / "broken", MTPLX_MODEL=str(tiny_checkpoint))
    try:
        for _ in range(3):
            reply = _client(broken).chat.completions.create(
                model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert reply.choices[0].message is not None
        status = _wait_for(lambda: (lambda s: s if s["dropped"] >= 3 else None)(
            broken.client.call("daemon.status")["flight_recorder"]))
        assert status["written"] == 0
        exposed = httpx.get(broken.base_url + "/metrics").text
        assert "mtplx_flight_records_written 0.0" in exposed
        dropped = next(line for line in exposed.splitlines() if line.startswith("mtplx_flight_records_dropped "))
        assert float(dropped.split()[1]) >= 3
    finally:
        broken.stop()


def test_a_one_token_turn_and_two_requests_at_once_each_leave_one_record(logged):
    one = _client(logged).chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "one"}], max_tokens=1)
    record = _record(logged, one.headers["x-mtplx-request-id"])
    assert record["completion_tokens"] == 1 and record["samples"] == []  # nothing was decoded
    assert record["finish_reason"] == "length" and record["ttft_s"] > 0

    ids: list[str] = []

    def ask(prompt: str) -> None:
        raw = _client(logged).chat.completions.with_raw_response.create(
            model=MODEL_ID, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0)
        ids.append(raw.headers["x-mtplx-request-id"])

    threads = [threading.Thread(target=ask, args=(p,)) for p in ("first of two", "second of two")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(set(ids)) == 2
    records = [_record(logged, i) for i in ids]
    assert all(r["outcome"] == "completed" for r in records)


def test_a_prompt_over_the_context_is_recorded_as_refused(logged):
    with pytest.raises(openai.BadRequestError):
        _client(logged).chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "word " * 5000}], max_tokens=4)
    line = _wait_for(lambda: _lines(logged, "refused: context_length_exceeded"))[-1]
    assert "POST /v1/chat/completions 400 " in line
    assert _wait_for(lambda: [r for r in read_records(logged.home / "metrics")
                              if (r.get("error") or {}).get("code") == "context_length_exceeded"])


def test_records_survive_a_restart_and_the_next_turn_restores_from_disk(tiny_checkpoint, tmp_path):
    home = tmp_path / "home"
    prompt = [{"role": "user", "content": "explain this file: " + "def f(x): return x + 1\n" * 60}]
    ids = []
    for life in range(2):
        daemon = start_api_daemon(home, MTPLX_MODEL=str(tiny_checkpoint))
        try:
            raw = _client(daemon, **{"x-session-id": "s-restart"}).chat.completions.with_raw_response.create(
                model=MODEL_ID, messages=prompt, max_tokens=4, temperature=0)
            ids.append(raw.headers["x-mtplx-request-id"])
            reply = raw.parse().choices[0].message.content or "ok"
            _record(daemon, ids[-1])
        finally:
            daemon.stop()
        prompt = prompt + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    records = {r["id"]: r for r in read_records(home / "metrics")}
    first, second = records[ids[0]], records[ids[1]]
    assert first["restore"]["from"] == "cold"
    assert second["restore"]["from"] == "ssd" and second["restore"]["reused_tokens"] >= 256
