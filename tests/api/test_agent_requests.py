"""Request bodies recorded from the real agents (tests/api/data/<agent>_<version>_*.json) are served.

Each fixture is the first request the agent sent to a running mtplxd in a headless run (see
docs/agents.md, "Verified with"), with machine and session ids zeroed. `*_tool_result.json` is
the request that followed a tool call (`echo mtplx-tool-ok`, answered by a recording proxy in
the agent's own wire format): the agent's tool result on its way back. `*_second_turn.json` is
a continued session (`codex exec resume --last`, `opencode run --continue`, `pi -p -c`). The
agent binaries are not needed: the bodies are replayed through the parser of their dialect and
against a real daemon. The daemon's tiny model has a 4096-token context, smaller than the agents' prompts, so
a replay may end in `context_length_exceeded`; that answer comes after the body was parsed and
rendered through the chat template, which is what these tests guard.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mtplxd.api.anthropic import parse_messages_request
from mtplxd.api.chat_format import normalize_messages
from mtplxd.api.openai import parse_chat_request
from mtplxd.api.responses import parse_responses_request
from support.api_daemon import MODEL_ID

DATA = Path(__file__).parent / "data"

# fixture file -> (endpoint, parser of that dialect)
RECORDED = {
    "claude_code_2.1.197_messages.json": ("/v1/messages", parse_messages_request),
    "claude_code_2.1.197_messages_tool_result.json": ("/v1/messages", parse_messages_request),
    "codex_0.171.0_responses.json": ("/v1/responses", parse_responses_request),
    "codex_0.171.0_responses_tool_result.json": ("/v1/responses", parse_responses_request),
    "codex_0.171.0_responses_second_turn.json": ("/v1/responses", parse_responses_request),
    "hermes_0.19.0_chat_completions.json": ("/v1/chat/completions", parse_chat_request),
    "hermes_0.19.0_chat_completions_tool_result.json": ("/v1/chat/completions", parse_chat_request),
    "opencode_1.18.33_chat_completions.json": ("/v1/chat/completions", parse_chat_request),
    "opencode_1.18.33_chat_completions_tool_result.json": ("/v1/chat/completions", parse_chat_request),
    "opencode_1.18.33_chat_completions_second_turn.json": ("/v1/chat/completions", parse_chat_request),
    "opencode_1.18.33_title_chat_completions.json": ("/v1/chat/completions", parse_chat_request),
    "pi_0.73.1_chat_completions.json": ("/v1/chat/completions", parse_chat_request),
    "pi_0.73.1_chat_completions_tool_result.json": ("/v1/chat/completions", parse_chat_request),
    "pi_0.73.1_chat_completions_second_turn.json": ("/v1/chat/completions", parse_chat_request),
}
TOOL_RESULT_MARK = "mtplx-tool-ok"  # what the recorded tool call (`echo mtplx-tool-ok`) printed


def recorded(name: str) -> dict:
    """The recorded body, addressed to the test daemon's model."""
    return {**json.loads((DATA / name).read_text()), "model": MODEL_ID}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_agent_request_parses(name):
    _, parse = RECORDED[name]
    conversation = parse(recorded(name))[1]
    assert any(m["role"] == "user" for m in conversation.messages)


def test_claude_code_mid_conversation_system_message_joins_the_system_prompt():
    body = recorded("claude_code_2.1.197_messages.json")
    mid = [m for m in body["messages"] if m["role"] == "system"]
    assert mid, "the recorded Claude Code body has a system message inside `messages`"
    conversation = parse_messages_request(body)[1]
    messages = normalize_messages(conversation.messages)
    assert messages[0]["role"] == "system"
    assert all(m["role"] != "system" for m in messages[1:])
    assert mid[0]["content"][:200] in messages[0]["content"]
    assert messages[0]["content"].index(body["system"][-1]["text"][:200]) < \
        messages[0]["content"].index(mid[0]["content"][:200])


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_agent_request_is_served(api, name):
    endpoint, _ = RECORDED[name]
    with api.http() as http:
        reply = http.post(endpoint, json=recorded(name))
        assert reply.status_code in (200, 400), reply.text
        if reply.status_code == 400:
            error = reply.json()["error"]
            assert error.get("code", error.get("type")) == "context_length_exceeded" or \
                "maximum context length" in error["message"], reply.text


def test_claude_code_request_counts_its_tokens(api):
    body = recorded("claude_code_2.1.197_messages.json")
    with api.http() as http:
        reply = http.post("/v1/messages/count_tokens", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["input_tokens"] > 4096


@pytest.mark.parametrize("name", sorted(n for n in RECORDED if n.endswith("_tool_result.json")))
def test_recorded_tool_result_reaches_the_prompt_as_a_tool_turn(name):
    _, parse = RECORDED[name]
    messages = normalize_messages(parse(recorded(name))[1].messages)
    calls = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
    results = [m for m in messages if m["role"] == "tool"]
    assert len(calls) == 1 and len(results) == 1
    assert messages.index(calls[0]) < messages.index(results[0])
    assert TOOL_RESULT_MARK in results[0]["content"]


@pytest.mark.parametrize("name", sorted(n for n in RECORDED if n.endswith("_second_turn.json")))
def test_recorded_second_turn_keeps_the_first_answer_in_order(name):
    _, parse = RECORDED[name]
    messages = normalize_messages(parse(recorded(name))[1].messages)
    roles = [m["role"] for m in messages]
    assert roles[0] == "system" and roles[-3:] == ["user", "assistant", "user"]
    assert roles.count("assistant") == 1 and messages[-3]["content"] and messages[-2]["content"]


def test_a_refused_request_is_logged_with_its_parameter(api):
    body = {"max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}
    with api.http() as http:
        assert http.post("/v1/messages", json=body).status_code == 400
    log_file = api.home / "logs" / "mtplxd.log"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for line in log_file.read_text().splitlines() if " 400 " in line and "refused:" in line]
        if lines:
            break
        time.sleep(0.05)
    assert any("POST /v1/messages 400 " in line and "refused: invalid_request (messages[0].role)" in line
               for line in lines), lines
