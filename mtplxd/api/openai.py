"""OpenAI `/v1/chat/completions` and `/v1/completions` (incl. echo + logprobs prompt scoring)."""

from __future__ import annotations

import secrets
from typing import Any, AsyncIterator

from quart import Response

from mtplxd.api import chat_format, sse
from mtplxd.api.errors import APIError, OPENAI, error_body, invalid
from mtplxd.api.logprobs import LogprobItems, chat_content, completion_logprobs
from mtplxd.api.parsers import (
    ContentDelta, Event, ReasoningDelta, ToolCallDelta, ToolCallEvent, ToolCallStart,
)
from mtplxd.api.schemas import (
    Conversation, GenParams, Reader, arguments_object, function_tool, read_penalties,
    read_sampling, read_stop, reject_unsupported, text_of,
)
from mtplxd.api.service import TICK, Generations, Outcome, Plan

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
ALL_PARAMS_NOTE = "see docs/api.md for what this server supports"


# -- request parsing ----------------------------------------------------------------------

def parse_chat_request(data: dict[str, Any]) -> tuple[str | None, Conversation, GenParams, bool, bool]:
    """(model, conversation, params, stream, include_usage) from a chat completions body."""
    body = Reader(data)
    model = body.str("model")
    messages = [_chat_message(m, f"messages[{i}]") for i, m in enumerate(body.list("messages", required=True))]
    if not messages:
        raise invalid("`messages` must contain at least one message", "messages")
    tools = [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(body.list("tools"))]
    conversation = Conversation(messages=messages, tools=tools,
                                tool_choice=_tool_choice(body, tools))
    conversation.enable_thinking = _enable_thinking(body)
    conversation.reasoning_effort = body.str("reasoning_effort")
    if body.int("n", 1, low=1) != 1:
        raise invalid("`n` must be 1: this server returns one choice per request", "n",
                      code="unsupported_parameter")
    reject_unsupported(body, {
        "audio": "this server generates text only",
        "modalities": "this server generates text only",
    })
    _check_response_format(body)
    params = GenParams()
    read_sampling(body, params)
    read_penalties(body, params)
    params.stop = read_stop(body, "stop")
    # Pi sends max_completion_tokens, OpenCode and Hermes max_tokens: either is the cap.
    cap = body.int("max_completion_tokens", low=1)
    params.max_tokens = cap if cap is not None else body.int("max_tokens", low=1)
    params.logprobs = _chat_logprobs(body)
    stream = bool(body.bool("stream", False))
    options = body.obj("stream_options")
    include_usage = bool(options.bool("include_usage", False)) if options else False
    return model, conversation, params, stream, include_usage


def _chat_logprobs(body: Reader) -> int | None:
    """`logprobs: true` (+ `top_logprobs` 0..20) as the number of alternatives; None = off."""
    top = body.int("top_logprobs", low=0, high=20)
    if not body.bool("logprobs", False):
        if top is not None:
            raise invalid("`top_logprobs` needs `logprobs: true`", "top_logprobs")
        return None
    return top or 0


def _chat_message(raw: Any, name: str) -> dict[str, Any]:
    msg = Reader(raw, name)
    role = msg.str("role", required=True, choices=CHAT_ROLES)
    if role == "developer":
        role = "system"
    content = text_of(msg.raw("content"), f"{name}.content", images=role == "user")
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        reasoning = msg.raw("reasoning_content") or msg.raw("reasoning")
        if isinstance(reasoning, str) and reasoning:
            out["reasoning_content"] = reasoning
        calls = []
        for i, call in enumerate(msg.list("tool_calls")):
            where = f"{name}.tool_calls[{i}]"
            call_r = Reader(call, where)
            fn = call_r.obj("function")
            if fn is None:
                raise invalid(f"`{where}.function` is required", f"{where}.function")
            calls.append({
                "id": call_r.str("id", ""), "type": "function",
                "function": {"name": fn.str("name", required=True),
                             "arguments": arguments_object(fn.raw("arguments") or "{}", f"{where}.function.arguments")},
            })
        if calls:
            out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = msg.str("tool_call_id", "")
    return out


