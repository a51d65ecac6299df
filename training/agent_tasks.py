"""Supervised examples that teach the embedded model to do small file tasks inside each agent.

Every example starts from a request an agent really sent (tests/api/data: first request with
its full system prompt and tool schemas, and the request after a tool call, with the tool's
result in the agent's wire format). The user's task is replaced by a small, seeded task
("create NAME.py that prints TEXT", .sh, .txt), the working directory by a varied one, and the
body is rendered exactly as the daemon renders it: the dialect's parser, then
`mtplxd.api.chat_format.render_chat` (normalize_messages + the model's chat template through
the tokenizer). Two kinds of example per task:

- "call": the first request -> the assistant turn that calls the agent's own file-writing
  tool (Codex has none: its shell tool with a heredoc), written in the model's tool-call
  syntax `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>`;
- "final": the request after that call (the agent's success message as the tool result) ->
  "Created NAME.<|im_end|>".

The target is what the model must generate after the rendered prompt; training takes the loss
on those tokens only. The test task of tests/agents/test_real_agents.py ("Create a file named
hello.py that prints hello world") never appears in training: no training name contains
"hello" and no training text does; it is in the held-out split, beside tasks whose names,
messages and wordings come from word lists training never draws from.

    python -m training.agent_tasks    # writes training/agent_data/agent_{train,heldout}.jsonl.xz
"""

from __future__ import annotations

import argparse
import copy
import json
import lzma
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
RECORDED = REPO / "tests" / "api" / "data"
EMBEDDED = REPO / "mtplxd" / "models" / "embedded"
RECORDED_CWD = "/tmp/qa-work"  # the working directory of every recorded run
HOLDOUT_TASK = "Create a file named hello.py that prints hello world"  # the real-agent test's

# Train and held-out tasks draw from disjoint lists, so held-out names, messages and some
# wordings are unseen. Nothing in the train lists contains "hello".
TRAIN_STEMS = ("greet", "main", "app", "demo", "banner", "motd", "note", "info", "status",
               "welcome", "say", "output", "message", "intro", "ping", "first", "sample", "tool",
               "run", "start", "notes", "log", "todo", "msg", "hi", "shout", "show", "display",
               "announce", "report", "answer", "quote", "greeting", "test_print", "my_script")
HELDOUT_STEMS = ("salute", "herald", "yell", "bulletin", "memo", "notice", "signal", "motto")
TRAIN_WORDS = (("good", "happy", "fast", "quiet", "blue", "green", "small", "big", "bright",
                "simple", "clean", "warm", "hi", "done", "ready", "build"),
               ("morning", "day", "code", "cat", "tree", "river", "ok", "team", "friend",
                "there", "night", "job", "test", "python", "shell"))
HELDOUT_WORDS = (("ocean", "silver", "golden", "cosmic"), ("breeze", "moon", "harbor", "lantern"))
TRAIN_WORDINGS = {
    "prints": ("Create a file named {name} that prints {text}", "Write a script {name} that prints {text}",
               "Make {name} print {text}", "Create {name} which outputs \"{text}\"",
               "Please add a file called {name} that prints {text}.",
               "create {name} that prints {text}"),
    "contains": ("Create a file named {name} that contains {text}", "Write {text} into a new file {name}",
                 "Make a text file {name} with the text {text}", "create {name} containing {text}"),
}
HELDOUT_WORDINGS = {
    "prints": ("Create a file named {name} that prints {text}", "I need {name}, it should print {text}"),
    "contains": ("Create a file named {name} that contains {text}", "Put the line {text} in a file {name}"),
}
KINDS = ("py", "sh", "txt")
DRILLS_PER_AGENT = 2000  # copy drills (below): a 490-step round with 16 a step uses 7,840
HELDOUT_DRILLS_PER_AGENT = 10
DRILL_TOKENS = 1024  # a drill's prompt + target at most (the write tool alone fits in every agent)
USERS = ("alex", "sam", "dev", "kim", "lee", "runner")
PROJECTS = ("proj", "work", "demo", "repo", "code", "play", "scratch")


@dataclass(frozen=True)
class FileTask:
    """One small task: the user's words, the file's name and its exact content."""

    prompt: str
    name: str
    text: str
    content: str
    cwd: str


def file_content(name: str, text: str) -> str:
    """What the file must hold: a Python print, a shell echo, or the text itself."""
    if name.endswith(".py"):
        return f'print("{text}")\n'
    if name.endswith(".sh"):
        return f'#!/bin/sh\necho "{text}"\n'
    return text + "\n"


