"""The three SSE writers fed recorded model output (reasoning + text + tool calls), read back
by the real SDKs' stream accumulators: the event sequences must rebuild the same message the
non-streamed parse gives. (A random tiny model never writes a well-formed tool call, so the
model side is a recording here; the HTTP side is covered end to end in the *_e2e tests.)"""

from __future__ import annotations

import json

import anthropic as anthropic_sdk
import httpx
import httpx2
import openai as openai_sdk
import pytest
import trio

from mtplxd.api import anthropic, openai, responses
from mtplxd.api.parsers import OutputParser, collect, parse_text
from mtplxd.api.service import TICK, Outcome, Plan
from mtplxd.engine.interface import GenerationRequest, GenerationResult, GenerationStats, SamplingParams

RECORDED = (
    "<think>\nThe user wants the file and a listing.\n</think>\n\nLet me look.\n\n<tool_call>\n"
    '{"name": "read_file", "arguments": {"path": "src/main.py"}}\n</tool_call>\n<tool_call>\n'
    "<function=shell>\n<parameter=command>\nls -la\n</parameter>\n</function>\n</tool_call>"
)
SCHEMAS = {"read_file": {"type": "object", "properties": {"path": {"type": "string"}}},
           "shell": {"type": "object", "properties": {"command": {"type": "string"}}}}


class RecordedGenerations:
    """Plays recorded text through the real parser as `Generations.stream` would."""

    def __init__(self, text: str, finish_reason: str = "stop") -> None:
        self.text = text
        self.finish_reason = finish_reason

    async def stream(self, plan: Plan):
        parser = plan.new_parser()
        yield TICK
        for i in range(0, len(self.text), 7):
            events = parser.feed(self.text[i:i + 7])
            if events:
                yield events
        tail = parser.finish()
        if tail:
            yield tail
        stats = GenerationStats(prompt_tokens=10, completion_tokens=42, depth=3, finish_reason=self.finish_reason)
        result = GenerationResult(text=self.text, token_ids=[1] * 42, finish_reason=self.finish_reason, stats=stats)
        summary = parse_text(self.text, parse_tools=True, tool_schemas=SCHEMAS)
        yield Outcome(plan, result, summary, reasoning_tokens=9, stop_sequence=None)


def plan() -> Plan:
    return Plan(id="r-1", endpoint="test", model_id="recorded", max_tokens=100, max_tokens_requested=None,
                request=GenerationRequest([1, 2, 3], SamplingParams()), parse_tools=True, tool_schemas=SCHEMAS)


def render(writer) -> bytes:
    async def collect() -> bytes:
        return b"".join([frame async for frame in writer])

    return trio.run(collect)


def sdk_transport(body: bytes, http=httpx):
    """A client of `http` (httpx, or httpx2 for the anthropic SDK) whose every answer is `body`
    as an event stream: it stands in for the server, so the SDK parses exactly these bytes."""
    return http.Client(transport=http.MockTransport(
        lambda request: http.Response(200, content=body, headers={"content-type": "text/event-stream"})))


EXPECTED = parse_text(RECORDED, parse_tools=True, tool_schemas=SCHEMAS)


def test_openai_chat_stream_rebuilds_reasoning_content_and_tool_calls():
    body = render(openai._chat_stream(RecordedGenerations(RECORDED), plan(), "chatcmpl-x", include_usage=True))
    assert body.startswith(b"data: ") and body.endswith(b"data: [DONE]\n\n")
    assert b": keep-alive" in body
    client = openai_sdk.OpenAI(base_url="http://test/v1", api_key="x", http_client=sdk_transport(body))
    with client.chat.completions.stream(model="recorded", messages=[{"role": "user", "content": "x"}]) as stream:
        fragments = [(e.index, e.arguments_delta) for e in stream
                     if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    message = final.choices[0].message
    # The arguments arrive in pieces, as decoded (7-character chunks here), and join to the
    # non-streamed arguments byte for byte.
    assert len(fragments) > 2
    assert ["".join(f for i, f in fragments if i == n) for n in (0, 1)] == [
        c.arguments for c in EXPECTED.tool_calls] == [c.function.arguments for c in message.tool_calls]
    assert message.content == EXPECTED.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("read_file", {"path": "src/main.py"}), ("shell", {"command": "ls -la"})]
    assert final.choices[0].finish_reason == "tool_calls"
    chunks = [json.loads(line[6:]) for line in body.decode().splitlines()
              if line.startswith("data: {")]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    assert reasoning == EXPECTED.reasoning
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 9


def test_anthropic_stream_rebuilds_thinking_text_and_tool_use_blocks():
    body = render(anthropic._stream(RecordedGenerations(RECORDED), plan(), "msg_x"))
    client = anthropic_sdk.Anthropic(base_url="http://test", api_key="x", http_client=sdk_transport(body, httpx2))
    with client.messages.stream(model="recorded", max_tokens=10, messages=[{"role": "user", "content": "x"}]) as s:
        partial = [e.partial_json for e in s if e.type == "input_json"]
        final = s.get_final_message()
    assert len(partial) > 2
    assert "".join(partial) == "".join(c.arguments for c in EXPECTED.tool_calls)
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert final.content[0].thinking == EXPECTED.reasoning
    assert final.content[1].text == "Let me look."
    assert [(b.name, b.input) for b in final.content[2:]] == [("read_file", {"path": "src/main.py"}),
                                                               ("shell", {"command": "ls -la"})]
    assert final.stop_reason == "tool_use"
    assert b"event: ping" in body