def _chat_tool(raw: Any, name: str) -> dict[str, Any]:
    tool = Reader(raw, name)
    kind = tool.str("type", "function")
    if kind != "function":
        raise invalid(f"`{name}.type` {kind!r} is not supported; only function tools are", f"{name}.type",
                      code="unsupported_tool")
    fn = tool.obj("function")
    if fn is None:
        raise invalid(f"`{name}.function` is required", f"{name}.function")
    return function_tool(fn.raw("name"), fn.raw("description"), fn.raw("parameters"), f"{name}.function")


def _tool_choice(body: Reader, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    choice = body.raw("tool_choice")
    if choice is None:
        return "auto"
    names = {t["function"]["name"] for t in tools}
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise invalid("`tool_choice` must be auto, none, required or a named function", "tool_choice")
        if choice == "required" and not tools:
            raise invalid("`tool_choice` is required but no `tools` were given", "tool_choice")
        return choice
    fn = Reader(choice, "tool_choice").obj("function")
    name = fn.str("name", required=True) if fn else None
    if name not in names:
        raise invalid(f"`tool_choice` names {name!r}, which is not among `tools`", "tool_choice")
    return {"name": name}


def _enable_thinking(body: Reader) -> bool | None:
    kwargs = body.obj("chat_template_kwargs")
    explicit = kwargs.bool("enable_thinking") if kwargs else None
    if explicit is None:
        explicit = body.bool("enable_thinking")  # Pi's "qwen" thinking format
    effort = chat_format.thinking_for_effort(body.str("reasoning_effort"), "reasoning_effort")
    return explicit if explicit is not None else effort


def _check_response_format(body: Reader) -> None:
    fmt = body.obj("response_format")
    if fmt is None:
        return
    kind = fmt.str("type", "text")
    if kind != "text":
        raise APIError(400, f"`response_format` {kind!r} is not supported: this server has no "
                            "constrained decoding; ask for JSON in the prompt instead",
                       code="unsupported_parameter", param="response_format")


# -- chat completions ---------------------------------------------------------------------

async def chat_completions(gen: Generations, data: dict[str, Any]) -> Response | tuple[dict, int, dict]:
    """POST /v1/chat/completions."""
    model, conversation, params, stream, include_usage = parse_chat_request(data)
    plan = await gen.plan_chat("chat", model, conversation, params)
    response_id = "chatcmpl-" + secrets.token_hex(12)
    if stream:
        await gen.open_stream(plan)
        return sse.sse_response(_chat_stream(gen, plan, response_id, include_usage), plan.headers())
    outcome = await gen.complete(plan)
    parsed = outcome.parsed
    message: dict[str, Any] = {"role": "assistant",
                               "content": parsed.content if (parsed.content or not parsed.tool_calls) else None}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [_tool_call_json(c) for c in parsed.tool_calls]
    logprobs = None
    if outcome.logprobs is not None:
        logprobs = {"content": chat_content(await gen.show_logprobs(outcome.logprobs)), "refusal": None}
    body = {
        "id": response_id, "object": "chat.completion", "created": plan.created, "model": plan.model_id,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                     "finish_reason": outcome.finish_reason}],
        "usage": outcome.usage_openai(),
        "mtplx_stats": outcome.mtplx_stats(),
    }
    return body, 200, plan.headers()


def _tool_call_json(call: ToolCallEvent) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _chat_delta(event: Event) -> dict[str, Any] | None:
    """The chunk delta for one event; None for a call's end (its arguments were streamed).
    A call streams as OpenAI's does: id, type and name with empty arguments first, then
    argument fragments under the same index."""
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, ToolCallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    if isinstance(event, ToolCallDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return None


async def _chat_stream(gen: Generations, plan: Plan, response_id: str,
                       include_usage: bool) -> AsyncIterator[bytes]:
    base = {"id": response_id, "object": "chat.completion.chunk", "created": plan.created,
            "model": plan.model_id}

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None, **extra: Any) -> bytes:
        return sse.openai_frame({**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                                        "finish_reason": finish}], **extra})

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for item in gen.stream(plan):
            if item is TICK:
                yield sse.COMMENT_KEEPALIVE
            elif isinstance(item, LogprobItems):
                # The tokens' logprobs go out as they are decoded, in a chunk of their own:
                # their text may still be held back by the output parser.
                content = chat_content(await gen.show_logprobs(item.entries))
                yield chunk({}, logprobs={"content": content, "refusal": None})
            elif isinstance(item, Outcome):
                yield from_outcome_chat(base, item, include_usage)
            else:
                for event in item:
                    delta = _chat_delta(event)
                    if delta is not None:
                        yield chunk(delta)
    except Exception as exc:  # the stream already started: end it with an error frame
        yield sse.openai_frame(error_body(as_api_error(exc), OPENAI))
    yield sse.OPENAI_DONE


