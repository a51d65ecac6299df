"""LFM2 / LFM2.5 served end to end: a tiny random-weight LFM2 checkpoint behind a real daemon,
driven by the real `openai` and `anthropic` clients (the same API checks as the Qwen family),
plus LFM2's pythonic tool calls streamed through the SSE writers and read back by the SDKs'
own stream accumulators (a random model never writes a well-formed call by itself)."""

from __future__ import annotations

import json

import anthropic as anthropic_sdk
import httpx
import httpx2
import openai as openai_sdk
import pytest
import trio

from mtplxd.api import anthropic, openai
from mtplxd.api.parsers import collect
from mtplxd.api.pythonic_tools import PYTHONIC_TOOLS
from mtplxd.api.service import Outcome, Plan
from mtplxd.engine.fixtures.tiny_lfm2 import write_tiny_lfm2_checkpoint
from mtplxd.engine.interface import GenerationRequest, GenerationResult, GenerationStats, SamplingParams
from support.api_daemon import daemon_fixture, installed_codex_config

MODEL_ID = "tiny-lfm2"
USER = [{"role": "user", "content": "list the files and read main.py"}]
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
SAMPLED = dict(temperature=1.0, seed=7)  # a random tied-embedding model repeats under greedy


lfm2 = daemon_fixture(lambda folder: write_tiny_lfm2_checkpoint(folder / MODEL_ID))


def test_health_says_ar_with_the_reason_lfm2_has_no_mtp_head(lfm2):
    body = httpx.get(lfm2.base_url + "/health").json()
    assert body["model"] == MODEL_ID and body["mode"] == "ar" and body["depth"] == 0
    assert "LFM2" in json.dumps(body) and "no MTP head" in json.dumps(body)


def test_streamed_text_equals_the_non_streamed_text(lfm2):
    base = dict(model=MODEL_ID, messages=USER, max_tokens=16, **SAMPLED)
    whole = lfm2.openai.chat.completions.create(**base)
    chunks = list(lfm2.openai.chat.completions.create(stream=True, **base))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 16 or whole.choices[0].finish_reason == "stop"


def test_tool_history_is_written_back_as_pythonic_calls_the_model_reads(lfm2):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "main.py"}'}}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"}
    base = dict(model=MODEL_ID, tools=TOOLS, max_tokens=1, temperature=0)
    with_call = lfm2.openai.chat.completions.create(
        messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [call]}, result], **base)
    without = lfm2.openai.chat.completions.create(
        messages=[*USER, {"role": "assistant", "content": ""}, result], **base)
    # LFM2's template renders `content` only: the call reaches the prompt as
    # <|tool_call_start|>[read_file(path="main.py")]<|tool_call_end|>.
    assert with_call.usage.prompt_tokens > without.usage.prompt_tokens + 5


def test_forced_tool_choice_opens_a_pythonic_call(lfm2):
    base = dict(model=MODEL_ID, messages=USER, tools=TOOLS, max_tokens=1, temperature=0)
    auto = lfm2.openai.chat.completions.create(tool_choice="auto", **base)
    named = lfm2.openai.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "read_file"}}, **base)
    assert named.usage.prompt_tokens > auto.usage.prompt_tokens
    # The prompt wrote `read_file(`: the call is named, and the one token cut it off.
    [call] = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "length" and call.function.name == "read_file"
    assert isinstance(json.loads(call.function.arguments), dict)


def test_reasoning_effort_the_family_lacks_is_a_400_listing_its_levels(lfm2):
    with pytest.raises(openai_sdk.BadRequestError) as err:
        lfm2.openai.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=1, reasoning_effort="high")
    assert err.value.body["param"] == "reasoning_effort"
    assert "tiny-lfm2" in err.value.body["message"] and "none" in err.value.body["message"]
    ok = lfm2.openai.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=1, reasoning_effort="none")
    assert ok.usage.completion_tokens == 1


