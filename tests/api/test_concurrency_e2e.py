"""Several requests at once against a real daemon: each stream equals its solo output, a full
queue answers 429 with Retry-After in each API's own shape, a disconnect frees its row, and
status, /metrics and the flight board show the scheduler."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import anthropic
import httpx
import openai
import pytest

from support.api_daemon import MODEL_ID, ApiDaemon, start_api_daemon

# Greedy with negative penalties loops on the tiny model and never emits end-of-sequence;
# plain AR (depth 0) and the whole context make it last seconds even on a fast CPU.
ENDLESS = {"temperature": 0, "frequency_penalty": -2.0, "presence_penalty": -2.0, "mtp_depth": 0,
           "max_tokens": 4000}
PROMPTS = ["write a function", "hi", "explain the code below in detail please", "sort a list"]


@pytest.fixture(scope="module")
def busy(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    """A daemon with two row slots and room for one waiting request."""
    daemon = start_api_daemon(tmp_path_factory.mktemp("sched-home"), MTPLX_MODEL=str(tiny_checkpoint),
                              MTPLX_MAX_CONCURRENT="2", MTPLX_MAX_QUEUED="1")
    try:
        yield daemon
    finally:
        daemon.stop()


def _client(daemon: ApiDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="none", max_retries=0)


def _stream_text(daemon: ApiDaemon, prompt: str, depth: int, out: dict, key: int,
                 **sampling) -> None:
    sampling = {"max_tokens": 24, "temperature": 0, **sampling}
    stream = _client(daemon).chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": prompt}],
        stream=True, extra_body={"mtp_depth": depth}, **sampling)
    out[key] = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def _wait(predicate, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_concurrent_streams_each_equal_their_solo_greedy_output(busy):
    depths = [0, 2, 3]
    solo: dict = {}
    for i, prompt in enumerate(PROMPTS[:3]):
        _stream_text(busy, prompt, depths[i], solo, i)
    together: dict = {}
    threads = [threading.Thread(target=_stream_text, args=(busy, p, depths[i], together, i))
               for i, p in enumerate(PROMPTS[:3])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert together == solo


def _open_endless(http: httpx.Client, stack) -> Iterator[str]:
    """Start an endless stream and read up to its first content; the caller keeps the line
    iterator (dropping it closes the connection, which cancels the row)."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "go"}],
            "stream": True, **ENDLESS}
    response = stack.enter_context(http.stream("POST", "/v1/chat/completions", json=body))
    lines = response.iter_lines()
    for line in lines:
        if '"content":"' in line and '"role"' not in line:
            return lines
    raise AssertionError("the stream ended before its first content")


def test_a_full_queue_answers_429_with_retry_after_in_each_dialect(busy):
    from contextlib import ExitStack

    with ExitStack() as stack, httpx.Client(base_url=busy.base_url, timeout=30) as http:
        streams = [_open_endless(http, stack) for _ in range(2)]  # both row slots busy
        answers: list = []
        waiting = threading.Thread(target=lambda: answers.append(httpx.post(
            busy.base_url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL_ID, "max_tokens": 3, "messages": [{"role": "user", "content": "q"}]})))
        waiting.start()
        _wait(lambda: busy.client.call("daemon.status")["scheduler"]["queued"] == 1)
        status = busy.client.call("daemon.status")["scheduler"]
        assert status["running"] == 2 and status["max_concurrent"] == 2
        assert [row["phase"] for row in status["rows"]] == ["decode", "decode", "queued"]
        flight = http.get("/v1/mtplx/flight").json()
        assert flight["scheduler"]["queued"] == 1
        assert sorted(r["phase"] for r in flight["requests"]) == ["decode", "decode", "queued"]
        with pytest.raises(openai.RateLimitError) as refused:
            _client(busy).chat.completions.create(
                model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=3)
        assert refused.value.code == "queue_full"
        assert int(refused.value.response.headers["retry-after"]) >= 1
        with pytest.raises(anthropic.RateLimitError) as refused_anthropic:
            anthropic.Anthropic(base_url=busy.base_url, api_key="none", max_retries=0).messages.create(
                model=MODEL_ID, max_tokens=3, messages=[{"role": "user", "content": "x"}])
        assert refused_anthropic.value.body["error"]["type"] == "rate_limit_error"
        metrics = http.get("/metrics").text
        assert "mtplx_scheduler_running_rows 2.0" in metrics
        assert "mtplx_scheduler_queued_requests 1.0" in metrics
        del streams
    # Leaving the block closed both endless streams: their rows leave, the queued one runs.
    waiting.join(30)
    assert answers[0].status_code == 200
    assert answers[0].json()["mtplx_stats"]["queue_wait_seconds"] > 0
    _wait(lambda: busy.client.call("daemon.status")["scheduler"]["running"] == 0)
    metrics = httpx.get(busy.base_url + "/metrics").text
    assert "mtplx_queue_wait_seconds_count" in metrics