def random_cwd(rng: random.Random) -> str:
    """A working directory like the agents see: pytest's tmp_path (the real-agent test) or a home."""
    shape = rng.randrange(3)
    if shape == 0:
        return (f"/tmp/pytest-of-{rng.choice(USERS)}/pytest-{rng.randrange(1, 40)}/"
                f"test_real_agent_does_a_small_c{rng.randrange(5)}/project")
    if shape == 1:
        return f"/home/{rng.choice(USERS)}/{rng.choice(PROJECTS)}"
    return f"/tmp/{rng.choice(PROJECTS)}-{rng.randrange(100, 999)}"


def make_task(rng: random.Random, heldout: bool) -> FileTask:
    """A seeded task from the train or the held-out lists."""
    stems, words, wordings = ((HELDOUT_STEMS, HELDOUT_WORDS, HELDOUT_WORDINGS) if heldout
                              else (TRAIN_STEMS, TRAIN_WORDS, TRAIN_WORDINGS))
    name = f"{rng.choice(stems)}.{rng.choice(KINDS)}"
    text = f"{rng.choice(words[0])} {rng.choice(words[1])}"
    verb = "contains" if name.endswith(".txt") else "prints"
    prompt = rng.choice(wordings[verb]).format(name=name, text=text)
    return FileTask(prompt, name, text, file_content(name, text), random_cwd(rng))


def holdout_task(rng: random.Random) -> FileTask:
    """The real-agent test's task, in a pytest-like working directory."""
    cwd = f"/tmp/pytest-of-root/pytest-{rng.randrange(1, 40)}/test_real_agent_does_a_small_c{rng.randrange(5)}/project"
    return FileTask(HOLDOUT_TASK, "hello.py", "hello world", file_content("hello.py", "hello world"), cwd)


def is_holdout(task: FileTask) -> bool:
    """Whether a task touches the held-out test task (its file name or its message)."""
    return "hello" in task.name or "hello" in task.text or task.prompt == HOLDOUT_TASK


# --- each agent's own tools -------------------------------------------------------------

def _heredoc(task: FileTask) -> str:
    return f"cat > {task.name} <<'EOF'\n{task.content}EOF"


@dataclass(frozen=True)
class AgentSpec:
    """How one agent writes a file and what it sends back after the write."""

    name: str
    endpoint: str
    first: str            # recorded first request (tests/api/data)
    tool_result: str      # recorded request after a tool call
    dialect: str          # "chat", "anthropic" or "responses"
    tool: str             # the tool the model calls
    arguments: Callable[[FileTask], dict[str, Any]]
    result: Callable[[FileTask], str]  # the tool's output as the agent returns it
    user_format: str = "{}"  # how the agent sends the user's words (OpenCode quotes them)

    def user_text(self, task: FileTask) -> str:
        """The user message's text as this agent sends `task`."""
        return self.user_format.format(task.prompt)


AGENTS: dict[str, AgentSpec] = {spec.name: spec for spec in (
    AgentSpec("claude", "/v1/messages", "claude_code_2.1.197_messages.json",
              "claude_code_2.1.197_messages_tool_result.json", "anthropic", "Write",
              lambda t: {"file_path": f"{t.cwd}/{t.name}", "content": t.content},
              lambda t: f"File created successfully at: {t.cwd}/{t.name}"),
    AgentSpec("codex", "/v1/responses", "codex_0.171.0_responses.json",
              "codex_0.171.0_responses_tool_result.json", "responses", "exec_command",
              lambda t: {"cmd": _heredoc(t)},
              lambda t: ("Chunk ID: 325265\nWall time: 0.0000 seconds\nProcess exited with code 0\n"
                         "Original token count: 0\nOutput:\n")),
    AgentSpec("hermes", "/v1/chat/completions", "hermes_0.19.0_chat_completions.json",
              "hermes_0.19.0_chat_completions_tool_result.json", "chat", "write_file",
              lambda t: {"path": t.name, "content": t.content},
              lambda t: json.dumps({"bytes_written": len(t.content.encode()), "dirs_created": False})),
    AgentSpec("opencode", "/v1/chat/completions", "opencode_1.18.33_chat_completions.json",
              "opencode_1.18.33_chat_completions_tool_result.json", "chat", "write",
              lambda t: {"filePath": f"{t.cwd}/{t.name}", "content": t.content},
              lambda t: "Wrote file successfully.",
              # `opencode run "Say hello"` sent the message '"Say hello"' (tests/api/data).
              user_format='"{}"'),
    AgentSpec("pi", "/v1/chat/completions", "pi_0.73.1_chat_completions.json",
              "pi_0.73.1_chat_completions_tool_result.json", "chat", "write",
              lambda t: {"path": t.name, "content": t.content},
              lambda t: f"Successfully wrote {len(t.content.encode())} bytes to {t.name}"),
)}


