"""The output parser: reasoning and tool calls out of recorded model-format text, and the
property that any chunking of the stream gives exactly the non-streamed result."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplxd.api.parsers import (
    OutputParser, ParsedOutput, ToolCallDelta, ToolCallEvent, ToolCallStart, collect, parse_text,
)

# Recorded in the formats the Qwen families emit (Qwen3: JSON bodies; Qwen3-Coder/3.5: XML).
QWEN3_THINK_THEN_CALL = (
    "<think>\nThe user wants the file. I will call read_file.\n</think>\n\n"
    "Let me read it.\n\n<tool_call>\n"
    '{"name": "read_file", "arguments": {"path": "src/main.py"}}\n</tool_call>'
)
QWEN_CODER_XML_CALLS = (
    "I'll check the directory first.\n<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n"
    "</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=write>\n<parameter=path>\nnotes.md\n</parameter>\n<parameter=content>\n"
    "line one\nline two\n</parameter>\n</function>\n</tool_call>"
)
QWEN35_OPEN_THINK = "The prompt opened the think tag.\nStill thinking.\n</think>\n\nThe answer is 42."
SCHEMAS = {"bash": {"type": "object", "properties": {"command": {"type": "string"},
                                                     "timeout": {"type": "integer"}}}}


def stream(text: str, cuts: list[int], prefix: str = "", **kwargs) -> ParsedOutput:
    """Feed `text` split at `cuts` through one parser, as the streamed path does (after the
    `prefix` the prompt wrote)."""
    parser = OutputParser(**kwargs)
    parser.feed_prefix(prefix)
    events, last = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    return collect(events + parser.finish())


def comparable(out: ParsedOutput) -> tuple:
    return (out.reasoning, out.content, [(c.index, c.name, c.arguments) for c in out.tool_calls],
            [type(b).__name__ for b in out.blocks])


def test_qwen3_think_block_becomes_reasoning_and_json_call_becomes_tool_call():
    out = parse_text(QWEN3_THINK_THEN_CALL, parse_tools=True)
    assert out.reasoning == "The user wants the file. I will call read_file."
    assert out.content == "Let me read it."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("read_file", {"path": "src/main.py"})]
    assert "tool_call" not in out.content and "src/main.py" not in out.content


def test_xml_calls_are_typed_by_the_tool_schema_and_parallel_calls_keep_order():
    out = parse_text(QWEN_CODER_XML_CALLS, parse_tools=True, tool_schemas=SCHEMAS)
    assert out.content == "I'll check the directory first."
    assert [c.name for c in out.tool_calls] == ["bash", "write"]
    assert [c.index for c in out.tool_calls] == [0, 1]
    assert json.loads(out.tool_calls[0].arguments) == {"command": "ls -la", "timeout": 30}
    assert json.loads(out.tool_calls[1].arguments) == {"path": "notes.md", "content": "line one\nline two"}
    assert len({c.id for c in out.tool_calls}) == 2


def test_prompt_that_opened_think_starts_the_output_as_reasoning():
    out = parse_text(QWEN35_OPEN_THINK, parse_tools=False, start_in_reasoning=True)
    assert out.reasoning == "The prompt opened the think tag.\nStill thinking."
    assert out.content == "The answer is 42."


def test_unclosed_reasoning_at_the_end_stays_reasoning():
    out = parse_text("<think>cut off mid thought", parse_tools=True)
    assert (out.reasoning, out.content) == ("cut off mid thought", "")


def test_malformed_and_unterminated_calls_stay_content_byte_for_byte():
    bad = "Before <tool_call>not json at all</tool_call> after"
    out = parse_text(bad, parse_tools=True)
    assert out.tool_calls == [] and out.content == bad
    cut = 'Text\n<tool_call>\n{"name": "read_file", "argu'
    out = parse_text(cut, parse_tools=True)
    assert out.tool_calls == [] and out.content == cut


def test_a_call_cut_off_after_its_name_ends_as_a_call_with_the_text_so_far():
    cut = 'Text\n<tool_call>\n{"name": "read_file", "arguments": {"path": "sr'
    out = parse_text(cut, parse_tools=True)
    assert out.content == "Text"
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("read_file", '{"path": "sr')]
    xml = "<tool_call>\n<function=bash>\n<parameter=command>\nls -l"
    out = parse_text(xml, parse_tools=True, tool_schemas=SCHEMAS)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("bash", {"command": "ls -l"})]


def test_malformed_json_arguments_end_as_a_call_with_the_raw_text():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1,,}}\n</tool_call>'
    out = parse_text(text, parse_tools=True)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", '{"a": 1,,}')]


def test_json_arguments_are_the_models_own_text():
    text = '<tool_call>\n{"name": "f", "arguments": {"b":2,  "a": [1, "x"]}}\n</tool_call>'
    assert parse_text(text, parse_tools=True).tool_calls[0].arguments == '{"b":2,  "a": [1, "x"]}'


def test_xml_string_values_escape_like_json_and_stray_text_is_dropped():
    text = ('<tool_call>\n<function=write>\n<parameter=content>\nsay "hi"\\n\ttab\n\n</parameter>\n'
            "junk<b>\n<parameter=n>\n[1, 2]\n</parameter>\n</function>\n</tool_call>")
    call = parse_text(text, parse_tools=True).tool_calls[0]
    assert json.loads(call.arguments) == {"content": 'say "hi"\\n\ttab\n', "n": [1, 2]}


def streamed_arguments(text: str, cuts: list[int], **kwargs) -> tuple[list[str], list[ToolCallEvent]]:
    """Per call, the argument fragments joined, and the whole calls, as a stream gives them."""
    parser = OutputParser(**kwargs)
    events, last = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    events += parser.finish()
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    ends = [e for e in events if isinstance(e, ToolCallEvent)]
    joined = ["".join(e.text for e in events if isinstance(e, ToolCallDelta) and e.index == s.index)
              for s in starts]
    assert [(s.index, s.id, s.name) for s in starts] == [(e.index, e.id, e.name) for e in ends]
    for start, end in zip(starts, ends):  # every delta of a call lies between its start and end
        first, stop = events.index(start), events.index(end)
        assert all(first < i < stop for i, e in enumerate(events)
                   if isinstance(e, ToolCallDelta) and e.index == start.index)
    return joined, ends


def test_without_tools_markup_is_plain_content():
    text = '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>'
    assert parse_text(text, parse_tools=False).content == text


def test_forced_opener_prefix_completes_a_call():
    prefix = '<tool_call>\n{"name": "read_file", "arguments": '
    out = parse_text('{"path": "a.py"}}\n</tool_call>', parse_tools=True, prefix=prefix)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("read_file", {"path": "a.py"})]
    assert out.content == ""


@pytest.mark.parametrize("output, arguments", [
    ("# pragma: no cover\n</tool_call>", "# pragma: no cover"),  # not JSON: the raw text
    ('"{\\"path\\": 1}"}\n</tool_call>', '"{\\"path\\": 1}"'),
    ("", ""),                                                  # cut off before any argument
    ("{", "{"),
])
def test_a_call_the_prompt_named_stays_a_call_whatever_its_arguments(output, arguments):
    """The prompt wrote the name (tool_choice naming a function): once the name is written it is
    a call, so arguments that are not a JSON object end it with the raw text, never as content."""
    prefix = '<tool_call>\n{"name": "read_file", "arguments": '
    whole = parse_text(output, parse_tools=True, prefix=prefix)
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("read_file", arguments)]
    assert whole.content == ""
    for cut in range(len(output) + 1):  # streamed in two pieces: the same call
        assert comparable(stream(output, [cut], parse_tools=True, prefix=prefix)) == comparable(whole)


def test_raw_mode_keeps_every_character():
    text = "  <think>x</think>\n<tool_call>{}</tool_call>  "
    parser = OutputParser(parse_tools=True, raw=True)
    assert collect(parser.feed(text) + parser.finish()).content == text


def test_lone_angle_brackets_and_partial_tags_are_released_at_the_end():
    for text in ("a < b", "x <tool_ca", "<thin", "<", "cost <think> later"):
        assert parse_text(text, parse_tools=True).content == text


RECORDED = [QWEN3_THINK_THEN_CALL, QWEN_CODER_XML_CALLS, QWEN35_OPEN_THINK,
            "Before <tool_call>not json</tool_call> after", "  \n plain answer with ünïcödé 🚀 \n"]
FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", " ", "  \n\n", "text",
             "<", "<t", "</", "é", '{"name": "f", "arguments": {"a": 1}}', "<function=f>",
             "<parameter=a>", "1", "</parameter>", "</function>", '{"name": "bash", "arguments": ',
             "{", "}", '"', "\\", '"x": "y"', "<function=bash>", "<parameter=command>",
             "<parameter=timeout>", "<parameter=", "</param", "<function="]


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.sampled_from(RECORDED), st.lists(st.sampled_from(FRAGMENTS), max_size=25).map("".join)),
       cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30),
       parse_tools=st.booleans(), start_in_reasoning=st.booleans())
def test_any_chunking_streams_exactly_the_non_streamed_result(text, cuts, parse_tools, start_in_reasoning):
    kwargs = dict(parse_tools=parse_tools, start_in_reasoning=start_in_reasoning, tool_schemas=SCHEMAS)
    whole = parse_text(text, **kwargs)
    chunked = stream(text, [c for c in cuts if c <= len(text)], **kwargs)
    assert comparable(chunked) == comparable(whole)


def test_character_by_character_equals_whole_for_recorded_texts():
    for text in RECORDED:
        whole = parse_text(text, parse_tools=True, tool_schemas=SCHEMAS)
        chunked = stream(text, list(range(len(text))), parse_tools=True, tool_schemas=SCHEMAS)
        assert comparable(chunked) == comparable(whole)


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.sampled_from(RECORDED), st.lists(st.sampled_from(FRAGMENTS), max_size=25).map("".join)),
       cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_streamed_argument_fragments_join_to_the_non_streamed_arguments(text, cuts):
    kwargs = dict(parse_tools=True, tool_schemas=SCHEMAS)
    whole = parse_text(text, **kwargs)
    joined, ends = streamed_arguments(text, [c for c in cuts if c <= len(text)], **kwargs)
    assert joined == [c.arguments for c in whole.tool_calls] == [c.arguments for c in ends]


def test_a_call_streams_its_arguments_before_it_is_closed():
    parser = OutputParser(parse_tools=True, tool_schemas=SCHEMAS)
    head = parser.feed("<tool_call>\n<function=bash>\n")
    assert [(type(e), e.name) for e in head] == [(ToolCallStart, "bash")]
    middle = parser.feed("<parameter=command>\nls -la /tmp an")
    assert "".join(e.text for e in middle) == '{"command": "ls -la /tmp an'
    json_parser = OutputParser(parse_tools=True)
    json_parser.feed('<tool_call>\n{"name": "read_file", "arguments": {"path": "src/ma')
    assert [e.text for e in json_parser.feed("in.py")] == ["in.py"]
