"""The default (embedded) model's context: what /v1/models, status and the agent configs
advertise is the checkpoint's 65,536 tokens, and it is what the daemon then accepts.

A prompt at the full 64k is not prefilled here (minutes on two CPU cores; the prefill bench
measures it): the test checks the boundary on the side that costs nothing, one token past
it, which must be refused before prefill naming the same number.
"""

from __future__ import annotations

import json

import pytest

from mtplxd.models.builtin import EMBEDDED_MODEL_DIR
from support.api_daemon import start_api_daemon
from support.daemon import run_ctl

SERVED = 65536


@pytest.fixture(scope="module")
def embedded_daemon(tmp_path_factory):
    daemon = start_api_daemon(tmp_path_factory.mktemp("home"), "--model", "mtplx-tiny-coder", timeout=120)
    yield daemon
    daemon.stop()


def test_the_embedded_checkpoint_is_a_64k_model():
    config = json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text())
    assert config["max_position_embeddings"] == SERVED
    assert config["rope_theta"] == 1_000_000.0  # the base it was trained at for that length


def test_models_and_health_advertise_the_context_the_model_was_trained_for(embedded_daemon):
    with embedded_daemon.http() as http:
        model = http.get("/v1/models").json()["data"][0]
        health = http.get("/health").json()
    assert model["id"] == "mtplx-tiny-coder"
    assert model["context_length"] == model["max_model_len"] == SERVED
    assert model["mtplx"]["model_context_length"] == SERVED
    assert model["mtplx"]["context_limited_by"] == "model"  # the guard prices 64k and it fits
    assert (health["context_length"], health["model_context_length"]) == (SERVED, SERVED)


def test_one_token_past_the_advertised_context_is_refused_before_prefill(embedded_daemon):
    with embedded_daemon.http() as http:
        tokenizer_probe = http.post("/v1/completions", json={
            "model": "mtplx-tiny-coder", "prompt": "x = 1\n", "max_tokens": 1, "temperature": 0})
        assert tokenizer_probe.status_code == 200
        per_line = tokenizer_probe.json()["usage"]["prompt_tokens"]
        prompt = "x = 1\n" * (SERVED // per_line + 1)
        reply = http.post("/v1/completions", json={
            "model": "mtplx-tiny-coder", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert str(SERVED) in error["message"]



def test_scoring_a_prompt_past_the_context_is_refused_as_a_generation_is(embedded_daemon):
    """max_tokens 0 with echo and logprobs scores the prompt (a prefill): one token past the
    context is the same 400, naming `prompt`, streamed or not, before any scoring."""
    prompt = [30] * (SERVED + 1)
    with embedded_daemon.http() as http:
        for stream in (False, True):
            reply = http.post("/v1/completions", json={
                "model": "mtplx-tiny-coder", "prompt": prompt, "max_tokens": 0, "echo": True,
                "logprobs": 0, "stream": stream})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")

def test_agents_install_writes_the_context_the_daemon_serves(embedded_daemon, monkeypatch):
    monkeypatch.setenv("MTPLX_HOME", str(embedded_daemon.home))
    done = run_ctl("agents", "install", "pi", "opencode", "codex", "hermes", "claude")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "refuses to start" not in done.stdout  # Hermes' 64k floor is met
    checked = run_ctl("doctor", "--json")
    contexts = [c for c in json.loads(checked.stdout)["checks"] if c.get("check") in ("context", "limits")]
    assert contexts and all(c["level"] == "ok" for c in contexts), contexts
    assert all(f"context {SERVED}" in c["detail"] for c in contexts if c["check"] == "limits")