def parser_of(dialect: str) -> Callable[[dict[str, Any]], tuple]:
    """The daemon's request parser for a dialect (returns (model, Conversation, ...))."""
    from mtplxd.api.anthropic import parse_messages_request
    from mtplxd.api.openai import parse_chat_request
    from mtplxd.api.responses import parse_responses_request
    return {"chat": parse_chat_request, "anthropic": parse_messages_request,
            "responses": parse_responses_request}[dialect]


# --- editing the recorded wire bodies ----------------------------------------------------

def _load(name: str, cwd: str) -> dict[str, Any]:
    """A recorded body with its working directory replaced (it appears in system prompts)."""
    return json.loads((RECORDED / name).read_text().replace(RECORDED_CWD, cwd))


def _set_last_user_text(body: dict[str, Any], dialect: str, text: str) -> None:
    """Replace the text of the last user message (the agent's task) in place."""
    items = body["input"] if dialect == "responses" else body["messages"]
    users = [m for m in items if m.get("role") == "user" and m.get("type", "message") == "message"
             and not _is_tool_result(m)]
    last = users[-1]
    if isinstance(last["content"], str):
        last["content"] = text
    else:
        last["content"][-1]["text"] = text


def _is_tool_result(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(p.get("type") == "tool_result" for p in content)


def _set_tool_exchange(body: dict[str, Any], spec: AgentSpec, arguments: dict[str, Any],
                       output: str) -> None:
    """Make the recorded tool call `spec.tool(arguments)` and its result `output`, in place."""
    wire_args = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))  # agents send compact JSON
    if spec.dialect == "responses":
        for item in body["input"]:
            if item.get("type") == "function_call":
                item.update(name=spec.tool, arguments=wire_args)
            elif item.get("type") == "function_call_output":
                item["output"] = output
    elif spec.dialect == "anthropic":
        for message in body["messages"]:
            for part in message["content"] if isinstance(message["content"], list) else []:
                if part.get("type") == "tool_use":
                    part.update(name=spec.tool, input=arguments)
                elif part.get("type") == "tool_result":
                    part["content"] = output
    else:
        for message in body["messages"]:
            for call in message.get("tool_calls") or []:
                call["function"].update(name=spec.tool, arguments=wire_args)
            if message["role"] == "tool":
                message["content"] = output
                if "name" in message:
                    message["name"] = spec.tool


def request_body(spec: AgentSpec, task: FileTask, kind: str) -> dict[str, Any]:
    """The agent's request for `task`: its first request ("call") or the one after the write ("final")."""
    body = _load(spec.first if kind == "call" else spec.tool_result, task.cwd)
    _set_last_user_text(body, spec.dialect, spec.user_text(task))
    if kind == "final":
        _set_tool_exchange(body, spec, spec.arguments(task), spec.result(task))
    return body


def call_text(tool: str, arguments: dict[str, Any]) -> str:
    """A tool call as the chat template writes an assistant's call (arguments through `tojson`)."""
    return ('<tool_call>\n{"name": "' + tool + '", "arguments": '
            + json.dumps(arguments, ensure_ascii=False) + "}\n</tool_call>")


def target_text(spec: AgentSpec, task: FileTask, kind: str) -> str:
    """What the model must write after the rendered prompt, end-of-turn token included."""
    answer = call_text(spec.tool, spec.arguments(task)) if kind == "call" else f"Created {task.name}."
    return answer + "<|im_end|>"


# --- rendering as the daemon does --------------------------------------------------------

@dataclass
class _ModelInfo:
    id: str


class TemplateModel:
    """What `chat_format.render_chat` reads of a loaded model: its tokenizer and id."""

    def __init__(self, path: Path = EMBEDDED) -> None:
        from mlx_lm.utils import load_tokenizer  # the daemon's loader uses the same call
        config = json.loads((path / "config.json").read_text())
        self.tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        self.info = _ModelInfo(path.name)
        self.vision = None


def render_request(model: TemplateModel, spec: AgentSpec, body: dict[str, Any]) -> list[int]:
    """The prompt token ids the daemon would prefill for this request body."""
    from mtplxd.api.chat_format import render_chat
    conversation = parser_of(spec.dialect)(body)[1]
    return render_chat(model, conversation).prompt_ids


@dataclass
class Example:
    """One supervised example: prompt ids, target ids (loss on these only) and what it is."""

    agent: str
    kind: str            # "call" or "final"
    split: str           # "train" or "heldout"
    task: dict[str, str]
    prompt_ids: list[int]
    target_ids: list[int]
    target_text: str