def test_codex_installed_for_lfm2_sends_an_effort_the_model_has(lfm2, tmp_path):
    assert lfm2.client.call("daemon.status")["model"]["reasoning_efforts"] == ["none"]
    config = installed_codex_config(lfm2, tmp_path / "codex")
    assert config["model"] == MODEL_ID and config["model_reasoning_effort"] == "none"
    request = dict(model=MODEL_ID, input="hello", max_output_tokens=2, temperature=0)
    with pytest.raises(openai_sdk.BadRequestError) as err:  # Codex's default, had install not set one
        lfm2.openai.responses.create(reasoning={"effort": "medium"}, **request)
    assert err.value.body["param"] == "reasoning.effort"
    reply = lfm2.openai.responses.create(reasoning={"effort": config["model_reasoning_effort"]}, **request)
    assert reply.usage.output_tokens <= 2


def test_responses_and_anthropic_clients_get_answers(lfm2):
    reply = lfm2.openai.responses.create(model=MODEL_ID, input="hello", max_output_tokens=4, temperature=0)
    assert reply.status in ("completed", "incomplete") and reply.usage.output_tokens <= 4
    claude = lfm2.anthropic
    messages = [{"role": "user", "content": "read main.py"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file",
                                                   "input": {"path": "main.py"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x = 1"}]}]
    tools = [{"name": "read_file", "input_schema": TOOLS[0]["function"]["parameters"]}]
    whole = claude.messages.create(model=MODEL_ID, max_tokens=8, messages=messages, tools=tools,
                                   extra_body={"temperature": 1.0, "seed": 3})
    with claude.messages.stream(model=MODEL_ID, max_tokens=8, messages=messages, tools=tools,
                                extra_body={"temperature": 1.0, "seed": 3}) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]


# -- pythonic calls through the SSE writers ------------------------------------------------

RECORDED = ('<think>Need the file.</think>Reading it.<|tool_call_start|>[read_file(path="src/main.py"), '
            'read_file(path="README.md")]<|tool_call_end|>')


class Recorded:
    """Plays LFM2-format text through the plan's own parser as `Generations.stream` does."""

    async def stream(self, plan: Plan):
        parser = plan.new_parser()
        events = []
        for i in range(0, len(RECORDED), 5):
            piece = parser.feed(RECORDED[i:i + 5])
            events += piece
            if piece:
                yield piece
        tail = parser.finish()
        events += tail
        if tail:
            yield tail
        stats = GenerationStats(prompt_tokens=5, completion_tokens=30, finish_reason="stop")
        result = GenerationResult(text=RECORDED, token_ids=[1] * 30, finish_reason="stop", stats=stats)
        yield Outcome(plan, result, collect(events), reasoning_tokens=4, stop_sequence=None)


def recorded_plan() -> Plan:
    return Plan(id="r-1", endpoint="test", model_id="recorded", max_tokens=100, max_tokens_requested=None,
                request=GenerationRequest([1, 2, 3], SamplingParams()), parse_tools=True,
                dialect=PYTHONIC_TOOLS)


def sse(writer) -> bytes:
    async def run() -> bytes:
        return b"".join([frame async for frame in writer])
    return trio.run(run)


def transport(body: bytes, http=httpx):
    return http.Client(transport=http.MockTransport(
        lambda request: http.Response(200, content=body, headers={"content-type": "text/event-stream"})))


def test_openai_stream_carries_pythonic_calls_as_structured_tool_calls():
    body = sse(openai._chat_stream(Recorded(), recorded_plan(), "chatcmpl-x", include_usage=True))
    client = openai_sdk.OpenAI(base_url="http://test/v1", api_key="x", http_client=transport(body))
    with client.chat.completions.stream(model="recorded", messages=USER) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Reading it."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("read_file", {"path": "src/main.py"}), ("read_file", {"path": "README.md"})]
    assert final.choices[0].finish_reason == "tool_calls"


def test_anthropic_stream_carries_pythonic_calls_as_tool_use_blocks():
    body = sse(anthropic._stream(Recorded(), recorded_plan(), "msg_x"))
    client = anthropic_sdk.Anthropic(base_url="http://test", api_key="x", http_client=transport(body, httpx2))
    with client.messages.stream(model="recorded", max_tokens=10, messages=USER) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert final.content[2].input == {"path": "src/main.py"} and final.stop_reason == "tool_use"
