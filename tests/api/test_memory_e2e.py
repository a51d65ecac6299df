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


def test_advertised_context_is_what_fits_and_the_models_own_context_stays_the_models(tight):
    with tight.http() as http:
        card = http.get("/v1/models").json()["data"][0]
        assert card["id"] == MODEL_ID and card["context_length"] == FITS_TOKENS
        model_context = card["mtplx"]["model_context_length"]
        assert model_context > FITS_TOKENS and card["mtplx"]["context_limited_by"] == "memory"
        health = http.get("/health").json()
        assert (health["context_length"], health["model_context_length"], health["context_limited_by"]) \
            == (FITS_TOKENS, model_context, "memory")
    model = tight.client.call("daemon.status")["model"]
    assert (model["context_length"], model["model_context_length"], model["context_limited_by"]) \
        == (FITS_TOKENS, model_context, "memory")


def test_a_prompt_that_memory_cannot_hold_is_a_507_that_names_memory_not_a_400(tight):
    """The model's context holds the prompt; the memory limit does not: a structured 507 before
    any prefill that says memory is the limit, how much is needed and what to do."""
    long_messages = [{"role": "user", "content": "hello world " * 600}]
    with tight.http() as http:
        started = tight.client.call("daemon.status")["requests"]["started"]
        for _ in range(10):  # a burst of requests that cannot fit under the limit
            long = http.post("/v1/chat/completions", json={"messages": long_messages, "max_tokens": 4})
            assert long.status_code == 507, long.text
            error = long.json()["error"]
            assert error["code"] == "insufficient_memory"
            assert f"caps this server's context at {FITS_TOKENS} tokens" in error["message"]
            assert "maximum context" not in error["message"]
            assert error["needed_bytes"] > error["available_bytes"] and "memory_limit" in error["hint"]
        assert tight.client.call("daemon.status")["requests"]["started"] == started  # no prefill
        small = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4})
        assert small.status_code == 200  # and a small one is still served



def test_scoring_a_prompt_that_memory_cannot_hold_is_a_507_and_the_daemon_serves_on(tight):
    """max_tokens 0 with echo and logprobs scores the prompt, a prefill whose every position's
    logits it keeps: priced by the guard as a generation is, refused before it runs."""
    with tight.http() as http:
        for stream in (False, True):
            scored = http.post("/v1/completions", json={
                "prompt": [30] * (FITS_TOKENS + 8), "max_tokens": 0, "echo": True, "logprobs": 0,
                "stream": stream})
            assert scored.status_code == 507, scored.text
            assert scored.json()["error"]["code"] == "insufficient_memory"
        answer = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
        assert answer.status_code == 200

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
                    assert set(error["held_by"]) == {"weights", "running_requests", "cohort_padding",
                                                    "session_bank"}
                    assert "memory_limit" in error["hint"]
                else:
                    assert answer.json()["type"] == "error"
        assert http.get("/health").status_code == 200
    status = starved.client.call("daemon.status")
    assert status["requests"]["started"] == 0  # no request reached the engine: no prefill ran
    # Memory fits nothing: the served window is 0, never an unbounded stand-in.
    assert status["model"]["context_length"] == 0 and status["model"]["context_limited_by"] == "memory"
    assert status["model"]["max_output_tokens"] == 0  # and no output: nothing to advertise
    assert status["guard"]["refused"] == 5 * len(bodies)
    assert starved.process.poll() is None