def test_a_short_request_is_answered_while_a_long_stream_runs(busy):
    from contextlib import ExitStack

    with ExitStack() as stack, httpx.Client(base_url=busy.base_url, timeout=30) as http:
        stream = _open_endless(http, stack)
        started = time.monotonic()
        answer = _client(busy).chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        waited = time.monotonic() - started
        stats = answer.model_extra["mtplx_stats"]
        assert stats["rows_max"] == 2 and stats["queue_wait_seconds"] < 1
        assert stats["ttft_seconds"] >= stats["queue_wait_seconds"]
        assert waited < 10
        assert busy.client.call("daemon.status")["scheduler"]["running"] == 1
        del stream
    _wait(lambda: busy.client.call("daemon.status")["scheduler"]["running"] == 0)


def _stream_in_thread(daemon: ApiDaemon, body: dict, out: dict) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.Client(base_url=daemon.base_url, timeout=60) as http:
                with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    out["lines"] = list(response.iter_lines())
        except httpx.HTTPError as exc:
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_stop_lets_running_rows_finish_within_the_grace_time(tiny_checkpoint, tmp_path):
    daemon = start_api_daemon(tmp_path / "home", MTPLX_MODEL=str(tiny_checkpoint),
                              MTPLX_SHUTDOWN_GRACE_SECONDS="30")
    try:
        outs = [{}, {}]
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "go"}], "stream": True,
                **{**ENDLESS, "max_tokens": 400}}
        threads = [_stream_in_thread(daemon, body, out) for out in outs]
        _wait(lambda: daemon.client.call("daemon.status")["scheduler"]["running"] == 2)
        daemon.process.send_signal(15)
        for thread in threads:
            thread.join(60)
        assert daemon.process.wait(60) == 0
        for out in outs:
            assert "error" not in out, out
            assert out["lines"][-1] == "data: [DONE]" or out["lines"][-2] == "data: [DONE]"
            assert any('"finish_reason":"length"' in line for line in out["lines"])
    finally:
        daemon.stop()


def test_stop_cancels_rows_that_outlast_the_grace_time(tiny_checkpoint, tmp_path):
    daemon = start_api_daemon(tmp_path / "home", MTPLX_MODEL=str(tiny_checkpoint),
                              MTPLX_SHUTDOWN_GRACE_SECONDS="1")
    try:
        out: dict = {}
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "go"}], "stream": True,
                **ENDLESS}
        thread = _stream_in_thread(daemon, body, out)
        _wait(lambda: daemon.client.call("daemon.status")["scheduler"]["running"] == 1)
        stopped = time.monotonic()
        daemon.process.send_signal(15)
        assert daemon.process.wait(30) == 0
        assert time.monotonic() - stopped < 15
        thread.join(30)
    finally:
        daemon.stop()