def from_outcome_chat(base: dict[str, Any], outcome: Outcome, include_usage: bool) -> bytes:
    """The terminal chunk(s): finish_reason, then usage when asked; mtplx_stats on the last."""
    stats = outcome.mtplx_stats()
    finish = {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                   "finish_reason": outcome.finish_reason}]}
    if not include_usage:
        return sse.openai_frame({**finish, "mtplx_stats": stats})
    usage = {**base, "choices": [], "usage": outcome.usage_openai(), "mtplx_stats": stats}
    return sse.openai_frame(finish) + sse.openai_frame(usage)


def as_api_error(exc: BaseException) -> APIError:
    """Any failure as an APIError (unknown ones become a 500 with their message)."""
    if isinstance(exc, APIError):
        return exc
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", code="generation_failed")


# -- legacy completions -------------------------------------------------------------------

def parse_completion_request(data: dict[str, Any]) -> tuple[str | None, Any, GenParams, bool, bool, bool, int | None]:
    """(model, prompt, params, stream, include_usage, echo, logprobs) from a completions body."""
    body = Reader(data)
    model = body.str("model")
    prompt = _one_prompt(body.raw("prompt"))
    for key in ("n", "best_of"):
        if body.int(key, 1, low=1) != 1:
            raise invalid(f"`{key}` must be 1", key, code="unsupported_parameter")
    reject_unsupported(body, {"suffix": "insertion (fill-in-the-middle) is not supported"})
    params = GenParams()
    read_sampling(body, params)
    read_penalties(body, params)
    params.stop = read_stop(body, "stop")
    params.max_tokens = body.int("max_tokens", low=0)
    echo = bool(body.bool("echo", False))
    logprobs = body.int("logprobs", low=0, high=20)
    stream = bool(body.bool("stream", False))
    options = body.obj("stream_options")
    include_usage = bool(options.bool("include_usage", False)) if options else False
    if logprobs is not None and params.max_tokens == 0 and not echo:
        raise invalid("`logprobs` with `max_tokens: 0` needs `echo: true`", "echo")
    params.logprobs = logprobs
    return model, prompt, params, stream, include_usage, echo, logprobs


def _one_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("`prompt` is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return prompt
    raise invalid("`prompt` must be one string or one array of token ids (batches are not supported)",
                  "prompt")


async def completions(gen: Generations, data: dict[str, Any]) -> Response | tuple[dict, int, dict]:
    """POST /v1/completions."""
    model_name, prompt, params, stream, include_usage, echo, logprobs = parse_completion_request(data)
    model = gen.require_model(model_name)
    if isinstance(prompt, str):
        prompt_ids = await gen.on_tokenizer(lambda m: chat_format.encode_text(m, prompt))
    else:
        vocab = model.info.vocab_size
        if any(t >= vocab for t in prompt):
            raise invalid(f"`prompt` has token ids outside the vocabulary (size {vocab})", "prompt")
        prompt_ids = list(prompt)
    response_id = "cmpl-" + secrets.token_hex(12)
    if params.max_tokens == 0:
        return await _score_prompt(gen, model.info.id, response_id, prompt, prompt_ids, echo, logprobs,
                                   stream, include_usage)
    plan = await gen.plan_prompt("completions", model_name, prompt_ids, params)
    echo_text = ""
    if echo:
        echo_text = prompt if isinstance(prompt, str) else "".join(
            await gen.on_tokenizer(lambda m: chat_format.decode_tokens(m, prompt_ids)))
    prompt_block = await _prompt_logprobs(gen, prompt_ids) if echo and logprobs is not None else None
    if stream:
        await gen.open_stream(plan)
        return sse.sse_response(_completion_stream(gen, plan, response_id, echo_text, prompt_block,
                                                   include_usage), plan.headers())
    outcome = await gen.complete(plan)
    choice_logprobs = None
    if outcome.logprobs is not None:
        generated = completion_logprobs(await gen.show_logprobs(outcome.logprobs), len(echo_text))
        choice_logprobs = join_logprobs(prompt_block, generated)
    body = {
        "id": response_id, "object": "text_completion", "created": plan.created, "model": plan.model_id,
        "choices": [{"index": 0, "text": echo_text + outcome.result.text, "logprobs": choice_logprobs,
                     "finish_reason": "length" if outcome.result.finish_reason == "length" else "stop"}],
        "usage": outcome.usage_openai(),
        "mtplx_stats": outcome.mtplx_stats(),
    }
    return body, 200, plan.headers()


async def _prompt_logprobs(gen: Generations, prompt_ids: list[int]) -> dict[str, Any]:
    """The prompt's tokens scored (legacy completions' shape): the first has no logprob and
    no prompt position has alternatives (the scorer returns the chosen token's only)."""
    tokens = await gen.on_tokenizer(lambda m: chat_format.decode_tokens(m, prompt_ids))
    scores = await gen.score_prompt(prompt_ids)
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": scores, "top_logprobs": [None] * len(tokens),
            "text_offset": offsets, "token_ids": list(prompt_ids)}


