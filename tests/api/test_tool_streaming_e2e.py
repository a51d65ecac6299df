"""Tool-call arguments stream through the real daemon, read by the real SDKs' stream helpers.

The model is a scripted tiny checkpoint (fixtures/scripted.py): a real qwen3 + MTP model whose
weights make it write a JSON-style call and a Qwen XML call, one token per piece, so the
arguments arrive over several decode steps exactly as a real model's would.
"""

from __future__ import annotations

import json

import httpx
import pytest

from mtplxd.engine.fixtures.scripted import write_scripted_checkpoint
from support.api_daemon import daemon_fixture, scripted, serving
from support.tool_streams import anthropic_tool_stream, openai_chat_tool_stream, responses_tool_stream

TWO_CALLS = ["Let me look.", "\n<tool_call>\n", '{"name": "read_file", "arguments": {', '"path": ',
             '"src', '/main.py"', ', "lines": [1, ', "20]", "}}", "\n</tool_call>",
             "\n<tool_call>\n<function=shell>\n", "<parameter=command>\n", "ls -la", ' "/tmp"',
             " | head", "\n</parameter>\n", "<parameter=timeout>\n", "30", "\n</parameter>\n</function>",
             "\n</tool_call>\n"]
MALFORMED = ["\n<tool_call>\n", '{"name": "read_file", "arguments": {', '"path": "a.py",,', "}}",
             "\n</tool_call>"]
SCHEMAS = {"read_file": {"type": "object", "properties": {"path": {"type": "string"},
                                                         "lines": {"type": "array"}}},
           "shell": {"type": "object", "properties": {"command": {"type": "string"},
                                                      "timeout": {"type": "integer"}}}}
OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": n, "input_schema": s} for n, s in SCHEMAS.items()]
RESPONSES_TOOLS = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]
USER = [{"role": "user", "content": "look at main.py and list /tmp"}]
EXPECTED = [("read_file", {"path": "src/main.py", "lines": [1, 20]}),
            ("shell", {"command": 'ls -la "/tmp" | head', "timeout": 30})]


api = daemon_fixture(scripted("scripted-tools", TWO_CALLS))


@pytest.mark.parametrize("depth", [0, 3])
def test_openai_chat_streams_id_and_name_first_then_argument_fragments(api, depth):
    base = dict(model="scripted-tools", messages=USER, tools=OPENAI_TOOLS, temperature=0,
                extra_body={"mtp_depth": depth})
    whole = api.openai.chat.completions.create(**base).choices[0]
    firsts, fragments, final = openai_chat_tool_stream(api.openai, **base)
    assert [(f.index, f.function.name, f.function.arguments) for f in firsts] == [
        (0, "read_file", ""), (1, "shell", "")]
    per_call = ["".join(text for i, text in fragments if i == n) for n in (0, 1)]
    # Fragments as tokens commit (one per token in AR, one per accepted run with MTP), not one at the end.
    assert sum(1 for i, _ in fragments if i == 0) >= (4 if depth == 0 else 2)
    assert per_call == [c.function.arguments for c in whole.message.tool_calls]
    assert per_call == [c.function.arguments for c in final.choices[0].message.tool_calls]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == EXPECTED
    assert whole.message.content == final.choices[0].message.content == "Let me look."
    assert whole.finish_reason == final.choices[0].finish_reason == "tool_calls"


def test_anthropic_streams_input_json_delta(api):
    base = dict(model="scripted-tools", max_tokens=200, messages=USER, tools=ANTHROPIC_TOOLS)
    whole = api.anthropic.messages.create(**base)
    by_block, final = anthropic_tool_stream(api.anthropic, **base)
    assert [(b.name, b.input) for b in whole.content if b.type == "tool_use"] == EXPECTED
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == EXPECTED
    assert len(by_block) == 2 and all(len(parts) >= 2 for parts in by_block.values())
    assert [json.loads("".join(parts)) for parts in by_block.values()] == [e[1] for e in EXPECTED]
    assert final.stop_reason == whole.stop_reason == "tool_use"


def test_responses_streams_function_call_arguments_delta(api):
    base = dict(model="scripted-tools", input="look at main.py and list /tmp", tools=RESPONSES_TOOLS)
    whole = api.openai.responses.create(**base)
    deltas, final = responses_tool_stream(api.openai, **base)
    calls = [i for i in whole.output if i.type == "function_call"]
    streamed = [i for i in final.output if i.type == "function_call"]
    assert ["".join(parts) for parts in deltas.values()] == [c.arguments for c in calls] == [
        c.arguments for c in streamed]
    assert len(deltas) == 2 and all(len(parts) >= 2 for parts in deltas.values())
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED


def _logprob_values(entries) -> list[tuple[str, float, list[str]]]:
    return [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in entries]


def test_responses_logprobs_equal_chats_with_the_tokens_after_the_last_text_delta(api):
    """Every generated token's logprob reaches the answer's output_text part, stream and not,
    the tool calls' and the end-of-turn token's too (no text delta follows them): the values
    chat reports for the same greedy request."""
    chat = api.openai.chat.completions.create(model="scripted-tools", messages=USER, tools=OPENAI_TOOLS,
                                       temperature=0, logprobs=True, top_logprobs=2)
    want = _logprob_values(chat.choices[0].logprobs.content)
    base = dict(model="scripted-tools", input="look at main.py and list /tmp", tools=RESPONSES_TOOLS,
                temperature=0, top_logprobs=2, include=["message.output_text.logprobs"])
    [whole] = [i for i in api.openai.responses.create(**base).output if i.type == "message"]
    assert _logprob_values(whole.content[0].logprobs) == want
    events = list(api.openai.responses.create(stream=True, **base))
    deltas = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    [done] = [ev for ev in events if ev.type == "response.output_text.done"]
    [final] = [i for i in events[-1].response.output if i.type == "message"]
    assert events[-1].type == "response.completed"
    assert _logprob_values(final.content[0].logprobs) == want
    # The deltas carry the tokens up to the text's end; the done event adds what was decoded
    # before the message closed; the tokens after it are only in the final part.
    assert 0 < len(deltas) <= len(done.logprobs) < len(want)
    assert _logprob_values(done.logprobs) == want[:len(done.logprobs)]
    assert _logprob_values(deltas) == want[:len(deltas)]


def test_malformed_arguments_end_as_a_call_with_the_raw_text_never_a_500(tmp_path_factory):
    checkpoint = write_scripted_checkpoint(tmp_path_factory.mktemp("models") / "scripted-malformed", MALFORMED)
    with serving(checkpoint, tmp_path_factory.mktemp("api-home")) as daemon:
        base = dict(model="scripted-malformed", messages=USER, tools=OPENAI_TOOLS)
        whole = daemon.openai.chat.completions.create(**base).choices[0]
        with daemon.openai.chat.completions.stream(**base) as stream:
            fragments = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
        raw = '{"path": "a.py",,}'
        assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [("read_file", raw)]
        assert "".join(fragments) == raw
        body = {"model": "scripted-malformed", "max_tokens": 50, "messages": USER, "tools": ANTHROPIC_TOOLS}
        reply = httpx.post(daemon.base_url + "/v1/messages", json=body, timeout=60)
        assert reply.status_code == 200
        assert [b["input"] for b in reply.json()["content"] if b["type"] == "tool_use"] == [
            {"_malformed_arguments": raw}]
