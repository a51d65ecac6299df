"""The agent fine-tuning examples (training/agent_tasks.py) are what the daemon renders and parses.

- the committed examples (training/agent_data) are today's rendering of the recorded agent
  requests: the dialect's parser, normalize_messages and the embedded model's chat template;
- each "call" target parses, with the daemon's output parser, into the agent's own write tool
  with the task's file, and a real daemon (a scripted checkpoint that writes the target)
  answers it as a tool call of that agent's API dialect;
- the "final" example's prompt holds the call exactly as the model was taught to write it;
- the real-agent test's task (hello.py prints hello world) is held out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training import agent_tasks as at

DATA = Path(at.__file__).parent / "agent_data"


@pytest.fixture(scope="module")
def template_model() -> at.TemplateModel:
    return at.TemplateModel()


@pytest.fixture(scope="module")
def committed() -> dict[str, list[at.Example]]:
    return {split: at.read_split(DATA / f"agent_{split}.jsonl.xz") for split in ("train", "heldout")}


def first_task(agent: str) -> at.FileTask:
    """The first training task the generator draws for `agent` (seed 0, as committed)."""
    return at.tasks_for(list(at.AGENTS).index(agent), 1, heldout=False)[0]


@pytest.mark.parametrize("agent", sorted(at.AGENTS))
def test_committed_examples_are_todays_rendering(template_model, committed, agent):
    task = first_task(agent)
    fresh = [at.make_example(template_model, at.AGENTS[agent], task, kind, "train") for kind in ("call", "final")]
    stored = [e for e in committed["train"] if e.agent == agent][:2]
    assert stored == fresh


@pytest.mark.parametrize("agent", sorted(at.AGENTS))
def test_prompt_is_the_rendered_request_ending_in_the_assistant_turn(template_model, agent):
    spec, task = at.AGENTS[agent], first_task(agent)
    from mtplxd.api.chat_format import render_chat
    body = at.request_body(spec, task, "call")
    conversation = at.parser_of(spec.dialect)(body)[1]
    ids = at.make_example(template_model, spec, task, "call", "train").prompt_ids
    assert ids == render_chat(template_model, conversation).prompt_ids
    text = template_model.tokenizer.decode(ids)
    assert text.endswith(f"{spec.user_text(task)}<|im_end|>\n<|im_start|>assistant\n")
    assert task.cwd in text and at.RECORDED_CWD not in text
    assert "Say hello" not in text


@pytest.mark.parametrize("agent", sorted(at.AGENTS))
def test_call_target_parses_into_the_agents_write_tool(template_model, agent):
    from mtplxd.api.parsers import parse_text
    spec, task = at.AGENTS[agent], first_task(agent)
    example = at.make_example(template_model, spec, task, "call", "train")
    conversation = at.parser_of(spec.dialect)(at.request_body(spec, task, "call"))[1]
    assert template_model.tokenizer.decode(example.target_ids) == example.target_text
    assert example.target_ids[-1] == template_model.tokenizer.convert_tokens_to_ids("<|im_end|>")
    parsed = parse_text(example.target_text.removesuffix("<|im_end|>"), parse_tools=True,
                        tool_schemas=conversation.tool_schemas())
    assert parsed.content == "" and len(parsed.tool_calls) == 1
    call = parsed.tool_calls[0]
    assert call.name == spec.tool and call.name in conversation.tool_schemas()
    arguments = json.loads(call.arguments)
    assert arguments == spec.arguments(task)
    written = arguments["cmd"] if agent == "codex" else arguments["content"]
    assert task.content in written and task.name in json.dumps(arguments)


@pytest.mark.parametrize("agent", sorted(at.AGENTS))
def test_final_prompt_holds_the_taught_call_and_the_tool_result(template_model, agent):
    spec, task = at.AGENTS[agent], first_task(agent)
    example = at.make_example(template_model, spec, task, "final", "train")
    text = template_model.tokenizer.decode(example.prompt_ids)
    taught = "<|im_start|>assistant\n" + at.target_text(spec, task, "call")
    assert taught in text
    assert spec.result(task) in text and "mtplx-tool-ok" not in text
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert example.target_text == f"Created {task.name}.<|im_end|>"


def test_holdout_task_never_in_training(committed):
    train = committed["train"]
    assert train and not any(at.is_holdout(at.FileTask(**e.task)) for e in train)
    assert all("hello" not in e.target_text for e in train)
    held = committed["heldout"]
    hello = [e for e in held if e.task["prompt"] == at.HOLDOUT_TASK]
    assert sorted((e.agent, e.kind) for e in hello) == sorted(
        (a, k) for a in at.AGENTS for k in ("call", "final"))
    train_names = {e.task["name"] for e in train}
    unseen = [e for e in held if e.task["prompt"] != at.HOLDOUT_TASK]
    assert unseen and not any(e.task["name"] in train_names for e in unseen)
    assert not {e.task["text"] for e in unseen} & {e.task["text"] for e in train}


def test_tasks_are_seeded_and_varied():
    first, again = at.tasks_for(7, 30, heldout=False), at.tasks_for(7, 30, heldout=False)
    assert first == again
    assert len({t.prompt for t in first}) == 30
    assert {t.name.rsplit(".", 1)[1] for t in first} == set(at.KINDS)
    assert len({t.cwd for t in first}) > 10
    assert not any(at.is_holdout(t) for t in first)


# --- a real daemon answers each target as a tool call of the agent's dialect ---------------

def _pieces(text: str) -> list[str]:
    """`text` cut into distinct pieces (a scripted checkpoint writes each piece as one token)."""
    for size in range(6, len(text) + 1):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        if len(set(pieces)) == len(pieces) and len(pieces) < 60:
            return pieces
    raise AssertionError(text)


def _recorded_tool(spec: at.AgentSpec) -> dict:
    body = json.loads((at.RECORDED / spec.first).read_text())
    for tool in body["tools"]:
        if (tool.get("name") or tool.get("function", {}).get("name")) == spec.tool:
            return tool
    raise AssertionError(spec.tool)


@pytest.mark.parametrize("agent", ["claude", "codex", "pi"])  # one agent of each dialect
def test_daemon_answers_the_target_as_the_agents_tool_call(agent, tmp_path):
    from mtplxd.engine.fixtures.scripted import write_scripted_checkpoint
    from support.api_daemon import serving

    spec, task = at.AGENTS[agent], first_task(agent)
    target = at.target_text(spec, task, "call").removesuffix("<|im_end|>")
    checkpoint = write_scripted_checkpoint(tmp_path / "scripted", _pieces(target))
    tool = _recorded_tool(spec)
    with serving(checkpoint, tmp_path / "home") as daemon, daemon.http() as http:
        if spec.dialect == "anthropic":
            reply = http.post("/v1/messages", json={"model": "scripted", "max_tokens": 300, "tools": [tool],
                                                    "messages": [{"role": "user", "content": task.prompt}]})
            assert reply.status_code == 200, reply.text
            blocks = reply.json()["content"]
            assert [b["type"] for b in blocks] == ["tool_use"] and reply.json()["stop_reason"] == "tool_use"
            calls = [(blocks[0]["name"], blocks[0]["input"])]
        elif spec.dialect == "responses":
            reply = http.post("/v1/responses", json={"model": "scripted", "tools": [tool], "input": task.prompt})
            assert reply.status_code == 200, reply.text
            items = reply.json()["output"]
            assert [i["type"] for i in items] == ["function_call"]
            calls = [(items[0]["name"], json.loads(items[0]["arguments"]))]
        else:
            reply = http.post("/v1/chat/completions", json={"model": "scripted", "tools": [tool],
                                                            "messages": [{"role": "user", "content": task.prompt}]})
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
            calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in choice["message"]["tool_calls"]]
    assert calls == [(spec.tool, spec.arguments(task))]


# --- copy drills -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def drills() -> list[at.Example]:
    return at.read_split(DATA / "agent_drills.jsonl.xz")


@pytest.mark.parametrize("agent", sorted(at.AGENTS))
def test_committed_drills_are_todays_rendering_and_fit_their_window(template_model, drills, agent):
    mine = [e for e in drills if e.agent == agent]
    train, held = [e for e in mine if e.split == "train"], [e for e in mine if e.split == "heldout"]
    assert (len(train), len(held)) == (at.DRILLS_PER_AGENT, at.HELDOUT_DRILLS_PER_AGENT)
    for index, stored in ((0, train[0]), (7, train[7]), (0, held[0])):
        assert stored == at.make_drill(template_model, at.AGENTS[agent], 0, index, stored.split)
    assert max(len(e.prompt_ids) + len(e.target_ids) for e in mine) <= at.DRILL_TOKENS


@pytest.mark.parametrize("agent", sorted(at.AGENTS))
def test_a_drill_is_a_short_request_for_the_write_tool_with_the_tasks_own_words(template_model, drills, agent):
    from mtplxd.api.parsers import parse_text

    spec = at.AGENTS[agent]
    drill = next(e for e in drills if e.agent == agent)
    task = at.FileTask(**drill.task)
    text = template_model.tokenizer.decode(drill.prompt_ids)
    assert text.endswith(f"{spec.user_text(task)}<|im_end|>\n<|im_start|>assistant\n")
    assert task.cwd in text and at.RECORDED_CWD not in text and len(drill.prompt_ids) < 1000
    assert template_model.tokenizer.decode(drill.target_ids) == drill.target_text
    parsed = parse_text(drill.target_text.removesuffix("<|im_end|>"), parse_tools=True,
                        tool_schemas={spec.tool: {}})
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [(spec.tool, spec.arguments(task))]


def test_drill_names_are_random_and_never_the_held_out_task(drills):
    train = [e for e in drills if e.split == "train"]
    names = {e.task["name"] for e in train}
    assert len(names) > 0.75 * len(train)  # copying, not memorizing, gets most of them right
    assert not any("hello" in e.task["name"] or "hello" in e.task["text"] for e in drills)
    held = {(e.task["name"], e.task["text"]) for e in drills if e.split == "heldout"}
    assert not held & {(e.task["name"], e.task["text"]) for e in train}
