"""Typed request parsing shared by every dialect: a validating reader and the common shapes.

Each dialect module turns its JSON body into a `Conversation` (what the chat template
renders) and `GenParams` (how to sample), through `Reader`, which raises a 400 `APIError`
naming the offending parameter for anything of the wrong type or out of range. Nothing
here touches the model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from mtplxd.api.errors import APIError, invalid
from mtplxd.api.images import IMAGE_PART_TYPES, image_part

MAX_DEPTH = 8  # mirrors mtplxd.engine.model.loader.MAX_DEPTH (kept import-light)
MAX_STOP_SEQUENCES = 16


class Reader:
    """Typed access to one JSON object; errors name the parameter by its full path."""

    def __init__(self, data: Any, prefix: str = "") -> None:
        if not isinstance(data, dict):
            raise invalid(f"{prefix or 'the request body'} must be a JSON object", prefix or None)
        self.data = data
        self.prefix = prefix

    def name(self, key: str) -> str:
        """The parameter's full path, e.g. `messages[2].content`."""
        return f"{self.prefix}.{key}" if self.prefix else key

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str) -> Any:
        return self.data.get(key)

    def str(self, key: str, default: str | None = None, *, required: bool = False,
            choices: tuple[str, ...] | None = None) -> str | None:
        value = self.data.get(key)
        if value is None:
            if required:
                raise invalid(f"`{self.name(key)}` is required", self.name(key))
            return default
        if not isinstance(value, str):
            raise invalid(f"`{self.name(key)}` must be a string", self.name(key))
        if choices is not None and value not in choices:
            raise invalid(f"`{self.name(key)}` must be one of {', '.join(choices)}; got {value!r}",
                          self.name(key))
        return value

    def bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(f"`{self.name(key)}` must be true or false", self.name(key))
        return value

    def int(self, key: str, default: int | None = None, *, low: int | None = None,
            high: int | None = None) -> int | None:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and not value.is_integer()):
            raise invalid(f"`{self.name(key)}` must be an integer", self.name(key))
        value = int(value)
        _check_range(self.name(key), value, low, high)
        return value

    def float(self, key: str, default: float | None = None, *, low: float | None = None,
              high: float | None = None) -> float | None:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise invalid(f"`{self.name(key)}` must be a number", self.name(key))
        _check_range(self.name(key), float(value), low, high)
        return float(value)

    def list(self, key: str, *, required: bool = False) -> list[Any]:
        value = self.data.get(key)
        if value is None:
            if required:
                raise invalid(f"`{self.name(key)}` is required", self.name(key))
            return []
        if not isinstance(value, list):
            raise invalid(f"`{self.name(key)}` must be an array", self.name(key))
        return value

    def obj(self, key: str) -> "Reader | None":
        value = self.data.get(key)
        if value is None:
            return None
        return Reader(value, self.name(key))


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if low is not None and value < low:
        raise invalid(f"`{name}` must be >= {low}; got {value}", name)
    if high is not None and value > high:
        raise invalid(f"`{name}` must be <= {high}; got {value}", name)


@dataclass
class Conversation:
    """What the chat template renders: chat-format messages and function tools."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)  # [{"type":"function","function":{...}}]
    tool_choice: str | dict[str, Any] = "auto"  # "auto" | "none" | "required" | {"name": ...}
    enable_thinking: bool | None = None  # None: the template's default
    # The client's reasoning effort and the field it came in (its 400 names that field); the
    # model's family decides which levels exist (chat_format.effort_levels).
    reasoning_effort: str | None = None
    effort_param: str = "reasoning_effort"

    @property
    def tools_active(self) -> bool:
        """Whether tools go to the model (and tool calls are parsed out of its output)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_schemas(self) -> dict[str, dict[str, Any]]:
        """Parameter schemas by tool name (the XML tool-call parser types values with them)."""
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools}