def make_example(model: TemplateModel, spec: AgentSpec, task: FileTask, kind: str, split: str) -> Example:
    """Render one example for `spec`."""
    prompt_ids = render_request(model, spec, request_body(spec, task, kind))
    text = target_text(spec, task, kind)
    target_ids = list(model.tokenizer.encode(text, add_special_tokens=False))
    return Example(spec.name, kind, split, asdict(task), prompt_ids, target_ids, text)


def tasks_for(seed: int, count: int, heldout: bool) -> list[FileTask]:
    """`count` distinct tasks (by prompt and cwd), none touching the held-out test task in train."""
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    out: list[FileTask] = []
    while len(out) < count:
        task = make_task(rng, heldout)
        if (task.prompt, task.name) in seen or (not heldout and is_holdout(task)):
            continue
        seen.add((task.prompt, task.name))
        out.append(task)
    return out


def build(model: TemplateModel, per_agent: int, heldout_per_agent: int, seed: int,
          agents: list[str] | None = None) -> dict[str, list[Example]]:
    """Train and held-out examples for every agent, both kinds; held-out adds the hello.py task."""
    splits: dict[str, list[Example]] = {"train": [], "heldout": []}
    for name in agents or list(AGENTS):
        spec = AGENTS[name]
        i = list(AGENTS).index(name)  # seeds by the agent, not its place in `agents`
        train = tasks_for(seed * 1000 + i, per_agent, heldout=False)
        held = tasks_for(seed * 1000 + 500 + i, heldout_per_agent, heldout=True)
        held.append(holdout_task(random.Random(seed * 1000 + 900 + i)))
        for split, tasks in (("train", train), ("heldout", held)):
            for task in tasks:
                for kind in ("call", "final"):
                    splits[split].append(make_example(model, spec, task, kind, split))
    return splits


# --- copy drills: the same calls from short prompts, with names nobody could memorize -----
#
# The fine-tuned model learned each agent's tool-call format but not to copy the task's file
# name and text into it (training/README.md, "Agent tasks"): 60 tasks per agent drawn from a
# few dozen names teach names, not copying. A drill is the same call from a short request
# (a two-line system prompt with the working directory, the agent's write tool and at most two
# of its other tools, the task), with a name and text made of random syllables as often as of
# words, so the call can only be right by copying. Short prompts make drills cheap: a training
# step takes a batch of them beside one long agent example.

SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou") + ("qua", "sho", "chi", "tri", "xen")
DRILL_WORDS = ("alpha", "beta", "cache", "data", "delta", "entry", "field", "graph", "index", "kernel",
               "layer", "mesh", "node", "parse", "query", "queue", "route", "stack", "token", "vector",
               "apple", "brick", "cloud", "dance", "eagle", "flame", "grape", "honey", "ivory", "jolly",
               "lemon", "maple", "noble", "olive", "pearl", "quick", "robin", "stone", "tiger", "unity",
               "vivid", "wheat", "young", "zebra", "amber", "cedar", "dusk", "frost", "glow", "haze")
DRILL_SYSTEMS = ("You are a coding agent. Working directory: {cwd}",
                 "You help with code in {cwd}. Use the tools to change files.",
                 "Current directory: {cwd}\nDo what the user asks with your tools.")


def _drill_word(rng: random.Random) -> str:
    """A real word or a pseudo-word of 2-3 random syllables (never "hello")."""
    if rng.random() < 0.5:
        return rng.choice(DRILL_WORDS)
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))


def drill_task(rng: random.Random) -> FileTask:
    """A file task whose name and text are random words and syllables."""
    parts = [_drill_word(rng) for _ in range(rng.randint(1, 2))]
    stem = rng.choice(("_", "-", "")).join(parts) + (str(rng.randrange(10)) if rng.random() < 0.2 else "")
    name = f"{stem}.{rng.choice(KINDS)}"
    text = " ".join(_drill_word(rng) for _ in range(rng.randint(1, 3)))
    verb = "contains" if name.endswith(".txt") else "prints"
    prompt = rng.choice(TRAIN_WORDINGS[verb]).format(name=name, text=text)
    return FileTask(prompt, name, text, file_content(name, text), random_cwd(rng))


def _tool_name(tool: dict[str, Any]) -> str:
    return tool.get("name") or tool.get("function", {}).get("name")