@pytest.mark.parametrize("finish,stop_reason", [("length", "max_tokens")])
def test_anthropic_max_tokens_beats_tool_use(finish, stop_reason):
    body = render(anthropic._stream(RecordedGenerations(RECORDED, finish), plan(), "msg_x"))
    delta = [json.loads(line[6:]) for line in body.decode().splitlines()
             if line.startswith("data: ") and '"message_delta"' in line][0]
    assert delta["delta"]["stop_reason"] == stop_reason


def test_responses_stream_rebuilds_reasoning_message_and_function_calls():
    tools = responses.ToolMap()
    tools.add({"type": "function", "name": "read_file", "parameters": SCHEMAS["read_file"]}, "tools[0]")
    tools.add({"type": "namespace", "name": "sys", "tools": [
        {"type": "function", "name": "shell", "parameters": SCHEMAS["shell"]}]}, "tools[1]")
    text = RECORDED.replace("<function=shell>", "<function=sys__shell>")
    the_plan = plan()
    the_plan.tool_schemas = {"read_file": SCHEMAS["read_file"], "sys__shell": SCHEMAS["shell"]}
    body = render(responses._stream(RecordedGenerations(text), the_plan, "resp_x", {}, tools))
    client = openai_sdk.OpenAI(base_url="http://test/v1", api_key="x", http_client=sdk_transport(body))
    with client.responses.stream(model="recorded", input="x") as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert len(deltas) > 2
    assert "".join(deltas) == final.output[2].arguments + final.output[3].arguments
    kinds = [item.type for item in final.output]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    assert final.output[0].content[0].text == EXPECTED.reasoning
    assert final.output_text == "Let me look."
    read, shell = final.output[2], final.output[3]
    assert (read.name, json.loads(read.arguments)) == ("read_file", {"path": "src/main.py"})
    assert (shell.name, shell.namespace, json.loads(shell.arguments)) == ("shell", "sys", {"command": "ls -la"})
    assert read.call_id != shell.call_id
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))



def test_responses_stream_marks_the_item_the_cap_cut_off_incomplete():
    """A call cut off by max_output_tokens (its arguments cut mid-JSON) is `incomplete`, in its
    output_item.done and in the final response, so an agent does not run it as if whole; the
    items before it are `completed`."""
    tools = responses.ToolMap()
    tools.add({"type": "function", "name": "read_file", "parameters": SCHEMAS["read_file"]}, "tools[0]")
    cut = 'Sure.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "src/ma'
    body = render(responses._stream(RecordedGenerations(cut, "length"), plan(), "resp_x", {}, tools))
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [("message", "completed"), ("function_call", "incomplete")]
    assert done[1]["arguments"] == '{"path": "src/ma'
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert [i["status"] for i in final["response"]["output"]] == ["completed", "incomplete"]
    whole = render(responses._stream(RecordedGenerations(cut.replace("src/ma", "x\"}}\n</tool_call>"), "stop"),
                                     plan(), "resp_y", {}, tools))
    ended = [json.loads(line[6:]) for line in whole.decode().splitlines() if line.startswith("data: ")]
    assert [i["status"] for i in ended[-1]["response"]["output"]] == ["completed", "completed"]

def test_openai_stream_of_a_cut_off_call_reports_length_and_keeps_the_text():
    cut = 'Sure.\n<tool_call>\n{"name": "read_file", "argu'
    body = render(openai._chat_stream(RecordedGenerations(cut, "length"), plan(), "c", include_usage=False))
    chunks = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == cut
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_parser_of_a_plan_with_a_forced_opener_completes_the_call():
    forced = plan()
    forced.output_prefix = '<tool_call>\n{"name": "read_file", "arguments": '
    parser: OutputParser = forced.new_parser()
    events = parser.feed('{"path": "x"}}\n</tool_call>') + parser.finish()
    calls = collect(events).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("read_file", {"path": "x"})]


def test_reasoning_tokens_count_the_think_tags_with_the_reasoning_between_them():
    """A 1-token turn whose token is `<think>` is one reasoning token, as is `</think>`; the
    answer after it is not."""
    from mtplxd.api.service import feed_counting_reasoning
    from mtplxd.engine.interface import TokenDelta

    parser = OutputParser(parse_tools=False)
    counted = [feed_counting_reasoning(parser, TokenDelta([i], text))[1]
               for i, text in enumerate(["<think>", "plan", " more", "</think>", "\n\n", "answer"])]
    assert counted == [1, 1, 1, 1, 0, 0]


def test_reasoning_tokens_do_not_depend_on_how_many_tokens_a_cycle_commits():
    """An MTP cycle commits several tokens at once: a delta that closes the reasoning may
    carry the answer's first tokens, and one may open and close it. The count runs through
    the `</think>` token, as one token a delta would count it."""
    from mtplxd.api.service import feed_counting_reasoning
    from mtplxd.engine.interface import TokenDelta

    pieces = [(3, "<think>"), (10, "plan"), (4, "</think>"), (11, "\n\n"), (12, "answer"), (13, " on")]

    def count(sizes: list[int]) -> int:
        parser, total, at = OutputParser(parse_tools=False), 0, 0
        for size in sizes:
            ids, texts = zip(*pieces[at:at + size])
            total += feed_counting_reasoning(parser, TokenDelta(list(ids), "".join(texts)), think_close_id=4)[1]
            at += size
        return total

    assert [count(sizes) for sizes in ([1] * 6, [2, 4], [3, 3], [6], [1, 5], [4, 1, 1])] == [3] * 6
