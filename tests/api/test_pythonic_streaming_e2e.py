"""LFM2's pythonic tool calls stream per argument through the real daemon, read by the real
SDKs' stream helpers, in all three API dialects.

The model is a scripted tiny checkpoint (fixtures/scripted.py) whose vocabulary carries LFM2's
`<|tool_call_start|>` marker, so the daemon reads its output in the pythonic dialect as it
does an LFM2 checkpoint's. It writes one block of four calls a token per piece, so each
argument completes on its own decode step: a plain one, a call whose string hides quotes and
a pipe, a call without arguments, and one with a positional argument (malformed).
"""

from __future__ import annotations

import json

import pytest

from support.api_daemon import daemon_fixture, scripted
from support.tool_streams import anthropic_tool_stream, openai_chat_tool_stream, responses_tool_stream

MODEL_ID = "scripted-pythonic"
PIECES = ["Let me look.", "<|tool_call_start|>", "[read_file(", 'path="src/main.py"', ", ", "lines=[1, ",
          "20])", ", shell(", 'command="ls -la \\"/tmp\\" | head"', ", timeout=", "30)", ", ls(", ")",
          ", run(", '"positional", ', "force=True", ")]", "<|tool_call_end|>"]
SCHEMAS = {"read_file": {"type": "object", "properties": {"path": {"type": "string"},
                                                         "lines": {"type": "array"}}},
           "shell": {"type": "object", "properties": {"command": {"type": "string"},
                                                      "timeout": {"type": "integer"}}},
           "ls": {"type": "object", "properties": {}},
           "run": {"type": "object", "properties": {"force": {"type": "boolean"}}}}
OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": n, "input_schema": s} for n, s in SCHEMAS.items()]
RESPONSES_TOOLS = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]
USER = [{"role": "user", "content": "look at main.py and list /tmp"}]
EXPECTED = [("read_file", {"path": "src/main.py", "lines": [1, 20]}),
            ("shell", {"command": 'ls -la "/tmp" | head', "timeout": 30}),
            ("ls", {}),
            ("run", {"_malformed_arguments": '"positional", force=True'})]
# One decode step per piece (AR): each fragment is one whole argument, sent on the step that
# completes it (the last one's `)` closes the object too).
AR_FRAGMENTS = [['{"path": "src/main.py"', ', "lines": [1, 20]}'],
                ['{"command": "ls -la \\"/tmp\\" | head"', ', "timeout": 30}'],
                ["{}"],
                ['{"_malformed_arguments": "\\"positional\\", force=True"}']]


api = daemon_fixture(scripted(MODEL_ID, PIECES))


def test_the_scripted_model_speaks_the_pythonic_dialect(api):
    whole = api.openai.chat.completions.create(model=MODEL_ID, messages=USER, tools=OPENAI_TOOLS,
                                               temperature=0).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == EXPECTED
    assert whole.message.content == "Let me look." and whole.finish_reason == "tool_calls"


@pytest.mark.parametrize("depth", [0, 3])
def test_openai_chat_streams_the_name_first_then_one_fragment_per_argument(api, depth):
    base = dict(model=MODEL_ID, messages=USER, tools=OPENAI_TOOLS, temperature=0, extra_body={"mtp_depth": depth})
    whole = api.openai.chat.completions.create(**base).choices[0]
    firsts, fragments, final = openai_chat_tool_stream(api.openai, **base)
    assert [(f.index, f.function.name, f.function.arguments) for f in firsts] == [
        (i, name, "") for i, (name, _) in enumerate(EXPECTED)]
    per_call = [[text for i, text in fragments if i == n] for n in range(len(EXPECTED))]
    if depth == 0:
        assert per_call == AR_FRAGMENTS
    assert ["".join(parts) for parts in per_call] == [c.function.arguments for c in whole.message.tool_calls]
    assert ["".join(parts) for parts in per_call] == [c.function.arguments for c in final.choices[0].message.tool_calls]
    assert whole.message.content == final.choices[0].message.content == "Let me look."
    assert whole.finish_reason == final.choices[0].finish_reason == "tool_calls"


def test_anthropic_streams_each_argument_as_an_input_json_delta(api):
    base = dict(model=MODEL_ID, max_tokens=200, messages=USER, tools=ANTHROPIC_TOOLS,
                extra_body={"mtp_depth": 0})
    whole = api.anthropic.messages.create(**base)
    by_block, final = anthropic_tool_stream(api.anthropic, **base)
    assert [(b.name, b.input) for b in whole.content if b.type == "tool_use"] == EXPECTED
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == EXPECTED
    assert list(by_block.values()) == AR_FRAGMENTS
    assert final.stop_reason == whole.stop_reason == "tool_use"


def test_responses_streams_each_argument_as_a_function_call_arguments_delta(api):
    base = dict(model=MODEL_ID, input="look at main.py and list /tmp", tools=RESPONSES_TOOLS,
                extra_body={"mtp_depth": 0})
    whole = api.openai.responses.create(**base)
    deltas, final = responses_tool_stream(api.openai, **base)
    calls = [i for i in whole.output if i.type == "function_call"]
    streamed = [i for i in final.output if i.type == "function_call"]
    assert list(deltas.values()) == AR_FRAGMENTS
    assert ["".join(parts) for parts in deltas.values()] == [c.arguments for c in calls] == [
        c.arguments for c in streamed]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED


def test_a_call_cut_by_max_tokens_ends_with_its_open_argument_raw_in_every_dialect(api):
    # 4 tokens: the text, the marker, `[read_file(`, `path="src/main.py"` (its `,` never came).
    cut = {"_malformed_arguments": 'path="src/main.py"'}
    base = dict(model=MODEL_ID, messages=USER, tools=OPENAI_TOOLS, max_tokens=4, temperature=0)
    whole = api.openai.chat.completions.create(**base).choices[0]
    with api.openai.chat.completions.stream(**base) as stream:
        fragments = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
        snapshot = stream.current_completion_snapshot.choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("read_file", cut)]
    assert "".join(fragments) == whole.message.tool_calls[0].function.arguments
    assert snapshot.message.tool_calls[0].function.arguments == "".join(fragments)
    assert whole.finish_reason == snapshot.finish_reason == "length"
    claude = api.anthropic.messages.create(model=MODEL_ID, max_tokens=4, messages=USER, tools=ANTHROPIC_TOOLS)
    assert [(b.name, b.input) for b in claude.content if b.type == "tool_use"] == [("read_file", cut)]
    assert claude.stop_reason == "max_tokens"
    reply = api.openai.responses.create(model=MODEL_ID, input="look", tools=RESPONSES_TOOLS, max_output_tokens=4)
    assert [(i.name, json.loads(i.arguments)) for i in reply.output if i.type == "function_call"] == [
        ("read_file", cut)]