def test_cohort_streams_equal_their_solo_output_and_show_in_stats_and_metrics(tiny_checkpoint, tmp_path):
    """A daemon whose rows always decode in cohorts: three streams at one depth share 3-wide
    fused cohort cycles (the default for the dense tiny model); each still equals its solo greedy output, the OpenAI SDK's stats say
    which widths it ran in, and /metrics counts the cycles by width."""
    daemon = start_api_daemon(tmp_path / "home", MTPLX_MODEL=str(tiny_checkpoint),
                              MTPLX_MAX_CONCURRENT="3", MTPLX_COHORTS="always",
                              MTPLX_NUMERICS="throughput")
    try:
        # Negative penalties keep the tiny model from stopping early: the streams overlap.
        long = {"max_tokens": 160, "frequency_penalty": -2.0, "presence_penalty": -2.0}
        solo: dict = {}
        for i, prompt in enumerate(PROMPTS[:3]):
            _stream_text(daemon, prompt, 2, solo, i, **long)
        together: dict = {}
        threads = [threading.Thread(target=_stream_text, args=(daemon, p, 2, together, i),
                                    kwargs=long) for i, p in enumerate(PROMPTS[:3])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert together == solo
        status = daemon.client.call("daemon.status")["scheduler"]
        assert status["cohort_widths"] == [1, 3, 8] and status["numerics"] == "throughput"
        assert status["cohort_cycle"] == "fused"  # a dense model's MTP rows: fused cohorts
        assert status["cohorts_by_width"]["3"] > 0
        answer = _client(daemon).chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            extra_body={"mtp_depth": 2})
        assert set(answer.model_extra["mtplx_stats"]["cohort_widths"]) == {"1"}
        metrics = httpx.get(daemon.base_url + "/metrics").text
        assert 'mtplx_cohort_row_cycles_total{width="3"}' in metrics
        assert "mtplx_scheduler_paused_rows 0.0" in metrics
    finally:
        daemon.stop()


def test_a_stream_decoding_alone_moves_into_the_cohort_of_one_that_arrives_and_stays_exact(
        tiny_checkpoint, tmp_path):
    """The default cohorts "auto": a long stream starts alone in the single-stream loop; a
    second arrives while it decodes and decodes in a cohort, and the first moves into it. Both
    streams equal their solo greedy output; status and /metrics count the move."""
    daemon = start_api_daemon(tmp_path / "home", MTPLX_MODEL=str(tiny_checkpoint),
                              MTPLX_MAX_CONCURRENT="2", MTPLX_NUMERICS="throughput")
    try:
        # The first long enough to be decoding still when the second has come and gone.
        lengths = [{"max_tokens": 1500, "frequency_penalty": -2.0, "presence_penalty": -2.0},
                   {"max_tokens": 100, "frequency_penalty": -2.0, "presence_penalty": -2.0}]
        solo: dict = {}
        for i, prompt in enumerate(PROMPTS[:2]):
            _stream_text(daemon, prompt, 2, solo, i, **lengths[i])
        assert daemon.client.call("daemon.status")["scheduler"]["moved_into_cohorts"] == 0
        together: dict = {}
        first = threading.Thread(target=_stream_text, args=(daemon, PROMPTS[0], 2, together, 0),
                                 kwargs=lengths[0])
        first.start()
        _wait(lambda: any(row["phase"] == "decode" and row["completion_tokens"] > 8
                          for row in daemon.client.call("daemon.status")["scheduler"]["rows"]))
        _stream_text(daemon, PROMPTS[1], 2, together, 1, **lengths[1])
        first.join(60)
        assert together == solo
        status = daemon.client.call("daemon.status")["scheduler"]
        assert status["moved_into_cohorts"] == 1
        metrics = httpx.get(daemon.base_url + "/metrics").text
        assert "mtplx_scheduler_rows_moved_into_cohorts 1.0" in metrics
    finally:
        daemon.stop()