def drill_body(spec: AgentSpec, task: FileTask, rng: random.Random, others: int) -> dict[str, Any]:
    """The agent's first request cut short: a two-line system prompt naming the working
    directory, the agent's write tool among `others` of its other tools, and the task."""
    body = _load(spec.first, task.cwd)
    tools = body["tools"]
    write = next(t for t in tools if _tool_name(t) == spec.tool)
    body["tools"] = rng.sample([t for t in tools if t is not write], k=min(others, len(tools) - 1)) + [write]
    rng.shuffle(body["tools"])
    system = rng.choice(DRILL_SYSTEMS).format(cwd=task.cwd)
    user = spec.user_text(task)
    if spec.dialect == "anthropic":
        body["system"] = [{"type": "text", "text": system}]
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": user}]}]
    elif spec.dialect == "responses":
        body["input"] = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": system}]},
                         {"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]}]
    else:
        body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return body


def drill_seed(seed: int, agent: str, index: int, split: str) -> int:
    """Drill `index` of an agent draws from its own seed, so any one can be rebuilt alone."""
    return ((seed * 10 + list(AGENTS).index(agent)) * 2 + (split == "heldout")) * 1_000_000 + index


def make_drill(model: TemplateModel, spec: AgentSpec, seed: int, index: int, split: str) -> Example:
    """Drill `index` of `spec` (kind "drill"): a short request and the write tool's call."""
    rng = random.Random(drill_seed(seed, spec.name, index, split))
    task = drill_task(rng)
    while is_holdout(task):
        task = drill_task(rng)
    text = target_text(spec, task, "call")
    target_ids = list(model.tokenizer.encode(text, add_special_tokens=False))
    # Up to two other tools, fewer where their schemas would pass DRILL_TOKENS (Claude Code's
    # Agent and Bash descriptions alone are thousands of tokens).
    for others in range(rng.randint(0, 2), -1, -1):
        prompt_ids = render_request(model, spec, drill_body(spec, task, random.Random(rng.random()), others))
        if len(prompt_ids) + len(target_ids) <= DRILL_TOKENS:
            break
    return Example(spec.name, "drill", split, asdict(task), prompt_ids, target_ids, text)


def build_drills(model: TemplateModel, per_agent: int, heldout_per_agent: int, seed: int,
                 agents: list[str] | None = None) -> list[Example]:
    """Train drills, then held-out ones (their own seeds), for every agent."""
    out = []
    for split, count in (("train", per_agent), ("heldout", heldout_per_agent)):
        for name in agents or list(AGENTS):
            out += [make_drill(model, AGENTS[name], seed, i, split) for i in range(count)]
    return out


def write_split(examples: list[Example], path: Path) -> None:
    """One JSON object a line, xz-compressed (the agents' long prompts repeat: ~50x smaller)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(asdict(e), separators=(",", ":")) + "\n" for e in examples)
    path.write_bytes(lzma.compress(lines.encode(), preset=9 | lzma.PRESET_EXTREME))


def read_split(path: Path) -> list[Example]:
    """Examples written by write_split (stdlib only: the training machine has no tokenizer)."""
    text = lzma.decompress(path.read_bytes()).decode()
    return [Example(**json.loads(line)) for line in text.splitlines() if line]


def main(argv: list[str] | None = None) -> None:
    """CLI: write agent_train.jsonl.xz and agent_heldout.jsonl.xz into --out."""
    ap = argparse.ArgumentParser(description="Render the agents' small file tasks for supervised fine-tuning.")
    ap.add_argument("--out", type=Path, default=REPO / "training" / "agent_data")
    ap.add_argument("--per-agent", type=int, default=60, help="training tasks per agent (x2 examples)")
    ap.add_argument("--heldout-per-agent", type=int, default=6, help="unseen held-out tasks per agent, plus hello.py")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--agents", default=",".join(AGENTS))
    ap.add_argument("--drills-per-agent", type=int, default=DRILLS_PER_AGENT,
                    help="copy drills per agent (agent_drills.jsonl.xz; 0: leave the file alone)")
    ap.add_argument("--heldout-drills-per-agent", type=int, default=HELDOUT_DRILLS_PER_AGENT)
    a = ap.parse_args(argv)
    model, agents = TemplateModel(), a.agents.split(",")
    outputs = {f"agent_{split}": examples
               for split, examples in build(model, a.per_agent, a.heldout_per_agent, a.seed, agents).items()}
    if a.drills_per_agent:
        outputs["agent_drills"] = build_drills(model, a.drills_per_agent, a.heldout_drills_per_agent,
                                               a.seed, agents)
    for stem, examples in outputs.items():
        path = a.out / f"{stem}.jsonl.xz"
        write_split(examples, path)
        tokens = sum(len(e.prompt_ids) + len(e.target_ids) for e in examples)
        print(f"{path}: {len(examples)} examples, {tokens} tokens, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
