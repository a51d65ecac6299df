"""The API over the memory guard: the advertised context is what fits, and a request that does
not fit is a real 507 status (streamed or not), never a 200 with an error frame."""

from __future__ import annotations

import json

import pytest

from mtplxd.engine import inspect_checkpoint
from mtplxd.guard import GIB, SMALLEST_PREFILL_CHUNK, plan_for_config
from support.api_daemon import MODEL_ID, start_api_daemon

FITS_TOKENS = 1024
ENDLESS = {"temperature": 0, "frequency_penalty": -2.0, "presence_penalty": -2.0}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tight(tiny_checkpoint, tmp_path_factory):
    """A daemon whose memory limit fits one request of FITS_TOKENS tokens."""
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    plan = plan_for_config(config, inspect_checkpoint(tiny_checkpoint).weights_bytes)
    limit = (plan.weights_bytes + SMALLEST_PREFILL_CHUNK * plan.activation_bytes_per_prefill_token
             + FITS_TOKENS * (plan.kv_bytes_per_token + plan.mtp_kv_bytes_per_token) + 64)
    daemon = start_api_daemon(tmp_path_factory.mktemp("tight-home"), MTPLX_MODEL=str(tiny_checkpoint),
                              MTPLX_MEMORY_LIMIT=f"{limit / GIB:.12f}")
    try:
        yield daemon
    finally:
        daemon.stop()


def test_advertised_context_is_what_fits_and_longer_prompts_are_context_length_exceeded(tight):
    with tight.http() as http:
        card = http.get("/v1/models").json()["data"][0]
        assert card["id"] == MODEL_ID and card["context_length"] == FITS_TOKENS
        assert http.get("/health").json()["context_length"] == FITS_TOKENS
        for _ in range(10):  # a burst of requests that cannot fit under the limit
            long = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello world " * 600}],
                                                           "max_tokens": 4})
            assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
        small = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4})
        assert small.status_code == 200  # and a small one is still served


def test_concurrent_requests_queue_for_the_model_instead_of_being_refused(tight):
    """Requests run one at a time on the model thread: a second one waits its turn, even when
    both could not be held at once (an agent's title request beside its main turn)."""
    with tight.http() as http:
        with http.stream("POST", "/v1/chat/completions",
                         json={"messages": HI, "stream": True, **ENDLESS}) as first:
            assert first.status_code == 200
            room = int(first.headers["x-mtplx-max-tokens"])
            assert 0 < room < FITS_TOKENS  # the default cap fills the advertised context
            lines = first.iter_lines()  # kept referenced: a collected iterator closes the stream
            next(lines)
            with http.stream("POST", "/v1/chat/completions",
                             json={"messages": HI, "stream": True, "max_tokens": 500}) as second:
                assert second.status_code == 200  # admitted, queued behind the first
                first.close()  # the first client goes away: the second one runs
                body = "".join(second.iter_lines())
        assert "[DONE]" in body and "insufficient_memory" not in body


@pytest.fixture(scope="module")
def starved(tiny_checkpoint, tmp_path_factory):
    """A daemon whose memory limit holds the weights but not even the smallest request."""
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    plan = plan_for_config(config, inspect_checkpoint(tiny_checkpoint).weights_bytes)
    limit = plan.weights_bytes + plan.recurrent_bytes_per_sequence + 1024
    daemon = start_api_daemon(tmp_path_factory.mktemp("starved-home"), MTPLX_MODEL=str(tiny_checkpoint),
                              MTPLX_MEMORY_LIMIT=f"{limit / GIB:.12f}")
    try:
        yield daemon
    finally:
        daemon.stop()


def test_requests_that_cannot_fit_get_507_before_any_prefill_and_the_daemon_survives(starved):
    bodies = [
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 8}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 8, "stream": True}),
        ("/v1/messages", {"messages": HI, "max_tokens": 8}),
        ("/v1/completions", {"prompt": "def f(", "max_tokens": 8}),
    ]
    with starved.http() as http:
        for round_ in range(5):
            for path, body in bodies:
                answer = http.post(path, json=body)
                assert answer.status_code == 507, (path, answer.text)
                error = answer.json()["error"]
                if path != "/v1/messages":
                    assert error["code"] == "insufficient_memory"
                    assert error["needed_bytes"] > error["available_bytes"]
                    assert set(error["held_by"]) == {"weights", "running_requests", "session_bank"}
                    assert "memory_limit" in error["hint"]
                else:
                    assert answer.json()["type"] == "error"
        assert http.get("/health").status_code == 200
    status = starved.client.call("daemon.status")
    assert status["requests"]["started"] == 0  # no request reached the engine: no prefill ran
    assert status["guard"]["refused"] == 5 * len(bodies)
    assert starved.process.poll() is None
