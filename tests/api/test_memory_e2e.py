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
        long = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello world " * 600}],
                                                       "max_tokens": 4})
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"


def test_request_that_does_not_fit_beside_a_running_one_is_a_507_streamed_or_not(tight):
    with tight.http() as http:
        with http.stream("POST", "/v1/chat/completions",
                         json={"messages": HI, "stream": True, **ENDLESS}) as first:
            assert first.status_code == 200
            room = int(first.headers["x-mtplx-max-tokens"])
            assert 0 < room < FITS_TOKENS  # the default cap fills the advertised context
            lines = first.iter_lines()  # kept referenced: a collected iterator closes the stream
            next(lines)
            assert http.get("/v1/mtplx/flight").json()["running"] == 1
            streamed = http.post("/v1/chat/completions", json={"messages": HI, "stream": True, "max_tokens": 500})
            whole = http.post("/v1/messages", json={"messages": HI, "max_tokens": 500})
        assert streamed.status_code == 507
        error = streamed.json()["error"]
        assert error["code"] == "insufficient_memory" and error["held_by"]["running_requests"] > 0
        assert "hint" in error
        assert whole.status_code == 507 and whole.json()["type"] == "error"
        # The first request is gone (disconnected): the same request now fits.
        again = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 5})
        assert again.status_code == 200
