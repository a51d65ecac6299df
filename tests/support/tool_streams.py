"""Tool-call streams read through the real SDKs' stream helpers: what each API dialect sent
for every call, fragment by fragment, and the SDK's own accumulated result."""

from __future__ import annotations

from typing import Any


def openai_chat_tool_stream(client: Any, **request: Any) -> tuple[list[Any], list[tuple[int, str]], Any]:
    """(first delta of each call: index, id, name; (index, argument fragment) in order, the
    empty one that rides with the name left out; the final completion) of a streamed chat."""
    chunks, fragments = [], []
    with client.chat.completions.stream(**request) as stream:
        for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
            elif event.type == "tool_calls.function.arguments.delta" and event.arguments_delta:
                fragments.append((event.index, event.arguments_delta))
        final = stream.get_final_completion()
    firsts = [c.choices[0].delta.tool_calls[0] for c in chunks
              if c.choices and c.choices[0].delta.tool_calls and c.choices[0].delta.tool_calls[0].id]
    return firsts, fragments, final


def anthropic_tool_stream(client: Any, **request: Any) -> tuple[dict[int, list[str]], Any]:
    """(each tool_use block's `input_json` fragments by block index; the final message)."""
    partial: dict[int, list[str]] = {}
    block = None
    with client.messages.stream(**request) as stream:
        for event in stream:
            if event.type == "content_block_start":
                block = event.index
            elif event.type == "input_json":
                partial.setdefault(block, []).append(event.partial_json)
        final = stream.get_final_message()
    return partial, final


def responses_tool_stream(client: Any, **request: Any) -> tuple[dict[int, list[str]], Any]:
    """(each function_call item's argument deltas by output index; the final response)."""
    deltas: dict[int, list[str]] = {}
    with client.responses.stream(**request) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                deltas.setdefault(event.output_index, []).append(event.delta)
        final = stream.get_final_response()
    return deltas, final
