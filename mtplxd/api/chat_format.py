"""Chat template application: a Conversation becomes prompt token ids.

Tokenizer-only work (no MLX): runs in a worker thread through `Generations.on_tokenizer`, so
a request's template never waits behind another request's generation. Decides three things the output parser needs to know:
- whether the prompt already opened `<think>` (the model's answer starts inside reasoning),
- the forced opener of a tool call when `tool_choice` is "required" or names a tool (the
  prompt ends with `<tool_call>` and, for a named tool, the call's name: the model can only
  continue the call; the opener is fed to the output parser as if the model had written it),
- the template's tool-call style (Qwen XML `<function=...>` or JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mtplxd.api.errors import invalid
from mtplxd.api.schemas import Conversation

# reasoning_effort values (OpenAI's vocabulary plus "xhigh"). Qwen-style models have one
# switch, thinking on or off: "none" and "minimal" turn it off, the others on.
EFFORT_THINKING = {"none": False, "minimal": False, "low": True, "medium": True, "high": True,
                   "xhigh": True}


def thinking_for_effort(effort: str | None, param: str) -> bool | None:
    """enable_thinking for a reasoning effort (None: not given); unknown values are a 400."""
    if effort is None:
        return None
    if effort not in EFFORT_THINKING:
        raise invalid(f"`{param}` must be one of {', '.join(EFFORT_THINKING)}; got {effort!r}", param,
                      code="invalid_reasoning_effort")
    return EFFORT_THINKING[effort]


@dataclass
class RenderedPrompt:
    """A rendered chat prompt, ready for the engine."""

    prompt_ids: list[int]
    start_in_reasoning: bool  # the template opened <think>: output starts as reasoning
    output_prefix: str        # text the prompt forced as the start of the answer ("" usually)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge every system/developer message into one leading system message.

    Qwen 3.5+ templates refuse a system message anywhere but first, and agents send several
    (Codex: developer instructions mid-conversation); their text keeps its order.
    """
    system = [m["content"] for m in messages if m["role"] == "system" and m.get("content")]
    rest = [m for m in messages if m["role"] != "system"]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def render_chat(model: Any, conversation: Conversation) -> RenderedPrompt:
    """Apply the model's chat template to `conversation` (owner thread)."""
    tokenizer = model.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise invalid("this model has no chat template; use /v1/completions with a raw prompt",
                      "messages", code="no_chat_template")
    messages = normalize_messages(conversation.messages)
    if not messages:
        raise invalid("`messages` must contain at least one message", "messages")
    forced = conversation.tool_choice if conversation.tools_active else "auto"
    kwargs: dict[str, Any] = {}
    if conversation.enable_thinking is not None:
        kwargs["enable_thinking"] = conversation.enable_thinking
    if forced not in ("auto", "none"):
        kwargs["enable_thinking"] = False  # a forced call starts the answer at once
    tools = conversation.tools if conversation.tools_active else None
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                             tokenize=False, **kwargs)
    except Exception as exc:  # jinja raises its own errors for messages it refuses
        raise invalid(f"the chat template refused these messages: {exc}", "messages",
                      code="template_error") from None
    prefix = forced_tool_opener(forced, xml_style="<function=" in template)
    prompt_ids = list(tokenizer.encode(text + prefix, add_special_tokens=False))
    return RenderedPrompt(prompt_ids=prompt_ids,
                          start_in_reasoning=text.rstrip().endswith("<think>") and not prefix,
                          output_prefix=prefix)


def forced_tool_opener(tool_choice: str | dict[str, Any], *, xml_style: bool) -> str:
    """The answer's forced beginning for `tool_choice` "required" or a named function."""
    if tool_choice in ("auto", "none"):
        return ""
    if tool_choice == "required":
        return "<tool_call>\n"
    name = tool_choice["name"]  # type: ignore[index]
    if xml_style:
        return f"<tool_call>\n<function={name}>\n"
    return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '


def encode_text(model: Any, text: str) -> list[int]:
    """Token ids of a raw prompt (the tokenizer adds BOS when the model wants it)."""
    return list(model.tokenizer.encode(text))


def decode_tokens(model: Any, token_ids: list[int]) -> list[str]:
    """The text of each token on its own (echo/logprobs `tokens`)."""
    return [model.tokenizer.decode([t]) for t in token_ids]
