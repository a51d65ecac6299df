"""SSE behaviour: keep-alives before the first token, disconnect cancels the engine, an error
mid-stream ends with an error frame; plus the live flight view and Prometheus metrics."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import trio

from mtplxd.api import anthropic, openai
from mtplxd.api.flight import FlightBoard
from mtplxd.api.metrics import Metrics
from mtplxd.api.schemas import Conversation, GenParams
from mtplxd.api.service import Generations, Plan
from mtplxd.engine.interface import GenerationRequest, SamplingParams
from mtplxd.runtime import Runtime

MODEL_ID = "tiny-qwen3"
# Greedy with negative penalties loops on the tiny model and never emits end-of-sequence:
# a generation that runs until max_tokens (about 3000 tokens in 10 s on a laptop CPU).
ENDLESS = {"temperature": 0, "frequency_penalty": -2.0, "presence_penalty": -2.0}


def run_in_process(checkpoint: Path, tmp_path: Path, body) -> None:
    """Run `body(gen, runtime)` under trio with a real runtime serving `checkpoint`."""

    async def main() -> None:
        runtime = Runtime(tmp_path, 3)
        runtime.start()
        try:
            await runtime.load(str(checkpoint))
            async with trio.open_nursery() as nursery:
                gen = Generations(runtime, Metrics(runtime), FlightBoard(), lambda: nursery,
                                  keepalive_seconds=0.05)
                await body(gen, runtime)
        finally:
            runtime.stop()

    trio.run(main)


def test_keepalive_comments_flow_while_the_first_token_waits(tiny_checkpoint, tmp_path):
    frames: list[bytes] = []

    async def body(gen, runtime):
        plan = await gen.plan_chat("chat", None, Conversation([{"role": "user", "content": "hi"}]),
                                   GenParams(max_tokens=5, temperature=0))
        runtime.owner.submit(lambda: time.sleep(0.6))  # the model owner is busy: no token yet
        async for frame in openai._chat_stream(gen, plan, "chatcmpl-test", include_usage=False):
            frames.append(frame)

    run_in_process(tiny_checkpoint, tmp_path, body)
    first_content = next(i for i, f in enumerate(frames) if b'"finish_reason":"' in f or b'"content":"' in f
                         and b'"role"' not in f)
    keepalives = [i for i, f in enumerate(frames) if f == b": keep-alive\n\n"]
    # At least three while the owner is busy (0.6 s at 0.05 s a keep-alive), before any token.
    # (Later ones are right too: a token slower than 0.05 s on a loaded CI machine gets one.)
    assert len([i for i in keepalives if i < first_content]) >= 3
    assert frames[-1] == b"data: [DONE]\n\n"


def test_engine_failure_mid_stream_ends_with_an_error_frame_then_done(tiny_checkpoint, tmp_path):
    openai_frames: list[bytes] = []
    anthropic_frames: list[bytes] = []

    async def body(gen, runtime):
        # An empty prompt gets past no dialect's validation, but a Plan built by hand reaches the
        # engine, which refuses it on the owner thread after the response has started.
        def broken() -> Plan:
            return Plan(id="x", endpoint="chat", model_id=MODEL_ID, max_tokens=5, max_tokens_requested=None,
                        request=GenerationRequest([], SamplingParams(max_tokens=5)))

        async for frame in openai._chat_stream(gen, broken(), "chatcmpl-err", include_usage=True):
            openai_frames.append(frame)
        async for frame in anthropic._stream(gen, broken(), "msg_err"):
            anthropic_frames.append(frame)

    run_in_process(tiny_checkpoint, tmp_path, body)
    assert openai_frames[-1] == b"data: [DONE]\n\n"
    error = json.loads(openai_frames[-2].decode()[len("data: "):])
    assert "empty prompt" in error["error"]["message"]
    assert anthropic_frames[0].startswith(b"event: message_start")
    assert anthropic_frames[-1].startswith(b"event: error\n")
    assert b'"type":"error"' in anthropic_frames[-1]



def test_a_stream_whose_body_never_starts_is_cancelled_and_counted(tiny_checkpoint, tmp_path, monkeypatch):
    """A client that leaves between the admission and the first byte cancels the handler before
    its body starts; the generation must not run on to its cap unseen: it is cancelled within
    STREAM_START_SECONDS and counted as the client's leaving, and a late body yields nothing."""
    from mtplxd.api import service

    monkeypatch.setattr(service, "STREAM_START_SECONDS", 0.3)
    seen = {}

    async def body(gen, runtime):
        plan = await gen.plan_chat("chat", None, Conversation([{"role": "user", "content": "hi"}]),
                                   GenParams(max_tokens=20000, **ENDLESS))
        await gen.open_stream(plan)  # what a handler does before it returns the response
        started = time.monotonic()
        await trio.sleep(0.5)  # past the deadline: the body never started
        seen["abandoned"] = plan.opened.abandoned
        with trio.fail_after(20):
            await runtime.wait_idle()
        seen["ran"] = time.monotonic() - started
        seen["late"] = [item async for item in gen.stream(plan)]
        seen["metrics"] = gen.metrics.render().decode()

    run_in_process(tiny_checkpoint, tmp_path, body)
    assert seen["abandoned"] and seen["late"] == []
    assert 'mtplx_generations_total{finish_reason="cancelled"} 1.0' in seen["metrics"]
    assert seen["ran"] < 10  # a 20,000-token run cut at the start deadline, not run out

