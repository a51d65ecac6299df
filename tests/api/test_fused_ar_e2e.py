"""A real daemon serving a hybrid's AR requests through the compiled AR loop (fused_ar.py;
on by default on CUDA, asked for here with MTPLX_FUSED_AR=1): /health names it, answers equal
the op-by-op loop's, two requests at once each equal their solo answer, a 1-token turn, a
reply to the end of the context, and a client that leaves mid-stream leaves the daemon
serving."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint
from support.api_daemon import ApiDaemon, serving

MODEL = "tiny-hybrid"
PROMPTS = ["write a function", "explain the code below in detail please"]
AR = {"mtp_depth": 0}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("models") / MODEL, "qwen3_5")


@pytest.fixture(scope="module")
def compiled(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    with serving(checkpoint, tmp_path_factory.mktemp("home"), MTPLX_FUSED_AR="1",
                 MTPLX_MAX_CONCURRENT="2") as daemon:
        yield daemon


def ask(daemon: ApiDaemon, prompt: str, max_tokens: int = 24, **extra) -> openai.types.chat.ChatCompletion:
    with openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="x", max_retries=0) as client:
        return client.chat.completions.create(
            model=MODEL, max_tokens=max_tokens, temperature=0, messages=[{"role": "user", "content": prompt}],
            extra_body={**AR, "ignore_eos": True, **extra})


def test_health_names_the_compiled_loop(compiled):
    health = httpx.get(compiled.base_url + "/health").json()
    assert health["kernels"]["ar_decode"] == "compiled"


def test_answers_equal_the_op_by_op_loops(compiled, checkpoint, tmp_path):
    ours = [ask(compiled, p) for p in PROMPTS]
    assert all(reply.model_extra["mtplx_stats"]["depth"] == 0 for reply in ours)
    with serving(checkpoint, tmp_path / "home", MTPLX_FUSED_AR="0") as op_by_op:
        assert httpx.get(op_by_op.base_url + "/health").json()["kernels"]["ar_decode"] == "op by op"
        want = [ask(op_by_op, p) for p in PROMPTS]
    assert [r.choices[0].message.content for r in ours] == [r.choices[0].message.content for r in want]
    assert [r.usage.completion_tokens for r in ours] == [24, 24]


def test_two_requests_at_once_each_answer_as_alone(compiled):
    solo = [ask(compiled, p).choices[0].message.content for p in PROMPTS]
    together: dict[int, str] = {}

    def run(i: int) -> None:
        together[i] = ask(compiled, PROMPTS[i]).choices[0].message.content

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [together[i] for i in range(len(PROMPTS))] == solo


def test_a_one_token_turn(compiled):
    reply = ask(compiled, "hi", max_tokens=1)
    assert reply.usage.completion_tokens == 1 and reply.choices[0].finish_reason == "length"


def test_a_reply_runs_to_the_end_of_the_context_and_the_next_turn_is_served(compiled):
    """The loop's buffers grow to the context's last slot and no further: a reply asked for
    more than fits is clamped to the room left, decodes all of it, and ends at the limit
    (the runaway-loop guard off: greedy, the tiny model repeats itself)."""
    with openai.OpenAI(base_url=compiled.base_url + "/v1", api_key="x", max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=100_000, temperature=0, messages=[{"role": "user", "content": "go"}],
            extra_body={**AR, "ignore_eos": True, "repetition_guard": False})
    reply, room = raw.parse(), int(raw.headers["x-mtplx-max-tokens"])
    window = httpx.get(compiled.base_url + "/v1/models").json()["data"][0]["context_length"]
    assert room == window - reply.usage.prompt_tokens and room > 1000
    assert reply.usage.completion_tokens == room and reply.choices[0].finish_reason == "length"
    assert ask(compiled, "hi", max_tokens=4).usage.completion_tokens == 4


def test_a_client_leaving_mid_stream_leaves_the_daemon_serving(compiled):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True,
            "max_tokens": 2000, "temperature": 0, **AR, "ignore_eos": True}
    with httpx.Client(base_url=compiled.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 5:
                    break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 30
    while compiled.client.call("daemon.status")["scheduler"]["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert compiled.client.call("daemon.status")["scheduler"]["running"] == 0
    assert ask(compiled, "hi", max_tokens=4).usage.completion_tokens == 4