def _anthropic_text(daemon: ApiDaemon, prompt: str, depth: int, out: dict, key, **sampling) -> None:
    client = anthropic.Anthropic(base_url=daemon.base_url, api_key="none", max_retries=0)
    with client.messages.stream(model=MODEL_ID, max_tokens=sampling.pop("max_tokens"),
                                messages=[{"role": "user", "content": prompt}],
                                extra_body={"mtp_depth": depth, "temperature": 0, **sampling}) as stream:
        out[key] = "".join(stream.text_stream)


def _leave_mid_stream(daemon: ApiDaemon, prompt: str, chunks: int, out: dict, key) -> None:
    """Read `chunks` content chunks of a long stream, then hang up."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "mtp_depth": 2, "temperature": 0, "max_tokens": 2000, "frequency_penalty": -2.0,
            "presence_penalty": -2.0}
    with httpx.Client(base_url=daemon.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            seen = 0
            for line in response.iter_lines():
                seen += '"content":"' in line
                if seen >= chunks:
                    break
    out[key] = seen


def test_a_mixed_crowd_of_requests_stays_exact_while_some_clients_hang_up(tiny_checkpoint, tmp_path):
    """What agents send at once, against one daemon with the default cohorts ("auto"): greedy
    MTP streams at depths 2 and 3 (OpenAI and Anthropic clients), a plain AR stream, a seeded
    sampled stream, a stream with a stop string, a 1-token turn, and two clients that hang up
    mid-stream. Every finished request equals its solo output, the hung-up rows leave, and the
    daemon serves the next request."""
    daemon = start_api_daemon(tmp_path / "home", MTPLX_MODEL=str(tiny_checkpoint),
                              MTPLX_MAX_CONCURRENT="8", MTPLX_NUMERICS="throughput")
    long = {"max_tokens": 120, "frequency_penalty": -2.0, "presence_penalty": -2.0}
    # (function, args, kwargs): each writes its text under its index
    work = [
        (_stream_text, (PROMPTS[0], 2), long),
        (_stream_text, (PROMPTS[1], 2), long),
        (_stream_text, (PROMPTS[2], 2), {**long, "max_tokens": 60}),
        (_anthropic_text, (PROMPTS[3], 3), dict(long)),
        (_stream_text, (PROMPTS[0], 0), {**long, "max_tokens": 40}),
        (_stream_text, (PROMPTS[1], 2), {**long, "temperature": 0.8, "top_p": 0.9, "seed": 7}),
        (_stream_text, (PROMPTS[2], 2), {**long, "stop": ["e"]}),
        (_stream_text, (PROMPTS[3], 2), {"max_tokens": 1}),
    ]
    try:
        solo: dict = {}
        for i, (run, args, kwargs) in enumerate(work):
            run(daemon, *args, solo, i, **dict(kwargs))
        assert solo[7] and len(solo) == 8
        together: dict = {}
        threads = [threading.Thread(target=run, args=(daemon, *args, together, i), kwargs=dict(kwargs))
                   for i, (run, args, kwargs) in enumerate(work)]
        threads += [threading.Thread(target=_leave_mid_stream, args=(daemon, PROMPTS[i], 3 + 5 * i,
                                                                     together, f"left-{i}"))
                    for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads)
        assert {i: together[i] for i in range(len(work))} == solo
        assert together["left-0"] == 3 and together["left-1"] == 8
        _wait(lambda: daemon.client.call("daemon.status")["scheduler"]["running"] == 0)
        status = daemon.client.call("daemon.status")["scheduler"]
        assert status["queued"] == 0 and status["rows"] == []
        # They really ran together (in 3- and 8-wide cohorts here), and no row failed.
        assert status["cohorts_by_width"].get("3", 0) + status["cohorts_by_width"].get("8", 0) > 0
        assert status["failed"] == 0
        after: dict = {}
        _stream_text(daemon, PROMPTS[0], 2, after, 0, **long)
        assert after[0] == solo[0]
        assert "Traceback" not in daemon.log()
    finally:
        daemon.stop()
