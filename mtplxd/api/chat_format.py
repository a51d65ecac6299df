"""Chat template application: a Conversation becomes prompt token ids.

Tokenizer-only work (no MLX): runs in a worker thread through `Generations.on_tokenizer`, so
a request's template never waits behind another request's generation. Decides three things the output parser needs to know:
- whether the prompt already opened `<think>` (the model's answer starts inside reasoning),
- the forced opener of a tool call when `tool_choice` is "required" or names a tool (the
  prompt ends with `<tool_call>` and, for a named tool, the call's name: the model can only
  continue the call; the opener is fed to the output parser as if the model had written it),
- the model's tool-call dialect (Qwen's `<tool_call>` with XML `<function=...>` or JSON
  bodies, or LFM2's pythonic `<|tool_call_start|>[f(x=1)]<|tool_call_end|>`), and which
  reasoning-effort levels the model's family has.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mtplxd.api import pythonic_tools
from mtplxd.api.errors import invalid
from mtplxd.api.images import message_images, without_image_bytes
from mtplxd.api.parsers import QWEN_TOOLS, THINK_CLOSE, ToolDialect
from mtplxd.api.schemas import Conversation
from mtplxd.engine.interface import PreparedImage
from mtplxd.engine.model.vision import ImageError, expand_placeholders

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


def effort_levels(template: str) -> dict[str, bool | None]:
    """The reasoning-effort levels a model's family has, from its chat template: level ->
    enable_thinking to pass (None: the template has no switch).

    A template with `enable_thinking` (Qwen) has every level; one that writes `<think>` with
    no switch (LFM2.5 thinking checkpoints) always reasons ("high" only); one with neither
    (LFM2 instruct) never does ("none" only).
    """
    if "enable_thinking" in template:
        return dict(EFFORT_THINKING)
    if "<think>" in template or "</think>" in template:
        return {"high": None}
    return {"none": None}


def check_effort(conversation: Conversation, template: str, model_id: str) -> None:
    """A 400 listing the family's levels when the requested effort is not one of them."""
    effort = conversation.reasoning_effort
    levels = effort_levels(template)
    if effort is not None and effort not in levels:
        raise invalid(f"model {model_id!r} has no reasoning effort {effort!r}; its levels are: "
                      f"{', '.join(levels)}. Send one of those or leave the effort out (in an "
                      "agent, set its reasoning effort for this model)", conversation.effort_param,
                      code="invalid_reasoning_effort")


def tool_dialect(tokenizer: Any, template: str) -> ToolDialect:
    """The model's tool-call dialect: LFM2's pythonic markers when its template or vocabulary
    has them, else Qwen's `<tool_call>`."""
    marker = pythonic_tools.CALL_OPEN
    if marker in template or "<|tool_list_start|>" in template:
        return pythonic_tools.PYTHONIC_TOOLS
    # One token in the vocabulary, asked through encode: get_vocab() builds the whole vocabulary
    # as a dict, 86 ms on this CPU at a 151k-token vocabulary (Qwen's size), encode 0.2 ms.
    if single_token_id(tokenizer, marker) is not None:
        return pythonic_tools.PYTHONIC_TOOLS
    return QWEN_TOOLS


@dataclass
class RenderedPrompt:
    """A rendered chat prompt, ready for the engine."""

    prompt_ids: list[int]
    start_in_reasoning: bool  # the template opened <think>: output starts as reasoning
    output_prefix: str        # text the prompt forced as the start of the answer ("" usually)
    dialect: ToolDialect = QWEN_TOOLS  # how the model writes tool calls
    images: list[PreparedImage] = field(default_factory=list)  # in prompt order
    think_close_id: int | None = None  # `</think>` as one token (reasoning_tokens counts to it)


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
    check_effort(conversation, template, model.info.id)
    dialect = tool_dialect(tokenizer, template)
    messages = normalize_messages(conversation.messages)
    if not messages:
        raise invalid("`messages` must contain at least one message", "messages")
    if dialect is pythonic_tools.PYTHONIC_TOOLS and "tool_calls" not in template:
        messages = [_with_calls_as_text(m) for m in messages]
    images = message_images(messages)
    if images:
        vision = _vision_of(model)
        messages = without_image_bytes(messages)
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
    prefix = forced_tool_opener(forced, xml_style="<function=" in template, dialect=dialect)
    prompt_ids = list(tokenizer.encode(text + prefix, add_special_tokens=False))
    prepared: list[PreparedImage] = []
    if images:
        try:
            prepared = [vision.prepare(data) for data in images]
            prompt_ids = expand_placeholders(prompt_ids, vision.image_token_id, prepared)
        except ImageError as exc:
            raise invalid(f"image: {exc}", "messages", code="invalid_image") from None
    return RenderedPrompt(prompt_ids=prompt_ids,
                          start_in_reasoning=text.rstrip().endswith("<think>") and not prefix,
                          output_prefix=prefix, dialect=dialect, images=prepared,
                          think_close_id=single_token_id(tokenizer, THINK_CLOSE))


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of `text` where the tokenizer has it as one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _vision_of(model: Any) -> Any:
    """The model's vision tower, or a 400 naming the model when it has none."""
    vision = getattr(model, "vision", None)
    if vision is None:
        why = model.info.vision_reason or "it has no vision tower and takes text only"
        raise invalid(f"model {model.info.id!r} cannot read images: {why}. Send text only, or "
                      "load a vision checkpoint (see docs/models.md)", "messages",
                      code="model_has_no_vision")
    return vision


def _with_calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message whose tool calls are written into its content in the pythonic
    syntax: LFM2's template renders `content` only, and the model must see its own calls."""
    if message.get("role") != "assistant" or not message.get("tool_calls"):
        return message
    content = message.get("content") or ""
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": content + pythonic_tools.render_calls(message["tool_calls"])}


def forced_tool_opener(tool_choice: str | dict[str, Any], *, xml_style: bool,
                       dialect: ToolDialect = QWEN_TOOLS) -> str:
    """The answer's forced beginning for `tool_choice` "required" or a named function."""
    if tool_choice in ("auto", "none"):
        return ""
    if dialect is pythonic_tools.PYTHONIC_TOOLS:
        opener = dialect.open + "["
        return opener if tool_choice == "required" else opener + tool_choice["name"] + "("  # type: ignore[index]
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
