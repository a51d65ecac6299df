"""Qwen-VL's multimodal rotary positions (mRoPE) for prompts with images.

A Qwen vision-language checkpoint does not place an image's rows at consecutive 1-D
positions: each row sits at its (t, h, w) cell of the image's merged patch grid, offset by
the text before it, and the text after an image continues at (largest position so far) + 1.
From there every token i sits at 1-D position i + rope_delta with all three sections equal,
which is exactly the trunk's own 1-D rotary at offset i + rope_delta. The attention layers
rotate q/k by these positions, the three sections interleaved over the frequencies as the
family does.

mlx-vlm supplies both halves: `LanguageModel.get_rope_index` computes the prompt's positions
(called here with the checkpoint's mlx-vlm config, never copied) and the family's rotary
(`Qwen3_5RotaryEmbedding`, interleaved sections) rotates image rows by them.

How the trunk applies them without touching text-only models: `install` swaps, for a vision
checkpoint only, each full-attention layer's `rope` (trunk and MTP head) for a
`PositionedRoPE`, and the layer's class for a subclass that hands the rope the `rope_row`
(a `RowPositions`) carried by the KV cache entry it is called with (`attach`). A cache entry
without one (a text-only request) takes mlx-lm's own rope call unchanged. Every position is
derived from the cache offset, so verify blocks, rollback (trim), the MTP head's own cache
and session-bank restores land on the right positions without further bookkeeping. Text rows,
in the prompt and after it, go through the trunk's own rope at index + delta, so a text token
is rotated the same way whatever chunk or path reaches it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class PositionRun:
    """Tokens [start, end) of a row: text at 1-D position index + `delta` (`grid` None), or
    image rows at the (3, 1, end - start) positions in `grid`. `end` None: to the end of the row."""

    start: int
    end: int | None
    delta: int = 0
    grid: mx.array | None = None


class RowPositions:
    """Where each token of one row (one request) sits: the prompt's runs, then index + delta."""

    def __init__(self, runs: list[PositionRun], rope_delta: int) -> None:
        self.runs = runs  # contiguous from 0; the last one is text and open-ended
        self.rope_delta = rope_delta

    def delta_at(self, index: int) -> int | None:
        """The 1-D offset of token `index` (its position is index + delta), None for an image row."""
        for run in self.runs:
            if run.start <= index and (run.end is None or index < run.end):
                return run.delta if run.grid is None else None
        return None

    def pieces(self, offset: int, length: int) -> list[tuple[int, int, PositionRun]]:
        """The runs tokens offset..offset+length-1 cross: [(start, end, run)], in order."""
        stop = offset + length
        out = []
        for run in self.runs:
            end = stop if run.end is None else min(run.end, stop)
            start = max(run.start, offset)
            if start < end:
                out.append((start, end, run))
        return out


def rows_from_table(table: mx.array, image_rows: list[tuple[int, int]], rope_delta: int
                    ) -> RowPositions:
    """RowPositions from a prompt's (3, L) position table, its image runs [(start, count)]
    and its rope_delta. Text between images keeps one delta per run (its three sections are
    equal there); the text after the last image runs on with `rope_delta`."""
    length = table.shape[1]
    first = table[0].tolist()
    runs: list[PositionRun] = []
    at = 0
    for start, count in image_rows:
        if start > at:
            runs.append(PositionRun(at, start, delta=first[at] - at))
        runs.append(PositionRun(start, start + count, grid=table[:, start:start + count][:, None]))
        at = start + count
    runs.append(PositionRun(at, None, delta=rope_delta))
    # mlx-vlm's rule puts the text after the last image at index + rope_delta, which is what
    # decoding continues from; a version of it that did otherwise must not be served silently.
    if at < length and first[at] - at != rope_delta:
        raise ValueError("the prompt's positions after its last image are not index + rope_delta")
    return RowPositions(runs, rope_delta)


