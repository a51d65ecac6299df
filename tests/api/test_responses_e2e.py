"""/v1/responses (stateless, what Codex speaks) through the real `openai` client."""

from __future__ import annotations

import openai
import pytest

from support.api_daemon import installed_codex_config

MODEL_ID = "tiny-qwen3"
CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Run a command", "strict": False,
     "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}}},
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    {"type": "namespace", "name": "mcp__files", "description": "File tools",
     "tools": [{"type": "function", "name": "read", "parameters": {"type": "object", "properties": {}}}]},
    {"type": "web_search", "external_web_access": False},
    {"type": "image_generation"},
]
INPUT = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
]


@pytest.fixture(scope="module")
def client(api):
    with openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def codex_request(**overrides):
    """A request shaped like Codex 0.16x sends it."""
    return {"model": MODEL_ID, "instructions": "You are a coding agent.", "input": INPUT,
            "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"summary": "auto", "effort": "medium"}, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc",
            "max_output_tokens": 16, "temperature": 0, **overrides}


def test_codex_shaped_request_streams_the_responses_event_sequence(client):
    events = list(client.responses.create(stream=True, **codex_request()))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    # The request's tools and sampling come back as sent (the SDK parses every tool type).
    assert [tool.type for tool in final.tools] == [tool["type"] for tool in CODEX_TOOLS]
    assert final.temperature == 0 and final.top_p is None and final.store is False
    assert final.usage.output_tokens == final.model_extra["mtplx_stats"]["completion_tokens"]
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.output_index for e in added] == [e.output_index for e in done]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final_text = "".join(c.text for item in final.output if item.type == "message" for c in item.content)
    assert text == final_text


def test_streamed_and_whole_responses_have_the_same_output(client):
    whole = client.responses.create(**codex_request())
    events = list(client.responses.create(stream=True, **codex_request()))
    final = events[-1].response  # response.completed, or response.incomplete when capped
    assert whole.output_text == final.output_text
    assert whole.status == final.status
    if whole.status == "incomplete":
        assert events[-1].type == "response.incomplete"
        assert whole.incomplete_details.reason == "max_output_tokens"


def test_declared_hosted_tools_are_ignored_with_a_warning_header(client):
    raw = client.responses.with_raw_response.create(**codex_request(max_output_tokens=2))
    assert raw.headers["x-mtplx-ignored-tools"] == "web_search,image_generation"
    assert raw.parse().status in ("completed", "incomplete")


def test_forcing_a_hosted_tool_is_a_400_saying_how_to_turn_it_off(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**codex_request(tool_choice={"type": "web_search"}))
    assert err.value.body["param"] == "tool_choice"
    assert 'web_search = "disabled"' in err.value.body["message"]


def test_function_call_history_round_trips(client):
    history = [
        *INPUT,
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command": ["ls"]}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Done"},
        {"type": "function_call", "call_id": "call_3", "name": "read", "namespace": "mcp__files",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_3", "output": [{"type": "input_text", "text": "x"}]},
    ]
    reply = client.responses.create(**codex_request(input=history, max_output_tokens=3))
    assert reply.usage.input_tokens > 0


def test_stateless_server_refuses_previous_response_id(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**codex_request(previous_response_id="resp_123"))
    assert err.value.body["param"] == "previous_response_id"


def test_codex_installed_for_a_thinking_switch_model_keeps_codexs_own_effort(api, client, tmp_path):
    levels = ["none", "minimal", "low", "medium", "high", "xhigh"]
    assert api.client.call("daemon.status")["model"]["reasoning_efforts"] == levels
    config = installed_codex_config(api, tmp_path / "codex")
    assert config["model"] == MODEL_ID and "model_reasoning_effort" not in config
    # Every level Codex can send is the model's; its default ("medium") is answered.
    reply = client.responses.create(**codex_request(max_output_tokens=1))
    assert reply.status in ("completed", "incomplete")


def test_reasoning_effort_maps_to_the_thinking_switch(client):
    off = client.responses.create(**codex_request(reasoning={"effort": "none"}, max_output_tokens=1))
    on = client.responses.create(**codex_request(reasoning={"effort": "high"}, max_output_tokens=1))
    assert off.usage.input_tokens > on.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**codex_request(reasoning={"effort": "maximum"}))
    assert err.value.body["param"] == "reasoning.effort"


def test_a_call_the_output_cap_cuts_off_is_incomplete_not_completed(client):
    """A forced call given 3 output tokens ends mid-arguments: the response is `incomplete`,
    and so is the call (Codex must not run a cut call as if whole), streamed or not."""
    request = codex_request(tool_choice={"type": "function", "name": "shell"}, max_output_tokens=3)
    whole = client.responses.create(**request)
    assert whole.status == "incomplete"
    assert [(item.type, item.status) for item in whole.output][-1] == ("function_call", "incomplete")
    events = list(client.responses.create(stream=True, **request))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert (done[-1].type, done[-1].status) == ("function_call", "incomplete")
    assert events[-1].type == "response.incomplete"