def test_client_disconnect_cancels_the_generation_and_frees_the_engine(api):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "go"}], "max_tokens": 3000,
            "stream": True, **ENDLESS}
    started = time.monotonic()
    with httpx.Client(base_url=api.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            content_chunks = 0
            for line in lines:
                if '"content":"' in line and '"role"' not in line:
                    content_chunks += 1
                    if content_chunks == 3:
                        break
            flight = http.get("/v1/mtplx/flight").json()
            assert flight["running"] == 1
            live = flight["requests"][0]
            assert live["phase"] == "decode" and live["stream"] and live["completion_tokens"] > 0
        # Leaving the block closed the connection mid-stream.
        deadline = time.monotonic() + 10
        while http.get("/v1/mtplx/flight").json()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.get("/v1/mtplx/flight").json()["running"] == 0
        assert http.get("/health").json()["active_requests"] == 0
        # The model owner is free: a new request does not queue behind the abandoned one.
        follow_up = time.monotonic()
        http.post("/v1/chat/completions", json={"model": MODEL_ID, "max_tokens": 5,
                                                "messages": [{"role": "user", "content": "hi"}]})
        assert time.monotonic() - follow_up < 3
        metrics = http.get("/metrics").text
    assert 'mtplx_generations_total{finish_reason="cancelled"} 1.0' in metrics
    # Far less than the ~3000-token run it would have been.
    assert time.monotonic() - started < 8


def test_metrics_are_prometheus_text_with_speculative_counters(api):
    with httpx.Client(base_url=api.base_url, timeout=30) as http:
        http.post("/v1/chat/completions", json={"model": MODEL_ID, "max_tokens": 20, "temperature": 0,
                                                "messages": [{"role": "user", "content": "hi"}]})
        answer = http.get("/metrics")
    assert answer.headers["content-type"].startswith("text/plain")
    text = answer.text
    for name in ("mtplx_requests_total", "mtplx_generation_tokens_total", "mtplx_prompt_tokens_total",
                 "mtplx_time_to_first_token_seconds_bucket", "mtplx_decode_tokens_per_second_bucket",
                 'mtplx_spec_decode_draft_tokens_total{position="1"}',
                 'mtplx_spec_decode_accepted_tokens_total{position="3"}',
                 "mtplx_spec_decode_mean_acceptance_length", "mtplx_process_resident_memory_bytes",
                 "mtplx_model_loaded 1.0", "mtplx_model_depth 3.0"):
        assert name in text, name
    assert 'mtplx_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
