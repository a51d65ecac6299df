"""LFM2's pythonic tool-call dialect: recorded LFM2-format output parsed into calls, the
blocks that must stay content, any chunking equal to the whole, and history written back in
the syntax the model reads."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from mtplxd.api.parsers import (
    ContentDelta, OutputParser, ToolCallDelta, ToolCallEvent, ToolCallStart, collect, parse_text,
)
from mtplxd.api.pythonic_tools import CALL_CLOSE, CALL_OPEN, PYTHONIC_TOOLS, parse_pythonic_block, render_calls

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


def test_a_block_that_never_names_a_call_stays_content_byte_for_byte():
    text = "Before <|tool_call_start|>[1 + 2]<|tool_call_end|> after"
    out = parse_text(text, parse_tools=True, dialect=PYTHONIC_TOOLS)
    assert out.tool_calls == [] and out.content == text
    for body in ("[1 + 2]", "[]", "(f(a=1),)", '"f(a=1)"', "[f"):
        assert parse_pythonic_block(body, {}) is None, body


def test_a_named_call_with_unreadable_arguments_keeps_their_text_under_malformed_arguments():
    out = parse_text(NOT_A_CALL, parse_tools=True, dialect=PYTHONIC_TOOLS)
    assert out.content == "Beforeafter"  # whitespace around a call is layout
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("os.system", {"_malformed_arguments": "__import__('x')"})]
    cases = {"[f(1)]": {"_malformed_arguments": "1"}, "[f(**k)]": {"_malformed_arguments": "**k"},
             "[f(x=y)]": {"_malformed_arguments": "x=y"}, "[f(x={1, 2})]": {"_malformed_arguments": "x={1, 2}"},
             "[f(a=1, a=2)]": {"a": 1, "_malformed_arguments": "a=2"},
             "[f(a=1, 2, b=3)]": {"a": 1, "_malformed_arguments": "2, b=3"},
             "[f(a=1, ,)]": {"a": 1, "_malformed_arguments": ","},
             "[f(x=": {"_malformed_arguments": "x="}}
    for body, arguments in cases.items():
        [(name, text)] = parse_pythonic_block(body, {})
        assert (name, json.loads(text)) == ("f", arguments), body


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


# -- streamed per argument ------------------------------------------------------------------

# Calls whose values hide the scanner's delimiters (commas, parentheses, brackets, quotes)
# inside strings and nested literals; `expected` is what the non-streamed parse always gave:
# json.dumps of the keyword arguments.
TRICKY = [
    ('[f(a=1, b="x")]', [("f", {"a": 1, "b": "x"})]),
    ('[ls()]', [("ls", {})]),
    ('[shell(command="echo \\"a, b)\\" | wc -l", timeout=30), ls(path=".")]',
     [("shell", {"command": 'echo "a, b)" | wc -l', "timeout": 30}), ("ls", {"path": "."})]),
    (r"""[edit(path='a.py', old='f(x, y)', new='''g("x", ')')''', lines=[1, (2, 3)], """
     r"""opts={"k": ["]", {"n": None}], 'q': '\\'}, flag=true)]""",
     [("edit", {"path": "a.py", "old": "f(x, y)", "new": "g(\"x\", ')')", "lines": [1, [2, 3]],
                "opts": {"k": ["]", {"n": None}], "q": "\\"}, "flag": True})]),
    ('[a.b.c(x=-1.5e3, y="é ✓", z=""), noop(), last(s="""multi\nline""",)]',
     [("a.b.c", {"x": -1500.0, "y": "é ✓", "z": ""}), ("noop", {}), ("last", {"s": "multi\nline"})]),
    ('get(url="http://x/?a=1&b=(2)")', [("get", {"url": "http://x/?a=1&b=(2)"})]),
]


def streamed_calls(text: str, cuts: list[int], prefix: str = ""):
    """Feed `text` cut at `cuts`; return (events, per-call fragments) and check each call's
    fragments join to its final arguments."""
    parser = OutputParser(parse_tools=True, dialect=PYTHONIC_TOOLS)
    parser.feed_prefix(prefix)
    events, last = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    events += parser.finish()
    fragments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ToolCallDelta):
            fragments.setdefault(event.index, []).append(event.text)
    for call in collect(events).tool_calls:
        assert "".join(fragments[call.index]) == call.arguments
    return events, fragments


def test_fragments_are_one_per_complete_argument_and_join_to_json_dumps_of_the_arguments():
    for body, expected in TRICKY:
        text = CALL_OPEN + body + CALL_CLOSE
        whole = parse_text(text, parse_tools=True, dialect=PYTHONIC_TOOLS).tool_calls
        assert [(c.name, c.arguments) for c in whole] == [
            (name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in expected], body
        for cuts in ([], list(range(len(text))), list(range(0, len(text), 7))):
            events, fragments = streamed_calls(text, cuts)
            assert [c.arguments for c in collect(events).tool_calls] == [c.arguments for c in whole]
        # Character by character: a fragment per argument (the last one's `)` also closes the
        # object, so its `}` rides along), each a whole argument: what was sent so far plus
        # `}` is always a JSON object.
        for index, (_, arguments) in enumerate(expected):
            assert len(fragments[index]) >= max(len(arguments), 1)
            for end in range(1, len(fragments[index])):
                assert len(json.loads("".join(fragments[index][:end]) + "}")) == end


def test_the_call_opens_at_its_name_and_each_argument_is_sent_when_complete():
    parser = OutputParser(parse_tools=True, dialect=PYTHONIC_TOOLS)
    assert parser.feed("Sure.<|tool_call_start|>[read_fi") == [ContentDelta("Sure.")]
    [start] = parser.feed("le(")
    assert isinstance(start, ToolCallStart) and (start.index, start.name) == (0, "read_file")
    assert parser.feed('path="a, (b).py"') == []  # held until its `,` or `)`
    assert parser.feed(", lines=[1,") == [ToolCallDelta(0, '{"path": "a, (b).py"')]
    assert parser.feed(" 2])") == [ToolCallDelta(0, ', "lines": [1, 2]}'),
                                   ToolCallEvent(0, start.id, "read_file", '{"path": "a, (b).py", "lines": [1, 2]}')]
    [second] = parser.feed(", ls(")
    assert (second.index, second.name) == (1, "ls")
    assert parser.feed(")]<|tool_call_end|> done") == [
        ToolCallDelta(1, "{}"), ToolCallEvent(1, second.id, "ls", "{}"), ContentDelta("done")]


def test_a_call_cut_by_max_tokens_ends_with_the_open_argument_raw_and_sent_fragments_kept():
    events, fragments = streamed_calls('<|tool_call_start|>[write(path="a.py", body="def f(', [30, 40])
    [call] = collect(events).tool_calls
    assert fragments[0][0] == '{"path": "a.py"'
    assert json.loads(call.arguments) == {"path": "a.py", "_malformed_arguments": 'body="def f('}


def test_a_forced_opener_in_the_prompt_announces_the_call_with_the_first_output():
    events, _ = streamed_calls('path="main.py")]<|tool_call_end|>', [3], prefix="<|tool_call_start|>[read_file(")
    assert isinstance(events[0], ToolCallStart) and events[0].name == "read_file"
    assert [(c.name, c.arguments) for c in collect(events).tool_calls] == [("read_file", '{"path": "main.py"}')]


STREAM_PIECES = ["<|tool_call_start|>", "<|tool_call_end|>", "[", "]", "f(", "g.h(", "a=1", "b=", '"x, )"',
                 "'''", "''", '"', "\\", ",", " ", ")", "(", "[1, (2", "{", "}", '{"k": [', "=", "2", "é", "<|"]


@settings(max_examples=300, deadline=None)
@given(body=st.one_of(st.sampled_from([CALL_OPEN + b + CALL_CLOSE for b, _ in TRICKY]),
                      st.lists(st.sampled_from(STREAM_PIECES), max_size=30).map("".join)),
       cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=40))
def test_any_chunking_of_any_text_streams_fragments_that_join_to_the_non_streamed_arguments(body, cuts):
    whole = parse_text(body, parse_tools=True, dialect=PYTHONIC_TOOLS)
    events, _ = streamed_calls(body, [c for c in cuts if c <= len(body)])  # checks the joins
    assert comparable(collect(events)) == comparable(whole)


def test_the_dialect_is_pythonic_where_the_vocabulary_has_the_call_marker_as_a_token():
    """A template that never names the markers still gets LFM2's dialect when the tokenizer
    holds `<|tool_call_start|>` as one token; `</think>` is found the same way."""
    from transformers import PreTrainedTokenizerFast

    from mtplxd.api.chat_format import single_token_id, tool_dialect
    from mtplxd.api.parsers import QWEN_TOOLS, THINK_CLOSE
    from mtplxd.models.builtin import EMBEDDED_MODEL_DIR

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(EMBEDDED_MODEL_DIR / "tokenizer.json"))
    assert tool_dialect(tokenizer, "{{ messages }}") is QWEN_TOOLS
    assert single_token_id(tokenizer, THINK_CLOSE) == 4
    tokenizer.add_special_tokens({"additional_special_tokens": [CALL_OPEN]})
    assert tool_dialect(tokenizer, "{{ messages }}") is PYTHONIC_TOOLS
