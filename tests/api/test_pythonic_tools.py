"""LFM2's pythonic tool-call dialect: recorded LFM2-format output parsed into calls, the
blocks that must stay content, any chunking equal to the whole, and history written back in
the syntax the model reads."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from mtplxd.api.parsers import OutputParser, collect, parse_text
from mtplxd.api.pythonic_tools import PYTHONIC_TOOLS, parse_pythonic_block, render_calls

# Recorded in the format LFM2/LFM2.5 emit (LFM2.5 thinking checkpoints open with <think>).
LFM2_CALLS = ('Let me look.<|tool_call_start|>[read_file(path="src/main.py"), '
              'bash(command="ls -la", timeout=30)]<|tool_call_end|>')
LFM25_THINK_THEN_CALL = ("<think>The user wants the weather.</think>"
                         '<|tool_call_start|>[get_weather(city="Paris", days=3, metric=true, '
                         'opts={"lang": "fr"}, tags=["a", "b"])]<|tool_call_end|>Checking now.')
NOT_A_CALL = "Before <|tool_call_start|>[os.system(__import__('x'))]<|tool_call_end|> after"


def pythonic_stream(text: str, cuts: list[int]):
    parser = OutputParser(parse_tools=True, dialect=PYTHONIC_TOOLS)
    events, last = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    return collect(events + parser.finish())


def comparable(out) -> tuple:
    return (out.reasoning, out.content, [(c.index, c.name, c.arguments) for c in out.tool_calls])


def test_one_block_with_two_calls_becomes_two_structured_tool_calls():
    out = parse_text(LFM2_CALLS, parse_tools=True, dialect=PYTHONIC_TOOLS)
    assert out.content == "Let me look."
    assert [(c.index, c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        (0, "read_file", {"path": "src/main.py"}), (1, "bash", {"command": "ls -la", "timeout": 30})]


def test_thinking_then_call_with_json_spellings_and_nested_values():
    out = parse_text(LFM25_THINK_THEN_CALL, parse_tools=True, dialect=PYTHONIC_TOOLS)
    assert out.reasoning == "The user wants the weather."
    assert out.content == "Checking now."
    assert json.loads(out.tool_calls[0].arguments) == {
        "city": "Paris", "days": 3, "metric": True, "opts": {"lang": "fr"}, "tags": ["a", "b"]}


def test_code_that_is_not_a_literal_call_stays_content_byte_for_byte():
    out = parse_text(NOT_A_CALL, parse_tools=True, dialect=PYTHONIC_TOOLS)
    assert out.tool_calls == [] and out.content == NOT_A_CALL
    for body in ("[f(1)]", "[f(**k)]", "[f(x=y)]", "[f(x={1, 2})]", "[1 + 2]", "[f(x=", "[]"):
        assert parse_pythonic_block(body, {}) is None, body


def test_unterminated_block_is_content_and_qwen_markup_is_plain_text_here():
    text = 'a <tool_call>{"name": "f", "arguments": {}}</tool_call> <|tool_call_start|>[f(x=1)'
    out = parse_text(text, parse_tools=True, dialect=PYTHONIC_TOOLS)
    assert out.tool_calls == [] and out.content == text


def test_history_calls_render_back_into_the_same_syntax():
    calls = [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "metric": True, "n": None,
                                                        "opts": {"lang": "fr"}, "q": 'say "hi"'})}}]
    text = render_calls(calls)
    assert text == ('<|tool_call_start|>[get_weather(city="Paris", metric=True, n=None, '
                    'opts={"lang": "fr"}, q="say \\"hi\\"")]<|tool_call_end|>')
    parsed = parse_text(text, parse_tools=True, dialect=PYTHONIC_TOOLS).tool_calls
    assert json.loads(parsed[0].arguments) == json.loads(calls[0]["function"]["arguments"])


FRAGMENTS = ["<think>", "</think>", "<|tool_call_start|>", "<|tool_call_end|>", "[", "]", "\n",
             " ", "text", "<|", "<|tool", 'f(a=1)', ", ", 'g(s="x")', "é"]


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(st.sampled_from([LFM2_CALLS, LFM25_THINK_THEN_CALL, NOT_A_CALL]),
                      st.lists(st.sampled_from(FRAGMENTS), max_size=25).map("".join)),
       cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=30))
def test_any_chunking_streams_exactly_the_non_streamed_result(text, cuts):
    whole = parse_text(text, parse_tools=True, dialect=PYTHONIC_TOOLS)
    assert comparable(pythonic_stream(text, [c for c in cuts if c <= len(text)])) == comparable(whole)