class PromptPositions:
    """A vision checkpoint's position rule: RowPositions for a prompt with images."""

    def __init__(self, family: str, config: dict[str, Any]) -> None:
        package = importlib.import_module(f"mlx_vlm.models.{family}")
        self.vlm_config = package.ModelConfig.from_dict(config)  # as mlx-vlm's loader builds it
        self._rope_index = package.LanguageModel.get_rope_index

    def for_prompt(self, prompt_ids: list[int], grids: list[tuple[int, int, int]],
                   image_rows: list[tuple[int, int]]) -> RowPositions:
        """Positions of every token of a prompt whose image placeholders are widened: each
        image's (t, h, w) patch grid and its run of rows [(start, count)], in order (mlx-vlm's
        get_rope_index computes them; it reads only the config of the model it belongs to)."""
        owner = SimpleNamespace(config=self.vlm_config)
        table, delta = self._rope_index(owner, mx.array(prompt_ids)[None], mx.array(grids))
        table = table[:, 0].astype(mx.int32)
        mx.eval(table)
        return rows_from_table(table, image_rows, int(delta.reshape(-1)[0].item()))


class PositionedRoPE(nn.Module):
    """The trunk's rope, made to read a row's multimodal positions while a row has some.

    `row` is set by the attention layer for the duration of one call (PositionedAttention);
    None: the trunk's own rope at the cache offset, exactly as before."""

    def __init__(self, base: nn.Module, multimodal: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.multimodal = multimodal  # mlx-vlm's family rotary (interleaved mRoPE)
        self.row: RowPositions | None = None

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if self.row is None:
            return self.base(x, offset=offset)
        offset = int(offset)
        parts = []
        for start, end, run in self.row.pieces(offset, x.shape[-2]):
            part = x[..., start - offset:end - offset, :]
            if run.grid is None:
                parts.append(self.base(part, offset=start + run.delta))
            else:
                grid = run.grid[..., start - run.start:end - run.start]
                parts.append(self.multimodal.apply_rotary(part, part, grid)[0])
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)


class PositionedAttention:
    """Mixed into an attention layer's class: hands the layer's PositionedRoPE the row
    positions its cache entry carries (`attach`) for this call."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        self.rope.row = getattr(cache, "rope_row", None)
        try:
            return super().__call__(x, mask, cache)
        finally:
            self.rope.row = None


_POSITIONED_CLASSES: dict[type, type] = {}


def _positioned_class(cls: type) -> type:
    if cls not in _POSITIONED_CLASSES:
        _POSITIONED_CLASSES[cls] = type(f"Positioned{cls.__name__}", (PositionedAttention, cls), {})
    return _POSITIONED_CLASSES[cls]


def family_rotary(positions: PromptPositions) -> nn.Module:
    """The family's multimodal rotary, built as mlx-vlm's Qwen3.5 attention builds it."""
    from mlx_vlm.models.qwen3_5.language import Qwen3_5RotaryEmbedding

    text = positions.vlm_config.text_config
    rope = text.rope_parameters
    return Qwen3_5RotaryEmbedding(int(text.head_dim * rope["partial_rotary_factor"]),
                                  max_position_embeddings=text.max_position_embeddings,
                                  base=rope["rope_theta"], mrope_section=rope["mrope_section"])


def install(attention_layers: Iterable[nn.Module], positions: PromptPositions) -> int:
    """Make these attention layers (a vision checkpoint's full-attention layers, MTP head
    included) apply row positions; returns how many were changed. Parameters are untouched."""
    rotary = family_rotary(positions)
    count = 0
    for attention in attention_layers:
        if isinstance(attention, PositionedAttention):
            continue
        attention.rope = PositionedRoPE(attention.rope, rotary)
        attention.__class__ = _positioned_class(type(attention))
        count += 1
    return count


def attention_layers(text_model: nn.Module, head: nn.Module | None) -> list[nn.Module]:
    """The full-attention modules of a hybrid trunk and of its MTP head's layer (a pipeline
    rank's trunk holds None for the layers other ranks run)."""
    layers = [layer for layer in text_model.model.layers
              if layer is not None and not layer.is_linear]
    if head is not None:
        layers += list(head.layers)
    return [layer.self_attn for layer in layers]


def attach(cache: list[Any] | None, row: RowPositions | None) -> None:
    """Give every entry of one row's cache list the row's positions (read by the attention
    layers that `install` changed); None leaves the cache on the 1-D path."""
    if cache is None or row is None:
        return
    for entry in cache:
        entry.rope_row = row