def join_logprobs(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Two legacy `logprobs` blocks as one (the echoed prompt's, then the generated tokens')."""
    if first is None:
        return second
    return {key: first[key] + second[key] for key in second}


async def _score_prompt(gen: Generations, model_id: str, response_id: str, prompt: Any,
                        prompt_ids: list[int], echo: bool, logprobs: int | None, stream: bool,
                        include_usage: bool) -> Response | tuple[dict, int, dict]:
    """max_tokens 0: nothing is generated; with echo + logprobs the prompt is scored. The
    prompt must fit the context as a generation's would (the score is a prefill); streamed,
    the answer is one chunk, then the usage chunk when asked, then `[DONE]`."""
    import time

    gen.check_window(prompt_ids, output_tokens=0, param="prompt")
    choice: dict[str, Any] = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    if echo:
        tokens = await gen.on_tokenizer(lambda m: chat_format.decode_tokens(m, prompt_ids))
        choice["text"] = prompt if isinstance(prompt, str) else "".join(tokens)
        if logprobs is not None:
            choice["logprobs"] = await _prompt_logprobs(gen, prompt_ids)
    base = {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": model_id}
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": 0, "total_tokens": len(prompt_ids)}
    headers = {"X-MTPLX-Max-Tokens": "0"}
    if not stream:
        return {**base, "choices": [choice], "usage": usage}, 200, headers

    async def frames() -> AsyncIterator[bytes]:
        yield sse.openai_frame({**base, "choices": [choice]})
        if include_usage:
            yield sse.openai_frame({**base, "choices": [], "usage": usage})
        yield sse.OPENAI_DONE

    return sse.sse_response(frames(), headers)


async def _completion_stream(gen: Generations, plan: Plan, response_id: str, echo_text: str,
                             prompt_block: dict[str, Any] | None,
                             include_usage: bool) -> AsyncIterator[bytes]:
    base = {"id": response_id, "object": "text_completion", "created": plan.created, "model": plan.model_id}

    def chunk(text: str, finish: str | None = None, logprobs: Any = None, **extra: Any) -> bytes:
        return sse.openai_frame({**base, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                                        "finish_reason": finish}], **extra})

    if echo_text:
        yield chunk(echo_text, logprobs=prompt_block)
    offset = len(echo_text)
    try:
        async for item in gen.stream(plan):
            if item is TICK:
                yield sse.COMMENT_KEEPALIVE
            elif isinstance(item, LogprobItems):
                block = completion_logprobs(await gen.show_logprobs(item.entries), offset)
                offset += sum(len(token) for token in block["tokens"])
                yield chunk("", logprobs=block)
            elif isinstance(item, Outcome):
                finish = "length" if item.result.finish_reason == "length" else "stop"
                stats = item.mtplx_stats()
                if include_usage:
                    yield chunk("", finish)
                    yield sse.openai_frame({**base, "choices": [], "usage": item.usage_openai(),
                                            "mtplx_stats": stats})
                else:
                    yield chunk("", finish, mtplx_stats=stats)
            else:
                text = "".join(e.text for e in item if isinstance(e, ContentDelta))
                if text:
                    yield chunk(text)
    except Exception as exc:
        yield sse.openai_frame(error_body(as_api_error(exc), OPENAI))
    yield sse.OPENAI_DONE