@dataclass
class GenParams:
    """Sampling and length settings common to every dialect (None = server default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    depth: int | None = None
    repetition_guard: bool | None = None  # None = the server's `repetition_guard` setting
    logprobs: int | None = None  # alternatives per generated token's logprob; None = no logprobs
    ignore_eos: bool = False  # run to max_tokens through the model's end tokens (vLLM's field)


def read_sampling(body: Reader, params: GenParams) -> GenParams:
    """Fill the sampler fields every dialect shares (temperature, top_p, ..., mtp_depth)."""
    params.temperature = body.float("temperature", low=0.0, high=2.0)
    params.top_p = body.float("top_p", low=0.0, high=1.0)
    if params.top_p == 0.0:
        raise invalid("`top_p` must be greater than 0", "top_p")
    top_k = body.int("top_k", low=-1, high=1_000_000)
    params.top_k = None if top_k is None else max(top_k, 0)  # -1 means off, as in vLLM
    params.min_p = body.float("min_p", low=0.0, high=1.0)
    params.repetition_penalty = body.float("repetition_penalty", 1.0, low=0.01, high=10.0)
    params.seed = body.int("seed", low=-(2 ** 63), high=2 ** 64 - 1)
    if params.seed is not None:
        params.seed %= 2 ** 63
    params.depth = body.int("mtp_depth", low=0, high=MAX_DEPTH)
    params.repetition_guard = body.bool("repetition_guard")
    params.ignore_eos = body.bool("ignore_eos", False)
    return params


def read_penalties(body: Reader, params: GenParams) -> None:
    """OpenAI-style presence/frequency penalties (-2..2)."""
    params.presence_penalty = body.float("presence_penalty", 0.0, low=-2.0, high=2.0)
    params.frequency_penalty = body.float("frequency_penalty", 0.0, low=-2.0, high=2.0)


def read_stop(body: Reader, key: str) -> list[str]:
    """`stop` as a string or a list of non-empty strings."""
    value = body.raw(key)
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid(f"`{body.name(key)}` must be a string or an array of strings", body.name(key))
    if len(items) > MAX_STOP_SEQUENCES:
        raise invalid(f"`{body.name(key)}` allows at most {MAX_STOP_SEQUENCES} sequences", body.name(key))
    return [s for s in items if s]


def text_of(content: Any, name: str, *, text_types: tuple[str, ...] = ("text", "input_text", "output_text"),
            images: bool = False) -> Any:
    """Text of a message `content`: a string, or an array of text parts joined in order.

    With `images` (user turns), image parts are read too: content with an image becomes a
    list of `{"type": "text", "text": ...}` and `{"type": "image", "data": bytes}` parts in
    order (whether the model can see them is decided at render time)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"`{name}` must be a string or an array of content parts", name)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        part_name = f"{name}[{i}]"
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        reader = Reader(part, part_name)
        kind = reader.str("type", "text")
        if kind in text_types:
            parts.append({"type": "text", "text": reader.str("text", "")})
        elif images and kind in IMAGE_PART_TYPES:
            parts.append(image_part(kind, part, part_name))
        elif kind in IMAGE_PART_TYPES + ("input_audio", "input_file", "document"):
            raise invalid(f"`{part_name}` is a {kind} part; only text is accepted here", part_name,
                          code="unsupported_content")
        else:
            raise invalid(f"`{part_name}.type` {kind!r} is not a text part", part_name)
    return join_text_parts(parts)


def join_text_parts(parts: list[dict[str, Any]]) -> Any:
    """One string when `parts` are all text, else the parts with adjacent texts merged."""
    merged: list[dict[str, Any]] = []
    for part in parts:
        if part["type"] == "text" and merged and merged[-1]["type"] == "text":
            merged[-1] = {"type": "text", "text": merged[-1]["text"] + part["text"]}
        else:
            merged.append(part)
    if all(p["type"] == "text" for p in merged):
        return "".join(p["text"] for p in merged)
    return merged


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """A validated chat-format function tool."""
    if not isinstance(name, str) or not name:
        raise invalid(f"`{where}.name` must be a non-empty string", f"{where}.name")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise invalid(f"`{where}.parameters` must be a JSON schema object", f"{where}.parameters")
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if isinstance(description, str) and description:
        function["description"] = description
    return {"type": "function", "function": function}


def arguments_object(arguments: Any, name: str) -> Any:
    """Tool-call arguments as a JSON object when they parse (templates iterate them)."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    raise invalid(f"`{name}` must be a JSON string or object", name)


def require_json_object(raw: bytes) -> dict[str, Any]:
    """Parse a request body; a 400 for anything but a JSON object."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise invalid("the request body is not valid JSON", None, code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object", None)
    if _SURROGATE_ESCAPE.search(raw):
        _refuse_lone_surrogates(data)
    return data


# JSON may spell a UTF-16 surrogate as `\\uD800`; a valid pair decodes to one character, a lone
# half survives as a string no tokenizer (or UTF-8 encoder) accepts.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(data: Any) -> None:
    """A 400 naming the first field (by its full path) whose text holds a lone surrogate."""
    pending: list[tuple[str, Any]] = [("", data)]
    while pending:  # iterative: the body may nest as deep as the JSON parser allowed
        path, value = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                # The path itself may hold the surrogate (a key): show it escaped.
                path = path.encode("utf-8", "backslashreplace").decode()
                where = path or "the request body"
                raise invalid(f"`{where}` contains a lone UTF-16 surrogate (an unpaired \\uD800-"
                              "\\uDFFF escape), which is not text; send valid Unicode", path or None,
                              code="invalid_unicode") from None
        elif isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                pending += [(where, key), (where, item)]
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


@lru_cache(maxsize=8)
def generation_defaults(model_path: str) -> dict[str, Any]:
    """The model's own sampler defaults (generation_config.json), as vLLM and Ollama use them."""
    try:
        data = json.loads((Path(model_path) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: data[k] for k in keys if isinstance(data.get(k), (int, float)) and not isinstance(data.get(k), bool)}


def reject_unsupported(body: Reader, what: dict[str, str]) -> None:
    """400 for parameters this server cannot honour (key -> why / what to do instead)."""
    for key, why in what.items():
        if body.has(key) and body.raw(key) is not False:
            raise APIError(400, f"`{body.name(key)}` is not supported: {why}",
                           code="unsupported_parameter", param=body.name(key))
